"""Canary analysis on the live stack: the real Triton serving ranker v1 (baseline) and v2
(canary) side by side, the sidecar in front of it, a real Prometheus scraping the sidecar
every second. The windows are scaled down through the spec (a 20 s canary window), as
fleet.demo.yaml scales the alert windows.

Phases, each judged by `inferwatch canary` and by the generated Argo Rollouts and Flagger
templates' queries on the same Prometheus at the same instant, while Prometheus runs the
generated rules (InferenceCanaryRegression names the check that failed):
healthy canary -> pass; +600 ms injected into v2 -> fail; half of v2's requests failing ->
fail; v2 down to a trickle of traffic -> inconclusive.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import tritonclient.http as tritonhttp
import yaml

from alert_rules import generate
from inferwatch import contract as c
from inferwatch.canary import FAIL, INCONCLUSIVE, PASS, judge, templates
from inferwatch.spec import FleetSpec, duration_seconds, parse_spec
from reference_server import catalog, faults
from tests.fixtures.net import ROOT, Processes, free_port, inferwatch_cmd, wait_http
from tests.fixtures.sidecar import launch_sidecar

pytestmark = pytest.mark.integration

MODEL, BASELINE, CANARY = "ranker", "1", "2"
SCRAPE_S = 1
# fleet.demo.yaml with a canary section in seconds. v2 is a slower scorer by design (about
# 25 ms more per request), and v2 is always significantly slower, so only the margin keeps
# it from failing: two SLAs (200 ms) cover that and the stalls of a busy shared 2-core
# machine (the P99 of a 20 s window is a handful of requests), while +600 ms is far beyond.
CANARY_SPEC = {
    "window": "20s",
    "min_requests": 30,
    "confidence": 0.99,
    "max_error_ratio_increase": 0.02,
    "max_latency_increase": 2.0,
    "for": "10s",
}
SETTLE_S = 3  # scrape interval + a scrape's lag: the last requests of a phase are in Prometheus
CANARY_CLIENTS = 3
EXTRA_LATENCY_MS = 600


def demo_spec() -> tuple[FleetSpec, dict]:
    data = yaml.safe_load((ROOT / "fleet.demo.yaml").read_text())
    data["canary"] = dict(CANARY_SPEC)
    return parse_spec(data, "canary test spec"), data


@dataclass
class Live:
    spec: FleetSpec
    spec_path: Path
    prometheus: str
    triton_state: Path
    canary_pause: list[float]  # seconds each canary client waits between requests
    errors: list[str]


def _client(url: str, version: str, pause: list[float], stop: threading.Event, errors: list[str]) -> None:
    client = tritonhttp.InferenceServerClient(url, network_timeout=30)
    inputs = []
    for name, array in catalog.example_input(MODEL, batch=1, seed=1).items():
        tensor = tritonhttp.InferInput(name, list(array.shape), "FP32")
        tensor.set_data_from_numpy(array, binary_data=True)
        inputs.append(tensor)
    while not stop.is_set():
        try:
            client.infer(MODEL, inputs, model_version=version)
        except Exception as exc:  # injected errors are part of the data
            errors.append(str(exc)[:200])
        if pause[0]:
            stop.wait(pause[0])
    client.close()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, triton) -> Iterator[Live]:
    log_dir = tmp_path_factory.mktemp("canary-live")
    spec, data = demo_spec()
    spec_path = log_dir / "fleet.yaml"
    spec_path.write_text(yaml.safe_dump(data))
    procs = Processes(log_dir)
    stop = threading.Event()
    threads: list[threading.Thread] = []
    pause = [0.0]
    errors: list[str] = []
    try:
        with launch_sidecar(triton.http_url, triton.grpc_url, log_dir, "--spec", str(spec_path)) as sidecar:
            prom_port = free_port()
            target = sidecar.metrics_url.removeprefix("http://").removesuffix("/metrics")
            rules_dir = log_dir / "rules"
            generate.build(spec, rules_dir, pager_token_file=None)
            config = {
                "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
                "rule_files": [str(p) for p in generate.rule_files(rules_dir)],
                "scrape_configs": [
                    {"job_name": "inferwatch-sidecar", "static_configs": [{"targets": [target]}]}
                ],
            }
            (log_dir / "prometheus.yml").write_text(yaml.safe_dump(config))
            prom = procs.start(
                "prometheus",
                [
                    "prometheus",
                    f"--config.file={log_dir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={log_dir / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}",
                ],
            )
            wait_http(f"http://127.0.0.1:{prom_port}/-/ready", timeout=60, proc=prom)
            for version, clients, p in ((BASELINE, 1, [0.0]), (CANARY, CANARY_CLIENTS, pause)):
                for _ in range(clients):
                    t = threading.Thread(
                        target=_client, args=(sidecar.http_url, version, p, stop, errors), daemon=True
                    )
                    t.start()
                    threads.append(t)
            yield Live(spec, spec_path, f"http://127.0.0.1:{prom_port}", triton.state_dir, pause, errors)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        faults.clear(MODEL, state_dir=triton.state_dir)
        procs.stop_all()


def _wait_one_window(spec: FleetSpec) -> float:
    """Sleep until a whole window holds only the current phase; return the judging instant."""
    time.sleep(duration_seconds(spec.canary.window) + SETTLE_S)
    return time.time()


def _query(prometheus: str, query: str, at: float) -> list[float]:
    resp = httpx.get(f"{prometheus}/api/v1/query", params={"query": query, "time": at}, timeout=10)
    body = resp.json()
    assert body["status"] == "success", (query, body)
    return [float(r["value"][1]) for r in body["data"]["result"]]


def firing(live: Live, at: float) -> set[tuple[str, str]]:
    """(version, check) of each InferenceCanaryRegression firing for the model at ``at``."""
    query = f'{c.PROM_ALERTS.name}{{alertname="{c.ALERT_CANARY_REGRESSION}", alertstate="firing"}}'
    resp = httpx.get(f"{live.prometheus}/api/v1/query", params={"query": query, "time": at}, timeout=10)
    return {
        (r["metric"][c.L_VERSION], r["metric"][c.L_CHECK])
        for r in resp.json()["data"]["result"]
        if r["metric"][c.L_MODEL] == MODEL
    }


def _condition(text: str, result: list[float]) -> bool:
    """An Argo Rollouts condition of the form the generator writes: result[0] OP NUMBER."""
    m = re.fullmatch(r"result\[0\] (<=|>) ([0-9.e+-]+)", text)
    assert m, f"condition not of the generated form: {text}"
    value, limit = result[0], float(m.group(2))
    return value <= limit if m.group(1) == "<=" else value > limit


def argo_verdict(live: Live, at: float) -> tuple[str, dict[str, float]]:
    """What Argo Rollouts would decide from the AnalysisTemplate, its args substituted:
    a metric meeting its failureCondition fails the run, one meeting neither condition is
    inconclusive (Argo's rule when both are set)."""
    doc = templates.analysis_template(live.spec)
    args = {"model": MODEL, "baseline": BASELINE, "canary": CANARY}
    outcomes, values = [], {}
    for metric in doc["spec"]["metrics"]:
        query = metric["provider"]["prometheus"]["query"]
        for name, value in args.items():
            query = query.replace(f"{{{{args.{name}}}}}", value)
        assert "{{" not in query, query
        result = _query(live.prometheus, query, at)
        assert len(result) == 1, (metric["name"], result)  # NaN, not empty, with little traffic
        values[metric["name"]] = result[0]
        if _condition(metric["failureCondition"], result):
            outcomes.append(FAIL)
        elif _condition(metric["successCondition"], result):
            outcomes.append(PASS)
        else:
            outcomes.append(INCONCLUSIVE)
    verdict = FAIL if FAIL in outcomes else INCONCLUSIVE if INCONCLUSIVE in outcomes else PASS
    return verdict, values


def flagger_verdict(live: Live, at: float) -> str:
    """What Flagger's checks would give with the thresholds the generated header names: a
    value above its max fails, no value halts the rollout (here: inconclusive)."""
    limits = {name: limit for name, _, limit in templates.checks(live.spec, templates.FLAGGER, "", False)}
    outcomes = []
    for doc in templates.metric_templates(live.spec):
        query = doc["spec"]["query"].replace("{{ interval }}", live.spec.canary.window)
        for name, value in (("model", MODEL), ("baseline", BASELINE), ("canary", CANARY)):
            query = query.replace(f"{{{{ variables.{name} }}}}", value)
        assert "{{" not in query, query
        result = _query(live.prometheus, query, at)
        name = doc["metadata"]["name"].removeprefix(f"{templates.NAME}-")
        if not result:
            outcomes.append(INCONCLUSIVE)
        else:
            assert not math.isnan(result[0]), (name, result)
            outcomes.append(FAIL if result[0] > limits[name] else PASS)
    return FAIL if FAIL in outcomes else INCONCLUSIVE if INCONCLUSIVE in outcomes else PASS


def cli(live: Live, at: float) -> tuple[int, dict]:
    proc = subprocess.run(
        inferwatch_cmd(
            "canary", "--prometheus", live.prometheus, "--model", MODEL, "--baseline", BASELINE,
            "--canary", CANARY, "--spec", str(live.spec_path), "--at", f"{at:.3f}", "--json",
        ),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode in (0, 1, 2), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def judged(live: Live, at: float, expected: str) -> dict:
    """Judge by the CLI (exit code and JSON), the library and both templates; all must agree."""
    code, report = cli(live, at)
    checks = {c["name"]: c for c in report["checks"]}
    why = json.dumps(checks, indent=1)
    assert report["verdict"] == expected, why
    assert code == {PASS: 0, FAIL: 1, INCONCLUSIVE: 2}[expected] == report["exit_code"]
    report = judge(live.prometheus, MODEL, BASELINE, CANARY, live.spec, at=at)
    assert report.verdict == expected
    assert report.why == "; ".join(
        f"{n}: {ch['reason']}" for n, ch in checks.items() if ch["verdict"] == expected
    )
    argo, values = argo_verdict(live, at)
    assert argo == expected, (values, why)
    assert flagger_verdict(live, at) == expected, why
    return checks


def test_healthy_faulty_and_quiet_canaries(live: Live) -> None:
    try:
        # 1. healthy: v2 is slower by design, within the margin, with no errors.
        at = _wait_one_window(live.spec)
        checks = judged(live, at, PASS)
        assert checks["errors"]["verdict"] == checks["latency"]["verdict"] == PASS
        assert firing(live, at) == set()
        assert checks["latency"]["values"]["canary_count"] >= CANARY_SPEC["min_requests"]

        # 2. a latency fault on the canary: roll back.
        faults.set_fault(MODEL, CANARY, extra_latency_ms=EXTRA_LATENCY_MS, state_dir=live.triton_state)
        at = _wait_one_window(live.spec)
        checks = judged(live, at, FAIL)
        assert checks["latency"]["verdict"] == FAIL, checks["latency"]
        assert firing(live, at) == {(CANARY, "latency")}
        assert checks["errors"]["verdict"] == PASS
        assert checks["latency"]["p_value"] < 0.01
        assert checks["latency"]["values"]["canary_p99_seconds"] > EXTRA_LATENCY_MS / 1000

        # 3. an error fault: half of the canary's requests fail (HTTP 500, server errors).
        faults.set_fault(MODEL, CANARY, error_rate=0.5, state_dir=live.triton_state)
        at = _wait_one_window(live.spec)
        checks = judged(live, at, FAIL)
        assert checks["errors"]["verdict"] == FAIL, checks["errors"]
        # (The latency alert of phase 2 has resolved: its window holds only this phase.)
        assert firing(live, at) == {(CANARY, "errors")}, checks["latency"]
        assert checks["errors"]["values"]["canary_errors"] > 0
        assert checks["errors"]["values"]["baseline_errors"] == 0

        # 4. the canary healthy again but down to a trickle: too little traffic to judge.
        faults.clear(MODEL, state_dir=live.triton_state)
        live.canary_pause[0] = 3.0
        at = _wait_one_window(live.spec)
        checks = judged(live, at, INCONCLUSIVE)
        assert checks["errors"]["verdict"] == INCONCLUSIVE
        assert firing(live, at) == set()  # a canary this quiet is not compared
        assert "too little traffic" in checks["errors"]["reason"]
        assert checks["errors"]["values"]["canary_requests"] < CANARY_SPEC["min_requests"]
    finally:
        faults.clear(MODEL, state_dir=live.triton_state)
        live.canary_pause[0] = 0.0


def test_the_cli_answers_errors_with_exit_3_in_one_line(live: Live) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(inferwatch_cmd("canary", *args), capture_output=True, text=True, timeout=60)

    base = ("--model", MODEL, "--baseline", BASELINE, "--canary", CANARY)
    dead = run("--prometheus", f"http://127.0.0.1:{free_port()}", *base)
    assert dead.returncode == 3 and "cannot reach Prometheus" in dead.stderr
    assert len(dead.stderr.strip().splitlines()) == 1 and "Traceback" not in dead.stderr
    bad = run("--prometheus", live.prometheus, "--model", 'ranker"}', "--baseline", "1", "--canary", "2")
    assert bad.returncode == 3 and "--model" in bad.stderr
    window = run("--prometheus", live.prometheus, *base, "--window", "ten minutes")
    assert window.returncode == 3 and "--window" in window.stderr
    same = run("--prometheus", live.prometheus, "--model", MODEL, "--baseline", "1", "--canary", "1")
    assert same.returncode == 3 and "same version" in same.stderr
    assert run("--prometheus", live.prometheus, *base, "--bogus").returncode == 3
    table = run("--prometheus", live.prometheus, *base, "--spec", str(live.spec_path))
    assert table.returncode in (0, 1, 2), table.stderr
    for word in ("errors", "latency", "verdict:"):
        assert word in table.stdout


def test_token_latency_checks_run_when_the_contract_has_them(live: Live, monkeypatch) -> None:
    """TTFT/TPOT are judged like request latency once the contract defines the histograms,
    and left out (no row, no effect on the verdict) when the model has no series for them.
    Stand-ins: TTFT points at the request-duration histogram, which ranker has; TPOT at a
    name nothing exports."""
    labels = (c.L_MODEL, c.L_VERSION, c.L_PROTOCOL)
    monkeypatch.setattr(
        c, "TIME_TO_FIRST_TOKEN", c.Metric(c.REQUEST_DURATION.name, "histogram", "t", labels), raising=False
    )
    absent = c.REQUEST_DURATION.name + "_nothing"
    monkeypatch.setattr(c, "TIME_PER_OUTPUT_TOKEN", c.Metric(absent, "histogram", "t", labels), raising=False)
    report = judge(live.prometheus, MODEL, BASELINE, CANARY, live.spec, at=_wait_one_window(live.spec))
    checks = {ch.name: ch for ch in report.checks}
    assert set(checks) == {"errors", "latency", "ttft"}
    assert checks["ttft"].verdict in (PASS, FAIL) and checks["ttft"].p_value is not None
    assert "of baseline" in checks["ttft"].limit
    monkeypatch.delattr(c, "TIME_TO_FIRST_TOKEN")
    monkeypatch.delattr(c, "TIME_PER_OUTPUT_TOKEN")
    plain = judge(live.prometheus, MODEL, BASELINE, CANARY, live.spec, at=time.time())
    assert [ch.name for ch in plain.checks] == ["errors", "latency"]


def test_every_generated_rule_evaluates_cleanly_on_live_data(live: Live) -> None:
    deadline = time.monotonic() + 60
    while True:  # until every rule has been evaluated at least once
        groups = httpx.get(f"{live.prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
        pending = [r["name"] for g in groups for r in g["rules"] if r["health"] == "unknown"]
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert "inferwatch-canary" in {g["name"] for g in groups}
    bad = [
        (g["name"], r["name"], r.get("lastError")) for g in groups for r in g["rules"] if r["health"] != "ok"
    ]
    assert not bad, bad
