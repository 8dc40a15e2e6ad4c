"""benchmarks/fleet_scale.py at a handful of pods: the real Prometheus scrapes the synthetic
pods and nodes, evaluates every generated rule group without an error, and every Fleet
overview query finds data, so the figures at 1,000 pods measure rules and panels that work.
Timings are not asserted (benchmarks/RESULTS.md has them)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from dashboards import build, live, urls
from inferwatch import contract as c
from inferwatch.spec import load_spec
from tests.fixtures.net import ROOT

pytestmark = pytest.mark.integration

SCRIPT = ROOT / "benchmarks" / "fleet_scale.py"
SPEC = load_spec(ROOT / "fleet.yaml")
MODELS = [m.name for m in SPEC.models]
CANARY = next(m.name for m in SPEC.models if m.slo)  # its second pod runs version 2, failing
PODS = 2 * len(MODELS)  # two pods per model: one node of 8 GPUs while the spec has <= 4 models


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


@pytest.fixture(scope="module")
def report() -> dict:
    proc = _run(
        "--pods", str(PODS), "--json", "--warmup", "15", "--measure", "5",
        "--scrape-interval", "1s", "--eval-interval", "1s",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "targets up" in proc.stderr  # progress goes to stderr, the JSON alone to stdout
    return json.loads(proc.stdout)


def test_every_rule_group_evaluates_without_errors(report: dict) -> None:
    groups = {
        g["name"]: len(g["rules"])
        for path in sorted((ROOT / "alert_rules" / "generated").glob("*.rules.yml"))
        for g in yaml.safe_load(path.read_text())["groups"]
    }
    assert set(report["rule_groups"]) == set(groups)
    for name, g in report["rule_groups"].items():
        assert g["rules"] == groups[name], name
        assert g["evaluations"] >= 2, name
        assert g["failures_total"] == 0 and g["errors"] == [], (name, g["errors"])
        assert 0 < g["median_seconds"] <= g["max_seconds"], name


def test_the_fleet_is_scraped_as_planned(report: dict) -> None:
    nodes = -(-PODS // 8)
    assert report["pods"] == PODS and report["nodes"] == nodes and report["gpus"] == 8 * nodes
    assert report["targets"] == 2 * PODS + nodes == report["targets_up"]
    # Per pod: the sidecar's series (a few hundred) and Triton's; the canary kind is there.
    kinds = report["series_per_pod"]
    assert {f"{m}-v1" for m in MODELS} | {f"{CANARY}-v2"} == set(kinds)
    assert all(50 < n < 2000 for n in kinds.values()), kinds
    assert report["series_per_node"] > 8 * len(c.DCGM_METRICS) // 2
    # Prometheus holds what was exposed plus up/scrape series and the recorded ones.
    assert report["head_series"] >= report["exposed_series"] > 0
    mem = report["memory"]
    assert mem["resident_bytes"] > mem["heap_inuse_bytes"] > 0
    assert mem["heap_bytes_per_series"] > 0 and report["prometheus_cpu_seconds_per_second"] > 0
    assert c.ALERT_SLO_FAST_BURN in report["alerts_firing"]  # the canary burns its model's budget


def test_every_fleet_overview_query_is_timed_and_finds_data(report: dict) -> None:
    dash = build.build(SPEC)[urls.FLEET_OVERVIEW]
    titles = {p["title"] for p in live.panels(dash)}
    rows = report["queries"]
    assert rows[0]["panel"] == "(variables)" and rows[0]["series"] > 0
    # Repeated panels come once per model ("Latency: $model" -> "Latency: ranker", ...).
    seen = {r["panel"] for r in rows[1:]}
    assert {t for t in titles if "$" not in t} <= seen
    assert {f"Latency: {m}" for m in MODELS} <= seen
    empty = [f"{r['panel']} [{r['ref']}]" for r in rows if r["series"] == 0 and not overflow_quantile(r)]
    assert not empty, f"overview queries without data: {empty}"
    assert all(r["seconds"] > 0 for r in rows)


def overflow_quantile(row: dict) -> bool:
    """The overview repeats "Latency: $model" for every model label value, the overflow value
    included; the sidecar keeps no latency histogram for unknown models, so that panel's
    quantile queries have no data (its SLA lines do)."""
    return row["panel"] == f"Latency: {c.MODEL_OVERFLOW}" and "quantile" in row["query"]


def test_bad_input_is_one_line_not_a_traceback() -> None:
    proc = _run("--pods", "0", timeout=60)
    assert proc.returncode == 2
    assert "is not a positive whole number" in proc.stderr and "Traceback" not in proc.stderr
    proc = _run("--pods", "2", "--warmup", "soon", timeout=60)
    assert proc.returncode == 2 and "'soon' is not a duration" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = _run("--pods", "2", "--rules", str(ROOT / "no-such-dir"), timeout=60)
    assert proc.returncode == 2 and "no-such-dir: no *.rules.yml files there" in proc.stderr
    assert "Traceback" not in proc.stderr
