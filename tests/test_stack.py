"""``inferwatch up`` before anything starts: the generated configs (checked by the real
promtool, amtool and Prometheus) and the one-line refusals (missing binary, taken port,
bad spec, bad flag, a stack already running)."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from inferwatch import contract
from inferwatch.spec import duration_seconds, load_spec
from inferwatch.stack.config import LLM_KV_CACHE_BLOCKS
from inferwatch.stack.core import STACK_FILE, Stack, StackConfig, free_ports, parse_port_overrides
from tests.fixtures.net import ROOT, VENV_BIN, inferwatch_cmd, wait_http

DEMO_SPEC = ROOT / "fleet.demo.yaml"


def prepared(tmp_path: Path, spec: Path = DEMO_SPEC) -> Stack:
    stack = Stack(StackConfig(spec_path=spec, state_dir=tmp_path / "state", ports=free_ports()))
    stack.spec = load_spec(spec)
    stack.prepare()
    return stack


def test_generated_configs_pass_promtool_and_amtool(tmp_path: Path) -> None:
    stack = prepared(tmp_path)
    state, ports = stack.config.state_dir, stack.config.ports
    prom_file = state / "prometheus" / "prometheus.yml"
    am_file = state / "generated" / "alertmanager.yml"
    check = subprocess.run(["promtool", "check", "config", str(prom_file)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    check = subprocess.run(["amtool", "check-config", str(am_file)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr

    prom = yaml.safe_load(prom_file.read_text())
    assert prom["global"]["scrape_interval"] == "2s"
    assert prom["global"]["evaluation_interval"] == "2s"
    jobs = {j["job_name"]: j["static_configs"][0]["targets"] for j in prom["scrape_configs"]}
    assert jobs == {
        contract.JOB_SIDECAR: [f"127.0.0.1:{ports['sidecar_metrics']}"],
        contract.JOB_TRITON: [f"127.0.0.1:{ports['triton_metrics']}"],
        contract.JOB_GPU_EXPORTER: [f"127.0.0.1:{ports['gpu_exporter']}"],
    }
    # Prometheus sends every alert to both clustered Alertmanagers.
    assert prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == [
        f"127.0.0.1:{ports['alertmanager']}",
        f"127.0.0.1:{ports['alertmanager_2']}",
    ]

    # The stack keeps the spec it was generated from (the sidecar and the demo read it).
    assert (state / "spec.yaml").read_text() == DEMO_SPEC.read_text()

    # Every receiver delivers to this stack's pager, with the token the pager is started with.
    token_file = state / "pager.token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    am = yaml.safe_load(am_file.read_text())
    hooks = [h for r in am["receivers"] for h in r["webhook_configs"]]
    assert len(hooks) == len(am["receivers"]) == 3
    for hook in hooks:
        assert hook["url"] == f"http://127.0.0.1:{ports['pager']}/webhook"
        assert hook["http_config"]["authorization"]["credentials_file"] == str(token_file)
        assert hook["send_resolved"] is True
    # Routing keeps the spec's waits (the demo's are seconds).
    waits = {r["receiver"]: r["group_wait"] for r in am["route"]["routes"]}
    assert waits == {"pager": "2s", "ticket": "3s", "low-urgency": "5s"}


def test_prometheus_loads_the_rules_of_the_spec_in_use(tmp_path: Path, processes) -> None:
    """The rules Prometheus evaluates carry the demo spec's scaled windows."""
    stack = prepared(tmp_path)
    port = stack.config.ports["prometheus"]
    state = stack.config.state_dir
    proc = processes.start(
        "prometheus",
        [
            "prometheus",
            f"--config.file={state / 'prometheus' / 'prometheus.yml'}",
            f"--storage.tsdb.path={state / 'prometheus' / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--enable-feature=exemplar-storage",
        ],
    )
    wait_http(f"http://127.0.0.1:{port}/-/ready", timeout=60, proc=proc)
    groups = httpx.get(f"http://127.0.0.1:{port}/api/v1/rules", timeout=5).json()["data"]["groups"]
    alerts = {r["name"]: r for g in groups for r in g["rules"] if r["type"] == "alerting"}
    assert set(contract.TIERED_ALERTS) <= set(alerts)
    spec = load_spec(DEMO_SPEC)
    lat_for = duration_seconds(spec.alerts.latency.for_)
    gpu_for = duration_seconds(spec.alerts.gpu_memory.for_)
    assert alerts[contract.ALERT_HIGH_P99_LATENCY]["duration"] == lat_for < 60
    assert alerts[contract.ALERT_GPU_MEMORY_PRESSURE]["duration"] == gpu_for < 60
    # Tumbling error windows and the latency quantile's window, both the spec's (seconds here).
    assert f":{spec.alerts.error_rate.window}]" in alerts[contract.ALERT_HIGH_ERROR_RATE]["query"]
    recorded = {r["name"]: r["query"] for g in groups for r in g["rules"] if r["type"] == "recording"}
    # The quantile reads the buckets' rate, recorded once over the latency window.
    assert f"[{spec.alerts.latency.window}]" in recorded[contract.REC_LATENCY_BUCKET_RATE]
    assert contract.REC_LATENCY_BUCKET_RATE in recorded[contract.REC_LATENCY_QUANTILE]
    for name, severity in contract.TIERED_ALERTS.items():
        assert alerts[name]["labels"]["severity"] == severity
        assert alerts[name]["annotations"]["runbook_url"]
    assert all(g["interval"] == 2 for g in groups)


def test_the_two_alertmanagers_gossip_on_ports_of_their_own(tmp_path: Path) -> None:
    """Alertmanager's default gossip address is 0.0.0.0:9094, the second instance's web
    port: each instance names its gossip port, on the stack's host, and the other's."""
    assert contract.PORTS["alertmanager_2"] == 9094
    stack = prepared(tmp_path)
    ports = stack.config.ports
    cmds = {c.name: c.cmd for c in stack.components() if c.cmd[0] == "prometheus-alertmanager"}
    assert set(cmds) == {"alertmanager", "alertmanager-2"}

    def flag(cmd, name: str) -> str:
        [value] = [a.split("=", 1)[1] for a in cmd if a.startswith(f"--{name}=")]
        return value

    for name, web, gossip, peer in (
        ("alertmanager", "alertmanager", "alertmanager_cluster", "alertmanager_2_cluster"),
        ("alertmanager-2", "alertmanager_2", "alertmanager_2_cluster", "alertmanager_cluster"),
    ):
        assert flag(cmds[name], "web.listen-address") == f"127.0.0.1:{ports[web]}"
        assert flag(cmds[name], "cluster.listen-address") == f"127.0.0.1:{ports[gossip]}"
        assert flag(cmds[name], "cluster.peer") == f"127.0.0.1:{ports[peer]}"
        # The pager on loopback answers in milliseconds: the second in line waits 2 s, not 15.
        assert flag(cmds[name], "cluster.peer-timeout") == "2s"
    # Separate data dirs: each instance keeps its own notification log and silences.
    assert flag(cmds["alertmanager"], "storage.path") != flag(cmds["alertmanager-2"], "storage.path")
    # On the standard ports nothing collides with the 9094 web port.
    defaults = StackConfig(spec_path=DEMO_SPEC).ports
    assert len(set(defaults.values())) == len(defaults)
    assert (defaults["alertmanager_cluster"], defaults["alertmanager_2_cluster"]) == (9194, 9195)


def test_port_overrides_parse_and_refuse_bad_items() -> None:
    assert parse_port_overrides(["prometheus=19090", "sidecar-http=18010"]) == {
        "prometheus": 19090,
        "sidecar_http": 18010,
    }
    with pytest.raises(ValueError, match="NAME=PORT"):
        parse_port_overrides(["grafana=3000"])
    with pytest.raises(ValueError, match="not a TCP port"):
        parse_port_overrides(["prometheus=99999"])


# ---------------------------------------------------------------------------------------
# The command line: refusals are one line, non-zero, and start nothing.
# ---------------------------------------------------------------------------------------
def up(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        inferwatch_cmd("up", "--state-dir", str(tmp_path / "state"), *args),
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )


def assert_nothing_started(tmp_path: Path) -> None:
    state = tmp_path / "state"
    assert not (state / "logs").exists(), "a component was started"
    assert not (state / STACK_FILE).exists()


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("inferwatch: error: "), lines[0]
    return lines[0]


def test_a_missing_binary_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    # Only the venv on PATH: no prometheus, no prometheus-alertmanager.
    proc = up(tmp_path, "--free-ports", env={"PATH": str(VENV_BIN)})
    assert proc.returncode == 1
    line = one_line_error(proc)
    assert "prometheus, prometheus-alertmanager not found on PATH" in line
    assert "scripts/bootstrap" in line
    assert_nothing_started(tmp_path)


def test_a_taken_port_is_one_line_naming_it(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        proc = up(tmp_path, "--free-ports", "--port", f"alertmanager={port}")
    assert proc.returncode == 1
    line = one_line_error(proc)
    assert f"port {port} (alertmanager) is already in use" in line
    assert "--port alertmanager=PORT" in line
    assert_nothing_started(tmp_path)


def test_a_bad_spec_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "fleet.yaml"
    bad.write_text("alerts:\n  error_rate:\n    threshold: 5\n")
    proc = up(tmp_path, "--free-ports", "--spec", str(bad))
    assert proc.returncode == 1
    assert "alerts.error_rate.threshold" in one_line_error(proc)
    assert_nothing_started(tmp_path)


def test_a_bad_port_flag_is_a_usage_error(tmp_path: Path) -> None:
    proc = up(tmp_path, "--port", "prometheus=http")
    assert proc.returncode == 2
    assert "is not a TCP port" in one_line_error(proc)


def test_a_second_stack_in_the_same_state_dir_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    # A stack.json whose supervisor (this test process) is alive.
    info = {
        "state_dir": str(state),
        "spec_path": str(DEMO_SPEC),
        "ports": free_ports(),
        "host": "127.0.0.1",
        "supervisor_pid": os.getpid(),
        "gpu_backend": "simulated",
        "started_at": 0,
    }
    (state / STACK_FILE).write_text(json.dumps(info))
    proc = up(tmp_path, "--free-ports")
    assert proc.returncode == 1
    assert f"a stack is already running from {state} (pid {os.getpid()})" in one_line_error(proc)
    assert not (state / "logs").exists()


def test_free_ports_are_distinct_and_free() -> None:
    ports = free_ports()
    assert len(set(ports.values())) == len(ports)
    for port in ports.values():
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_demo_refuses_a_bad_rate_before_starting_anything(tmp_path: Path) -> None:
    proc = subprocess.run(
        inferwatch_cmd("demo", "--state-dir", str(tmp_path / "state"), "--free-ports", "--rate", "0"),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "--rate must be above 0" in one_line_error(proc)
    assert_nothing_started(tmp_path)


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line mentions ``text`` (the test's own state dir)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    out.append(int(entry.name))
            except OSError:
                pass
    return out


def test_a_component_that_is_not_ready_in_time_stops_what_started(tmp_path: Path) -> None:
    # Triton cannot be ready within a second: up must say so in one line and leave nothing.
    proc = up(tmp_path, "--free-ports", "--ready-timeout", "1")
    assert proc.returncode == 1
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("inferwatch: error: ")]
    assert len(errors) == 1, proc.stderr
    line = errors[0]
    assert "msg=stopped component=triton" in proc.stderr  # what started was stopped, and said so
    assert "triton not ready after 1s" in line
    assert str(tmp_path / "state" / "logs" / "triton.log") in line
    assert processes_mentioning(str(tmp_path / "state")) == []
    assert not (tmp_path / "state" / STACK_FILE).exists()


def test_a_ready_timeout_that_is_not_positive_is_a_usage_error(tmp_path: Path) -> None:
    proc = up(tmp_path, "--free-ports", "--ready-timeout", "0")
    assert proc.returncode == 2
    assert "--ready-timeout must be above 0 seconds" in one_line_error(proc)
    assert_nothing_started(tmp_path)


def test_up_llm_runs_vllm_and_a_sidecar_of_its_own_scraped_by_prometheus(tmp_path: Path) -> None:
    """``up --llm``: vLLM and an LLM sidecar in front of it (HTTP only), on the contract's
    ports, both scraped; without --llm neither runs and their ports are not checked."""
    assert (
        StackConfig(spec_path=DEMO_SPEC, llm=True).ports["llm_sidecar_http"]
        == contract.PORTS["llm_sidecar_http"]
    )
    plain = prepared(tmp_path / "plain")
    assert {"vllm", "llm-sidecar"}.isdisjoint(c.name for c in plain.components())
    prom = yaml.safe_load((tmp_path / "plain" / "state" / "prometheus" / "prometheus.yml").read_text())
    assert contract.JOB_VLLM not in {j["job_name"] for j in prom["scrape_configs"]}

    config = StackConfig(spec_path=DEMO_SPEC, state_dir=tmp_path / "state", ports=free_ports(), llm=True)
    stack = Stack(config)
    stack.spec = load_spec(DEMO_SPEC)
    stack.prepare()
    p = stack.config.ports
    comps = {c.name: c for c in stack.components()}
    names = list(comps)
    order = [names.index(n) for n in ("sidecar", "vllm", "llm-sidecar", "prometheus")]
    assert order == sorted(order)
    vllm, sidecar = comps["vllm"].cmd, comps["llm-sidecar"].cmd
    assert vllm[vllm.index("--port") + 1] == str(p["vllm"])
    # The small cache the LLM demo saturates, and priority scheduling for its batch requests.
    assert vllm[vllm.index("--kv-cache-blocks") + 1] == str(LLM_KV_CACHE_BLOCKS)
    assert vllm[vllm.index("--scheduling-policy") + 1] == "priority" and "--kv-cache-gib" not in vllm
    gib = Stack(
        StackConfig(
            spec_path=DEMO_SPEC, state_dir=tmp_path / "gib", ports=free_ports(), llm=True, kv_cache_gib=2
        )
    )
    gib_cmd = {c.name: c for c in gib.components()}["vllm"].cmd
    assert gib_cmd[gib_cmd.index("--kv-cache-gib") + 1] == "2" and "--kv-cache-blocks" not in gib_cmd
    assert sidecar[sidecar.index("--upstream-http") + 1] == f"127.0.0.1:{p['vllm']}"
    assert sidecar[sidecar.index("--http-port") + 1] == str(p["llm_sidecar_http"])
    assert sidecar[sidecar.index("--metrics-port") + 1] == str(p["llm_sidecar_metrics"])
    assert sidecar[sidecar.index("--grpc-port") + 1] == "0"
    prom = yaml.safe_load((tmp_path / "state" / "prometheus" / "prometheus.yml").read_text())
    targets = {j["job_name"]: j["static_configs"][0]["targets"] for j in prom["scrape_configs"]}
    assert targets[contract.JOB_VLLM] == [f"127.0.0.1:{p['vllm']}"]
    assert f"127.0.0.1:{p['llm_sidecar_metrics']}" in targets[contract.JOB_SIDECAR]


def test_demo_llm_refuses_a_running_stack_without_vllm(tmp_path: Path) -> None:
    from inferwatch.stack.config import port_names

    assert "vllm" not in port_names(False) and "vllm" in port_names(True)
    state = tmp_path / "state"
    state.mkdir()
    info = {
        "state_dir": str(state), "spec_path": str(DEMO_SPEC), "ports": free_ports(), "host": "127.0.0.1",
        "supervisor_pid": os.getpid(), "gpu_backend": "simulated", "started_at": 0.0,
    }  # fmt: skip
    (state / STACK_FILE).write_text(json.dumps(info))
    proc = subprocess.run(
        inferwatch_cmd("demo", "--scenario", "llm", "--state-dir", str(state)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    assert "has no vLLM" in proc.stderr and "up --llm" in proc.stderr
    assert len(proc.stderr.strip().splitlines()[-1]) < 300
