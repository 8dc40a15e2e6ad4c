"""The managed-process base that Triton's and vLLM's launchers share, run on a small real child:
a Python HTTP server that can exit early, never get ready, ignore SIGTERM or leave a helper in
its process group."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest

from inferwatch.net import free_port
from inferwatch.process import ManagedProcess, StartError
from tests.fixtures.net import alive

CHILD = """
import http.server, signal, subprocess, sys, time
mode, port = sys.argv[1], int(sys.argv[2])
print("child starting", flush=True)
if mode == "exit":
    print("bad setting: no such thing", flush=True)
    sys.exit(3)
if mode == "never":
    time.sleep(600)
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "helper":
    helper = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    print("helper", helper.pid, flush=True)

class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/ready" else 404)
        self.end_headers()

http.server.HTTPServer(("127.0.0.1", port), Ready).serve_forever()
"""


class OwnError(StartError):
    """A launcher's own error type, as LauncherError is: start() raises it, not the base's."""


class Child(ManagedProcess):
    name = "child"
    error = OwnError
    ready_poll = 0.05
    stop_timeout = 10.0

    def __init__(self, mode: str, log_path: Path | None, ready_timeout: float = 30.0) -> None:
        super().__init__(log_path=log_path, ready_timeout=ready_timeout)
        self.mode, self.port = mode, free_port()

    @property
    def ready_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/ready"

    def prepare(self) -> tuple[list[str], dict[str, str]]:
        return [sys.executable, "-c", CHILD, self.mode, str(self.port)], {}


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_start_returns_once_ready_and_stop_ends_it_with_sigterm(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "child.log"
    with Child("serve", log) as child:
        assert child.running()
        assert httpx.get(child.ready_url).status_code == 200
        pid = child.proc.pid
    assert not child.running() and child.proc.returncode == -15
    assert _gone(pid)
    assert "child starting" in log.read_text()


def test_an_early_exit_is_one_line_with_the_last_log_line(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    child = Child("exit", log)
    with pytest.raises(OwnError) as err:
        child.start()
    assert str(err.value) == f"child exited with code 3 before ready: bad setting: no such thing (log: {log})"
    assert not child.running()


def test_not_ready_in_time_stops_the_child(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    child = Child("never", log, ready_timeout=1.0)
    with pytest.raises(OwnError) as err:
        child.start()
    assert str(err.value) == f"child was not ready after 1s: child starting (log: {log})"
    assert child.proc is not None and child.proc.returncode == -15


def test_without_a_log_the_output_is_discarded_and_the_error_says_so() -> None:
    child = Child("exit", None)
    with pytest.raises(OwnError) as err:
        child.start()
    assert str(err.value).endswith("before ready: no log (pass a log file)")


def test_sigterm_ignored_means_sigkill_after_the_timeout(tmp_path: Path) -> None:
    child = Child("stubborn", tmp_path / "child.log").start()
    started = time.monotonic()
    assert child.stop(timeout=0.5) == -9
    assert time.monotonic() - started < 10
    assert child.stop() == -9, "a second stop is harmless"


def test_stop_ends_what_is_left_of_the_process_group(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    child = Child("helper", log).start()
    helper = int(next(ln for ln in log.read_text().splitlines() if ln.startswith("helper")).split()[1])
    assert alive(helper)
    child.stop()
    assert _gone(helper), "the helper that ignores SIGTERM outlived stop()"


def test_stop_before_start_does_nothing() -> None:
    child = Child("serve", None)
    assert child.stop() is None and not child.running()
