"""A global view across clusters: a second Prometheus that accepts remote write
(``--web.enable-remote-write-receiver``, standing for Thanos Receive or Mimir) receives what
a cluster's Prometheus sends through the filter deploy/SCALING.md recommends, and every
Fleet overview query answers the same on both.

The cluster's Prometheus scrapes synthetic pods and GPU nodes (benchmarks/fleet_scale.py:
the sidecar's own telemetry, the real GPU exporter's exposition) every second and evaluates
the rules generated from the demo spec, whose windows are seconds. The filter and the
external labels are read from SCALING.md itself, so the page and this test cannot drift."""

from __future__ import annotations

import re
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import yaml

from alert_rules import generate
from benchmarks.fleet_scale import Fleet, prometheus_cmd, wait_ready
from dashboards import build, live, urls
from inferwatch import contract as c
from inferwatch.spec import load_spec
from tests.fixtures.net import ROOT, Processes, free_port

SPEC = load_spec(ROOT / "fleet.demo.yaml")
OVERVIEW = build.build(SPEC)[urls.FLEET_OVERVIEW]
SCALING = ROOT / "deploy" / "SCALING.md"
INTERVAL_S = 1
# The queue sends a batch at least this often; answers older than a few of these have arrived.
SEND_DEADLINE_S = 1
LAG_S = 4


def recommended_remote_write() -> dict:
    """The kube-prometheus-stack ``prometheusSpec`` of SCALING.md's remote-write example."""
    blocks = re.findall(r"```yaml\n(.*?)```", SCALING.read_text(), re.S)
    for block in blocks:
        doc = yaml.safe_load(textwrap.dedent(block))
        spec = (doc or {}).get("prometheus", {}).get("prometheusSpec", {})
        if spec.get("remoteWrite"):
            return spec
    raise AssertionError(f"{SCALING} has no prometheusSpec with remoteWrite")


def relabel_configs(spec: dict) -> list[dict]:
    """The example's writeRelabelConfigs in Prometheus' own configuration names."""
    names = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    [rw] = spec["remoteWrite"]
    return [{names.get(k, k): v for k, v in rc.items()} for rc in rw["writeRelabelConfigs"]]


def overview_series_names() -> set[str]:
    """Every series name the Fleet overview reads, in its queries and its variables."""
    known = {*c.ALL_METRICS, *c.RECORDING_RULES}
    texts = [t["expr"] for p in live.panels(OVERVIEW) for t in p.get("targets", [])]
    for var in OVERVIEW["templating"]["list"]:
        q = var.get("query")
        texts.append(q.get("query", "") if isinstance(q, dict) else str(q or ""))
    tokens = {t for text in texts for t in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text)}
    return tokens & known


def test_the_recommended_filter_keeps_what_the_overview_reads() -> None:
    [keep] = relabel_configs(recommended_remote_write())
    assert keep["action"] == "keep" and keep["source_labels"] == ["__name__"]
    names = overview_series_names()
    assert {c.REC_REQUEST_RATE, c.REQUESTS_TOTAL.name, c.PROM_UP.name, c.PROM_ALERTS.name} <= names
    missing = sorted(n for n in names if not re.fullmatch(keep["regex"], n))
    assert not missing, f"SCALING.md's remote-write filter drops series the Fleet overview reads: {missing}"
    # ... and it is a filter: the raw latency histogram (most of a pod's series) stays local.
    assert not re.fullmatch(keep["regex"], c.REQUEST_DURATION.name + "_bucket")


@dataclass
class Pair:
    local: str
    global_: str
    external: dict[str, str]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    workdir = tmp_path_factory.mktemp("global-view")
    procs = Processes(workdir)
    example = recommended_remote_write()
    external = {k: str(v) for k, v in example.get("externalLabels", {}).items()}
    try:
        with Fleet(SPEC, 6, workdir) as fleet:
            g_port, l_port = free_port(), free_port()
            g_url, l_url = f"http://127.0.0.1:{g_port}", f"http://127.0.0.1:{l_port}"
            global_cmd = prometheus_cmd(
                {"global": {}}, workdir, "global", g_port, "--web.enable-remote-write-receiver"
            )
            g_proc = procs.start("global", global_cmd)
            rules = workdir / "rules"
            generate.build(SPEC, rules, pager_token_file=None)
            config = {
                "global": {
                    "scrape_interval": f"{INTERVAL_S}s",
                    "evaluation_interval": f"{INTERVAL_S}s",
                    "external_labels": external,
                },
                "rule_files": [str(p) for p in generate.rule_files(rules)],
                "scrape_configs": fleet.scrape_configs(),
                "remote_write": [
                    {
                        "url": f"{g_url}/api/v1/write",
                        "write_relabel_configs": relabel_configs(example),
                        "queue_config": {"batch_send_deadline": f"{SEND_DEADLINE_S}s"},
                    }
                ],
            }
            l_proc = procs.start("local", prometheus_cmd(config, workdir, "local", l_port))
            wait_ready(g_url, g_proc)
            wait_ready(l_url, l_proc)
            yield Pair(l_url, g_url, external)
    finally:
        procs.stop_all()


def _queries(prom: live.Prometheus, end: float) -> tuple[dict[str, list[str]], list[tuple[str, live.Query]]]:
    variables = live.resolve_variables(OVERVIEW, prom, end - 300, end)
    ctx = live.Context(variables, end - 30, end, INTERVAL_S, INTERVAL_S)
    out = [(f"{i.title} [{q.ref}]", q) for i in live.panel_instances(OVERVIEW, ctx) for q in i.queries]
    return {n: v.options for n, v in variables.items()}, out


def _answers(url: str, end: float, drop: set[str]) -> tuple[dict, dict]:
    """Each overview query's answer at ``end`` (instant) or over the 30 s before it (range):
    {label set without ``drop``: [(t, value), ...]}."""
    with live.Prometheus(url) as prom:
        options, queries = _queries(prom, end)
        out = {}
        for name, q in queries:
            result = prom.query(q.expr, end) if q.instant else prom.query_range(q.expr, end - 30, end, 1)
            series = {}
            for r in result:
                key = tuple(sorted((k, v) for k, v in r["metric"].items() if k not in drop))
                points = [r["value"]] if q.instant else r["values"]
                series[key] = [(float(t), float(v)) for t, v in points]
            out[name] = series
    return options, out


def _differences(local: dict, global_: dict, rel: float = 1e-9) -> list[str]:
    diffs = []
    for name, series in local.items():
        other = global_.get(name, {})
        if set(series) != set(other):
            diffs.append(f"{name}: series {sorted(series)} locally, {sorted(other)} globally")
            continue
        for key, points in series.items():
            if len(points) != len(other[key]):
                diffs.append(f"{name} {key}: {len(points)} points locally, {len(other[key])} globally")
                continue
            for (t1, v1), (t2, v2) in zip(points, other[key], strict=True):
                if t1 != t2 or abs(v1 - v2) > rel * max(abs(v1), abs(v2), 1e-12):
                    diffs.append(f"{name} {key} at {t1}: {v1} locally, {v2} globally")
                    break
    return diffs


def _paged(answers: dict) -> bool:
    """Whether the "Alerts firing now" table lists the canary's error-rate page."""
    alerts = next(series for name, series in answers.items() if name.startswith("Alerts firing now"))
    return any(("alertname", c.ALERT_HIGH_ERROR_RATE) in key for key in alerts)


def _empty(answers: dict) -> list[str]:
    return [name for name, series in answers.items() if not series]


def test_fleet_overview_answers_the_same_on_the_global_store(pair: Pair) -> None:
    # Wait until every overview query has data locally (the error-rate page needs three
    # 10 s windows of the canary's errors), then compare answers that the remote-write
    # delay has had time to deliver.
    deadline = time.monotonic() + 180
    while True:
        _, local = _answers(pair.local, time.time() - LAG_S, set())
        empty = _empty(local)
        if not _paged(local) and not empty:
            empty = [f"{c.ALERT_HIGH_ERROR_RATE} not firing yet"]
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert not empty, f"overview queries without data on the cluster's Prometheus: {empty}"

    deadline = time.monotonic() + 60
    while True:
        end = time.time() - LAG_S
        l_options, local = _answers(pair.local, end, set())
        g_options, global_ = _answers(pair.global_, end, set(pair.external))
        diffs = _differences(local, global_)
        if l_options != g_options:
            diffs.append(f"variables: {l_options} locally, {g_options} globally")
        if not diffs or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not diffs, "the global store answers differently:\n" + "\n".join(diffs[:20])
    assert not _empty(global_)
    assert _paged(global_)  # the canary's page is among the alerts both show

    # What arrived carries the cluster's external label, and the filter held back the raw
    # latency histogram, which stays local for drill-down.
    def count(url: str, selector: str) -> int:
        resp = httpx.get(f"{url}/api/v1/query", params={"query": f"count({selector})"}, timeout=30)
        result = resp.json()["data"]["result"]
        return int(float(result[0]["value"][1])) if result else 0

    label, value = next(iter(pair.external.items()))
    assert count(pair.global_, f'{c.REC_REQUEST_RATE}{{{label}="{value}"}}') > 0
    assert count(pair.local, f'{{__name__="{c.REQUEST_DURATION.name}_bucket"}}') > 300  # 6 pods x 54
    assert count(pair.global_, f'{{__name__="{c.REQUEST_DURATION.name}_bucket"}}') == 0
    assert count(pair.global_, '{__name__=~".+"}') < count(pair.local, '{__name__=~".+"}') / 4
