"""The LLM serving dashboard against live data: the real vLLM (``inferwatch vllm``) behind the
sidecar, under streaming traffic to both of its served names, both scraped every second by a
real Prometheus that runs the generated rules. Every panel query returns data, vLLM's and the
sidecar's; the rules give vLLM's series the model label; the snapshot renders every panel.

One vLLM start (35 to 90 s, about 3 GB) serves the whole module."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from alert_rules import generate
from dashboards import build, live, snapshot, urls
from inferwatch import contract as c
from inferwatch.spec import load_spec
from reference_server.llm.vllm_server import SERVED_NAMES
from tests.fixtures.net import ROOT, Processes, free_port, inferwatch_cmd, wait_http
from tests.fixtures.sidecar import launch_sidecar

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

SPEC = load_spec(ROOT / "fleet.demo.yaml")
DASHBOARD = build.build(SPEC)[urls.LLM_SERVING]
SCRAPE_S = 1
JOB_VLLM = "vllm"
# The series only the sidecar writes.
SIDECAR_SERIES = (
    *(m.name for m in c.SIDECAR_METRICS),
    c.REC_TTFT_QUANTILE,
    c.REC_TPOT_QUANTILE,
    c.REC_TTFT_SLA,
    c.REC_TPOT_SLA,
)
# Panels whose every query is on the sidecar's series.
SIDECAR_ONLY_PANELS = {
    "Time to first token: $model",
    "Time per output token: $model",
    "Cancelled streams and error events",
}
# Panels that cannot return data yet, and why (none: the sidecar measures LLM streams).
WITHOUT_DATA: set[str] = set()


def on_sidecar(expr: str) -> bool:
    return any(name in expr for name in SIDECAR_SERIES)


@dataclass
class Stack:
    prometheus: str
    vllm: str
    sidecar: str


def _stream(url: str, model: str, stop: threading.Event, errors: list[str]) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "tell me about monitoring " * 4}],
        "max_tokens": 24,
        "stream": True,
    }
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            try:
                with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
                    for _ in resp.iter_lines():
                        pass
            except httpx.HTTPError as exc:
                errors.append(str(exc)[:200])
                time.sleep(0.5)


def _leave(url: str, stop: threading.Event) -> None:
    """Every two seconds a stream whose client leaves after its first token (a 499)."""
    body = {"model": SERVED_NAMES[0], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}
    with httpx.Client(timeout=120) as client:
        while not stop.wait(2.0):
            try:
                with client.stream(
                    "POST", f"{url}/v1/chat/completions", json={**body, "stream": True}
                ) as resp:
                    next(resp.iter_lines())
            except (httpx.HTTPError, StopIteration):
                pass


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("llm-live")
    procs = Processes(log_dir)
    stop = threading.Event()
    threads: list[threading.Thread] = []
    vllm = None
    sidecar = contextlib.ExitStack()
    try:
        port = free_port()
        vllm = subprocess.Popen(
            inferwatch_cmd("vllm", "--port", str(port), "--log-file", str(log_dir / "vllm.log")),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        vllm_url = f"http://127.0.0.1:{port}"
        wait_http(f"{vllm_url}/v1/models", timeout=300, proc=vllm)
        sc = sidecar.enter_context(
            launch_sidecar(
                f"127.0.0.1:{port}",
                "127.0.0.1:1",
                log_dir,
                "--spec",
                str(ROOT / "fleet.demo.yaml"),
                "--grpc-port",
                "0",
            )
        )
        sidecar_metrics = sc.metrics_url.removeprefix("http://").removesuffix("/metrics")

        rules_dir = log_dir / "rules"
        generate.build(SPEC, rules_dir, pager_token_file=None)
        prom_port = free_port()
        config = {
            "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
            "rule_files": [str(p) for p in generate.rule_files(rules_dir)],
            "scrape_configs": [
                {"job_name": JOB_VLLM, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]},
                {"job_name": c.JOB_SIDECAR, "static_configs": [{"targets": [sidecar_metrics]}]},
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
        errors: list[str] = []
        # One stream per served name, through the sidecar: vLLM counts both under its first
        # name, the sidecar as the spec's two versions of the model (served_names); now and then
        # a client leaves mid-stream.
        for name in SERVED_NAMES:
            t = threading.Thread(target=_stream, args=(sc.base_url, name, stop, errors), daemon=True)
            t.start()
            threads.append(t)
        t = threading.Thread(target=_leave, args=(sc.base_url, stop), daemon=True)
        t.start()
        threads.append(t)
        yield Stack(f"http://127.0.0.1:{prom_port}", vllm_url, sc.base_url)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        sidecar.close()
        procs.stop_all()
        if vllm is not None and vllm.poll() is None:
            os.killpg(vllm.pid, signal.SIGTERM)
            try:
                vllm.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(vllm.pid, signal.SIGKILL)
                vllm.wait()


def _instances(prom: live.Prometheus) -> list[live.PanelInstance]:
    end = time.time()
    variables = live.resolve_variables(DASHBOARD, prom, end - 300, end)
    return list(live.panel_instances(DASHBOARD, live.Context(variables, end - 120, end, 2, SCRAPE_S)))


def _results(prom: live.Prometheus) -> dict[tuple[str, str], int]:
    """(panel, query's legend) -> series returned over the last two minutes (parse errors raise)."""
    end = time.time()
    out = {}
    for inst in _instances(prom):
        for q in inst.queries:
            got = prom.query(q.expr, end) if q.instant else prom.query_range(q.expr, end - 120, end, 2)
            out[inst.panel["title"], q.legend] = len(got)
    return out


def test_every_panel_query_returns_data(stack: Stack) -> None:
    with live.Prometheus(stack.prometheus) as prom:
        deadline = time.monotonic() + 180
        while True:
            results = _results(prom)
            raw = {
                (p["title"], t["legendFormat"]): t["expr"]
                for p in live.panels(DASHBOARD)
                for t in p["targets"]
            }
            empty = [key for key, n in results.items() if not n and key[0] not in WITHOUT_DATA]
            if not empty or time.monotonic() > deadline:
                break
            time.sleep(3)
        assert not empty, f"queries without data: {empty}"
        # The model variable lists vLLM's model through the recording rules' model label.
        variables = live.resolve_variables(DASHBOARD, prom, time.time() - 300, time.time())
        assert variables["model"].options == [SERVED_NAMES[0]]
        # Every panel but the sidecar's own shows something from vLLM.
        vllm_panels = {title for (title, _legend), expr in raw.items() if not on_sidecar(expr)}
        assert {p["title"] for p in live.panels(DASHBOARD)} - vllm_panels == SIDECAR_ONLY_PANELS
        # The panels beside vLLM's queries also carry the sidecar's (TTFT, tokens/s).
        assert {title for (title, _l), expr in raw.items() if on_sidecar(expr)} >= SIDECAR_ONLY_PANELS | {
            "Time to first token: sidecar vs vLLM",
            "Prompt and generation tokens/s",
        }


def test_vllm_names_every_series_by_its_first_served_name_and_the_rules_map_it(stack: Stack) -> None:
    with live.Prometheus(stack.prometheus) as prom:
        # Traffic went to both names; vLLM counted all of it under the first.
        served = {r["metric"][c.L_VLLM_MODEL_NAME] for r in prom.query(c.VLLM_GENERATION_TOKENS.name)}
        assert served == {SERVED_NAMES[0]}
        for record in (c.REC_VLLM_KV_CACHE_USAGE, c.REC_VLLM_REQUESTS_RUNNING, c.REC_VLLM_REQUESTS_WAITING):
            got = prom.query(record)
            assert got and {r["metric"][c.L_MODEL] for r in got} == {SERVED_NAMES[0]}, record
            assert all(r["metric"]["job"] == JOB_VLLM and r["metric"][c.L_VLLM_ENGINE] for r in got)
        # A healthy tiny model under light load: the saturation rules see it and stay quiet.
        firing = {a["metric"]["alertname"] for a in prom.query(c.PROM_ALERTS.name)}
        assert not firing & {c.ALERT_LLM_KV_CACHE_SATURATION, c.ALERT_LLM_PREEMPTIONS}


def test_snapshot_renders_every_llm_panel(stack: Stack, tmp_path: Path) -> None:
    result = snapshot.snapshot(
        stack.prometheus,
        tmp_path / "llm",
        SPEC,
        range_s=180,
        scrape_interval_s=SCRAPE_S,
        only=[urls.LLM_SERVING],
    )
    titles = {p["title"] for p in live.panels(DASHBOARD)}
    rendered = {p.title: p for p in result.panels}
    assert len(rendered) >= len(titles)
    for title, panel in rendered.items():
        assert not panel.error, f"{title}: {panel.error}"
        assert (tmp_path / "llm" / panel.file).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", title
        if not any(title.startswith(t.split("$")[0]) for t in WITHOUT_DATA):
            assert panel.series > 0, f"{title}: rendered without data"
