"""The Triton launcher: its one-line errors, and a clean stop on SIGTERM."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from reference_server import catalog, faults
from reference_server.launcher import LauncherError, TritonServer
from tests.fixtures.net import alive, free_port, inferwatch_cmd, wait_http

pytestmark = pytest.mark.integration


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        inferwatch_cmd(*args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def ports() -> list[str]:
    return [
        "--http-port",
        str(free_port()),
        "--grpc-port",
        str(free_port()),
        "--metrics-port",
        str(free_port()),
    ]


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("inferwatch: error:")]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_missing_binary_is_one_clear_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "tritonserver"
    proc = run_cli("triton", "--state-dir", str(tmp_path), *ports(), "--tritonserver", str(missing))
    line = one_error_line(proc)
    assert str(missing) in line and "--tritonserver" in line
    proc = run_cli(
        "triton", "--state-dir", str(tmp_path), *ports(), env={"INFERWATCH_TRITONSERVER": str(missing)}
    )
    line = one_error_line(proc)
    assert str(missing) in line and "INFERWATCH_TRITONSERVER" in line


def test_taken_port_is_one_clear_line(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        proc = run_cli(
            "triton", "--state-dir", str(tmp_path), "--http-port", str(free_port()),
            "--grpc-port", str(taken), "--metrics-port", str(free_port()),
        )  # fmt: skip
    line = one_error_line(proc)
    assert f"127.0.0.1:{taken}" in line and "--grpc-port" in line
    assert not (tmp_path / "triton" / "triton.log").exists(), "refused before starting anything"


def test_bad_port_number_and_missing_repository_are_refused(tmp_path: Path) -> None:
    proc = run_cli("triton", "--state-dir", str(tmp_path), "--http-port", "70000")
    assert "--http-port" in one_error_line(proc)
    missing = tmp_path / "no-repo"
    proc = run_cli("triton", "--state-dir", str(tmp_path), *ports(), "--model-repository", str(missing))
    assert f"model repository {missing} is not a directory" in one_error_line(proc)


def test_a_model_that_fails_to_load_is_named(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(catalog.MODEL_REPOSITORY / "ranker", repo / "broken")
    shutil.copy(catalog.MODEL_REPOSITORY / "reference_models.py", repo)
    cfg = (repo / "broken" / "config.pbtxt").read_text()
    cfg = cfg.replace('name: "ranker"', 'name: "broken"').replace('"ranker" }', '"no_such_kind" }')
    (repo / "broken" / "config.pbtxt").write_text(cfg)
    server = TritonServer(
        repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), state_dir_path=tmp_path
    )
    with pytest.raises(LauncherError) as err:
        server.start()
    msg = str(err.value)
    assert "\n" not in msg
    assert "model broken version" in msg and "failed to load" in msg and "no_such_kind" in msg
    assert str(server.log_path) in msg
    assert not server.running()


def test_cli_serves_until_sigterm_then_stops_cleanly(tmp_path: Path, processes) -> None:
    http, grpc, metrics = free_port(), free_port(), free_port()
    faults.set_fault("ranker", "2", error_rate=0.5, state_dir=tmp_path)  # left from an earlier run
    proc = processes.start(
        "triton",
        inferwatch_cmd(
            "triton", "--state-dir", str(tmp_path), "--http-port", str(http),
            "--grpc-port", str(grpc), "--metrics-port", str(metrics),
        ),
    )  # fmt: skip
    wait_http(f"http://127.0.0.1:{http}/v2/health/ready", timeout=180, proc=proc)
    assert httpx.get(f"http://127.0.0.1:{metrics}/metrics").status_code == 200
    deadline = time.monotonic() + 30  # the launcher's own readiness poll may trail Triton's by a beat
    while "triton ready" not in proc.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes.stop(proc, signal.SIGTERM) == 0
    # The launcher logs as every service does: one JSON object per line, in UTC.
    lines = [json.loads(ln) for ln in proc.log_path.read_text().splitlines() if ln.startswith("{")]
    by_msg = {line["msg"]: line for line in lines}
    assert {"starting triton", "triton ready", "stopping triton", "triton stopped"} <= set(by_msg)
    assert all(line["ts"].endswith("Z") and line["logger"] == "inferwatch.triton" for line in lines)
    fault = by_msg["fault in effect"]
    assert (fault["level"], fault["target"], fault["error_rate"]) == ("warning", "ranker@2", 0.5)
    assert (tmp_path / "triton" / "triton.log").is_file()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{http}/v2/health/live", timeout=2)


# Run as a separate interpreter so the gRPC threads are this script's alone: a channel kept busy
# by a thread (as the sidecar tests' clients are) while the launcher starts Triton five times,
# then a sixth Triton left running when the script is SIGKILLed.
GRPC_BUSY_STARTS = """
import sys, threading
import grpc
from reference_server.launcher import TritonServer
from inferwatch.net import free_port

state, target = sys.argv[1], sys.argv[2]
stop = threading.Event()
calls = [0]

def busy():
    with grpc.insecure_channel(target) as ch:
        live = ch.unary_unary("/inference.GRPCInferenceService/ServerLive")
        while not stop.is_set():
            try:
                live(b"", timeout=1)
            except grpc.RpcError:
                pass
            calls[0] += 1

threads = [threading.Thread(target=busy, daemon=True) for _ in range(4)]
for t in threads:
    t.start()

def server():
    return TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                        state_dir_path=state, ready_timeout=120,
                        extra_args=("--model-control-mode=explicit", "--load-model=ranker"))

for i in range(5):
    before = calls[0]
    with server():
        pass
    print("started", i, "grpc calls during start", calls[0] - before, flush=True)
last = server().start()
print("left running", last.proc.pid, flush=True)
threading.Event().wait()
"""


def test_starts_beside_live_grpc_threads_and_dies_with_its_parent(tmp_path: Path, triton) -> None:
    """No fork-time hook runs in a process with busy gRPC threads (a ``preexec_fn`` forked the
    launcher with them, and gRPC's fork handlers then crashed the child at random), and Triton
    still dies when the process that started it is killed without stopping it."""
    script = subprocess.Popen(
        [sys.executable, "-c", GRPC_BUSY_STARTS, str(tmp_path), triton.grpc_url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    lines: list[str] = []
    try:
        assert script.stdout is not None
        for line in script.stdout:
            lines.append(line.strip())
            if line.startswith("left running"):
                break
    finally:
        if script.poll() is None:
            script.kill()  # SIGKILL: the launcher gets no chance to stop Triton itself
        _out, err = script.communicate(timeout=60)
    started = [ln for ln in lines if ln.startswith("started")]
    assert len(started) == 5, f"{lines}\n{err[-3000:]}"
    assert all(int(ln.split()[-1]) > 0 for ln in started), "the gRPC threads were not busy during the starts"
    assert "fork" not in err, err[-3000:]
    assert lines[-1].startswith("left running"), f"{lines}\n{err[-3000:]}"
    orphan = int(lines[-1].split()[-1])
    deadline = time.monotonic() + 30
    while alive(orphan) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(orphan), "Triton outlived the process that started it"
