"""The dashboards against live data: the real Triton, the sidecar in front of it and the GPU
exporter under load, scraped every second by a real Prometheus that runs the generated rules.
Every panel's query, with its variables substituted from the live label values, is accepted
by Prometheus and returns data; then ``inferwatch dashboards snapshot`` renders every panel."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tritonclient.http as tritonhttp
import yaml

from alert_rules import generate
from dashboards import build, live, snapshot, urls
from inferwatch import contract as c
from inferwatch.spec import load_spec
from reference_server import catalog, faults
from tests.fixtures.net import ROOT, Processes, free_port, inferwatch_cmd, wait_http

pytestmark = pytest.mark.integration

# The demo spec's windows are seconds, not minutes, so the panels fill within a minute.
SPEC = load_spec(ROOT / "fleet.demo.yaml")
# LLM serving needs the real vLLM: tests/test_dashboards_llm_live.py runs it.
DASHBOARDS = {name: dash for name, dash in build.build(SPEC).items() if name != urls.LLM_SERVING}
SCRAPE_S = 1
# (model, version sent in the URL, client threads): ranker v1 and v2 run side by side like a
# canary; two clients on dense_batched let Triton form batches.
TRAFFIC = [("dense_batched", "", 2), ("dense_unbatched", "", 1), ("ranker", "1", 1), ("ranker", "2", 1)]
# The canary hangs: ranker v2 takes 3 s, past the sidecar's 2 s request timeout, so each of
# its requests is answered 504 (a server error and a timeout), while v1 stays healthy. The
# timeout leaves the healthy models (under 0.5 s here even on a busy machine) a wide margin.
CANARY_EXTRA_LATENCY_MS = 3000
SIDECAR_REQUEST_TIMEOUT_S = 2
# Panels that cannot have data on this machine, and why. Their queries must still be accepted.
NO_DATA_HERE = {
    "GPU memory by pod": "the simulated GPU backend runs no processes; per-pod memory needs a real GPU",
}


@dataclass
class Stack:
    prometheus: str
    sidecar_http: str
    gpu_exporter: str
    log_dir: Path


def _sidecar_cmd(*args: str) -> list[str]:
    return inferwatch_cmd("sidecar", *args)


def _send(url: str, model: str, version: str, stop: threading.Event, errors: list[str]) -> None:
    client = tritonhttp.InferenceServerClient(url, network_timeout=30)
    datatypes = {t.name: t.datatype for t in catalog.model_info(model).inputs}
    inputs = []
    for name, array in catalog.example_input(model, batch=1, seed=1).items():
        tensor = tritonhttp.InferInput(name, list(array.shape), datatypes[name])
        tensor.set_data_from_numpy(array, binary_data=True)
        inputs.append(tensor)
    while not stop.is_set():
        try:
            client.infer(model, inputs, model_version=version)
        except Exception as exc:  # a 5xx the sidecar answers is data too; keep count for the log
            errors.append(str(exc)[:200])
            time.sleep(0.05)
    client.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, triton, _gpu_exporter_session) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("dashboards-live")
    procs = Processes(log_dir)
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
        # The demo's spec with a concurrency limit far above this traffic, so the limit's line
        # (Model detail) has data and nothing is shed.
        sidecar_spec = yaml.safe_load((ROOT / "fleet.demo.yaml").read_text())
        sidecar_spec["defaults"]["limits"] = {"concurrency": 256, "queue": 256}
        (log_dir / "sidecar-fleet.yaml").write_text(yaml.safe_dump(sidecar_spec))
        sidecar = procs.start(
            "sidecar",
            _sidecar_cmd(
                "--upstream-http", triton.http_url, "--upstream-grpc", triton.grpc_url,
                "--host", "127.0.0.1", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
                "--metrics-port", str(metrics_port), "--spec", str(log_dir / "sidecar-fleet.yaml"),
                "--request-timeout", str(SIDECAR_REQUEST_TIMEOUT_S),
            ),
        )  # fmt: skip
        wait_http(f"http://127.0.0.1:{metrics_port}/readyz", timeout=60, proc=sidecar)

        rules_dir = log_dir / "rules"
        generate.build(SPEC, rules_dir, pager_token_file=None)
        prom_port = free_port()
        config = {
            "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
            "rule_files": [str(p) for p in generate.rule_files(rules_dir)],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [target]}]}
                for job, target in (
                    (c.JOB_SIDECAR, f"127.0.0.1:{metrics_port}"),
                    (c.JOB_TRITON, triton.metrics_url.removeprefix("http://").removesuffix("/metrics")),
                    (c.JOB_GPU_EXPORTER, _gpu_exporter_session.target),
                )
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
                "--enable-feature=exemplar-storage",
            ],
        )
        wait_http(f"http://127.0.0.1:{prom_port}/-/ready", timeout=60, proc=prom)

        faults.set_fault("ranker", "2", extra_latency_ms=CANARY_EXTRA_LATENCY_MS, state_dir=triton.state_dir)
        # GPU 0 under memory pressure: GPUMemoryPressure fires, so "Alerts firing now" has a row.
        assert _gpu_exporter_session.simulate(fb_used_ratio=0.95, gpus=[0]).status_code == 200
        errors: list[str] = []
        for model, version, clients in TRAFFIC:
            for _ in range(clients):
                t = threading.Thread(
                    target=_send,
                    args=(f"127.0.0.1:{http_port}", model, version, stop, errors),
                    daemon=True,
                )
                t.start()
                threads.append(t)
        yield Stack(
            f"http://127.0.0.1:{prom_port}", f"127.0.0.1:{http_port}", _gpu_exporter_session.url, log_dir
        )
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        _gpu_exporter_session.reset()
        faults.clear("ranker", state_dir=triton.state_dir)
        procs.stop_all()


def _instances(
    prom: live.Prometheus, name: str, pins: dict[str, str] | None = None
) -> list[live.PanelInstance]:
    dash = DASHBOARDS[name]
    end = time.time()
    variables = live.resolve_variables(dash, prom, end - 300, end, pins)
    ctx = live.Context(variables, end - 120, end, 2, SCRAPE_S)
    return list(live.panel_instances(dash, ctx))


def _empty_queries(prom: live.Prometheus, instances: list[live.PanelInstance]) -> list[str]:
    """Queries that returned no series over the last two minutes (parse errors raise)."""
    end = time.time()
    empty = []
    for inst in instances:
        for q in inst.queries:
            if q.instant:
                result = prom.query(q.expr, end)
            else:
                result = prom.query_range(q.expr, end - 120, end, 2)
            if not result and inst.panel["title"] not in NO_DATA_HERE:
                empty.append(f"{inst.dashboard_title} / {inst.title} [{q.ref}]: {q.expr}")
    return empty


def _all_instances(prom: live.Prometheus) -> list[live.PanelInstance]:
    out = []
    for name in DASHBOARDS:
        if name == urls.MODEL_DETAIL:
            # Model detail shows one model at a time: check it for every model served.
            for model in sorted({m for m, _v, _n in TRAFFIC}):
                out += _instances(prom, name, {"model": model})
        else:
            out += _instances(prom, name)
    return out


def test_every_panel_query_returns_data(stack: Stack) -> None:
    with live.Prometheus(stack.prometheus) as prom:
        deadline = time.monotonic() + 150
        while True:
            instances = _all_instances(prom)
            empty = _empty_queries(prom, instances)
            firing = {
                a["metric"]["alertname"] for a in prom.query(f'{c.PROM_ALERTS.name}{{alertstate="firing"}}')
            }
            if (not empty and c.ALERT_GPU_MEMORY_PRESSURE in firing) or time.monotonic() > deadline:
                break
            time.sleep(3)
        assert not empty, "queries without data:\n" + "\n".join(empty)
        titles = {i.title for i in instances}
        # Repeated per-model latency panels: one per model with traffic.
        assert {f"Latency: {m}" for m, _v, _n in TRAFFIC} <= titles
        # The versions variable sees the canary: ranker v1 and v2 side by side.
        variables = live.resolve_variables(
            DASHBOARDS[urls.MODEL_DETAIL], prom, time.time() - 300, time.time(), {"model": "ranker"}
        )
        assert {"1", "2"} <= set(variables["version"].options)
        # The alert table shows what is firing: the GPU under memory pressure.
        assert c.ALERT_GPU_MEMORY_PRESSURE in firing
        # The panels show what happened: only the canary's errors, in the overview and by version.
        overview = {i.title: i for i in _instances(prom, urls.FLEET_OVERVIEW)}
        # Per model and version, as the paging alert judges: the canary alone, not diluted by v1.
        ratios = _last_values(prom, overview["Server-error ratio by model and version"], "model", "version")
        assert ratios["ranker", "2"] > 0.5 and ratios["ranker", "1"] == 0
        assert ratios["dense_batched", "default"] == ratios["dense_unbatched", "default"] == 0
        detail = {i.title: i for i in _instances(prom, urls.MODEL_DETAIL, {"model": "ranker"})}
        by_version = _last_values(prom, detail["Server-error ratio by version"], "version")
        assert by_version["2"] > 0.5 and by_version["1"] == 0
        timeouts = _last_values(prom, overview["Timeout ratio by model"], "model")
        assert timeouts["ranker"] > 0 and timeouts["dense_batched"] == timeouts["dense_unbatched"] == 0
        # ranker's SLA is 100 ms; the canary's 2 s timeouts put its P99 above twice the SLA (by
        # version: the canary's few requests barely move the P99 of the whole model).
        p99 = _last_values(prom, detail["P50 and P99 latency by version"], "version", query=1)
        sla = SPEC.latency_sla_seconds("ranker")
        assert p99["2"] > SPEC.alerts.latency.sla_factor * sla and p99["2"] > p99["1"]
        # The documented exceptions are still valid queries (Prometheus accepted them above).
        assert {i.panel["title"] for i in instances} >= set(NO_DATA_HERE)


def _last_values(
    prom: live.Prometheus, inst: live.PanelInstance, *labels: str, query: int = 0
) -> dict[Any, float]:
    """The panel's query ``query`` now, by the value of ``labels`` (a tuple when several)."""
    out = {}
    for r in prom.query(inst.queries[query].expr):
        key = tuple(r["metric"].get(label, "") for label in labels)
        out[key if len(key) > 1 else key[0]] = float(r["value"][1])
    return out


def test_snapshot_renders_every_panel(stack: Stack, tmp_path: Path) -> None:
    out = tmp_path / "snapshot"
    cmd = inferwatch_cmd(
        "dashboards", "snapshot", "--prometheus", stack.prometheus, "--out", str(out),
        "--spec", str(ROOT / "fleet.demo.yaml"), "--range", "3m", "--scrape-interval", f"{SCRAPE_S}s",
        *(arg for name in DASHBOARDS for arg in ("--dashboard", name)),
    )  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    expected = sum(len(list(live.panels(d))) for d in DASHBOARDS.values())
    # Repeated panels add one image per model beyond the first.
    assert len(manifest) >= expected
    index = (out / "index.html").read_text()
    for entry in manifest:
        png = out / entry["file"]
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size > 10_000, entry["file"]
        assert entry["file"] in index
        assert not entry["error"], f"{entry['title']}: {entry['error']}"
        if entry["title"] not in NO_DATA_HERE:
            assert entry["series"] > 0, f"{entry['title']}: rendered without data"
    assert {e["dashboard"] for e in manifest} == set(DASHBOARDS)
    keep = os.environ.get("INFERWATCH_KEEP_SNAPSHOT")
    if keep:  # for a person to look at (and for docs/img)
        shutil.copytree(out, keep, dirs_exist_ok=True)


def test_snapshot_of_one_model_shows_the_canary_beside_the_stable_version(
    stack: Stack, tmp_path: Path
) -> None:
    out = tmp_path / "ranker"
    result = snapshot.snapshot(
        stack.prometheus,
        out,
        SPEC,
        range_s=180,
        scrape_interval_s=SCRAPE_S,
        pins={"model": "ranker"},
        only=[urls.MODEL_DETAIL],
    )
    panels = {p.title: p for p in result.panels}
    assert set(panels) == {p["title"] for p in live.panels(DASHBOARDS[urls.MODEL_DETAIL])}
    assert panels["Request rate by version"].series == 2  # v1 and v2
    assert panels["Achieved batch size by version"].series == 2
    assert all('model=~"ranker"' in q.expr for q in panels["Request rate by version"].queries)
    assert not [p.title for p in result.panels if p.error or not p.series]
    with pytest.raises(live.LiveError, match="no dashboard has that variable"):
        snapshot.snapshot(stack.prometheus, out, SPEC, pins={"modle": "ranker"})
    keep = os.environ.get("INFERWATCH_KEEP_SNAPSHOT")
    if keep:
        shutil.copytree(out, Path(keep) / "ranker", dirs_exist_ok=True)
