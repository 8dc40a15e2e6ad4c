"""The fleet spec's LLM settings: per-model ttft_sla_ms, tpot_sla_ms and ttft_slo with their
defaults, each bad value refused in one line, the sidecar's TTFT/TPOT buckets at every SLA and
2x it, and the demo spec's TTFT SLO windows scaled like its error windows."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, Histogram

from alert_rules.config import RulesConfig
from alert_rules.groups import llm_slo
from inferwatch import contract as c
from inferwatch.spec import load_spec, parse_spec, token_latency_buckets

ROOT = Path(__file__).resolve().parents[1]
SPEC = load_spec(ROOT / "fleet.yaml")
LLM = 3  # tiny-llm's index in fleet.yaml's models


def _with(path: list, value) -> dict:
    data = yaml.safe_load((ROOT / "fleet.yaml").read_text())
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return data


BAD = {
    "default ttft of 0": (
        _with(["defaults", "ttft_sla_ms"], 0),
        "defaults.ttft_sla_ms: must be greater than 0",
    ),
    "negative default tpot": (
        _with(["defaults", "tpot_sla_ms"], -5),
        "defaults.tpot_sla_ms: must be greater than 0",
    ),
    "ttft not a number": (
        _with(["models", LLM, "ttft_sla_ms"], "fast"),
        f"models[{LLM}].ttft_sla_ms: must be a valid number",
    ),
    "infinite tpot": (
        _with(["models", LLM, "tpot_sla_ms"], math.inf),
        f"models[{LLM}].tpot_sla_ms: must be a finite number",
    ),
    "nan ttft": (
        _with(["models", LLM, "ttft_sla_ms"], math.nan),
        f"models[{LLM}].ttft_sla_ms: must be a finite number",
    ),
    "ttft of 0": (
        _with(["models", LLM, "ttft_sla_ms"], 0),
        f"models[{LLM}].ttft_sla_ms: must be greater than 0",
    ),
    "objective of 1": (
        _with(["models", LLM, "ttft_slo"], {"objective": 1, "period": "30d"}),
        f"models[{LLM}].ttft_slo.objective: must be less than 1",
    ),
    "bad period": (
        _with(["models", LLM, "ttft_slo"], {"objective": 0.99, "period": "soon"}),
        f"models[{LLM}].ttft_slo.period: 'soon' is not a duration",
    ),
    "slo without objective": (
        _with(["models", LLM, "ttft_slo"], {"period": "30d"}),
        f"models[{LLM}].ttft_slo.objective: required field is missing",
    ),
    "misspelt key": (_with(["models", LLM, "ttft_sla"], 200), f"models[{LLM}].ttft_sla: unknown key"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_each_bad_llm_value_gets_one_line(case: str, tmp_path: Path) -> None:
    data, expected = BAD[case]
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = subprocess.run(
        [sys.executable, "-m", "inferwatch.cli", "spec", "check", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{path}: {expected}"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_defaults_and_per_model_slas() -> None:
    assert SPEC.ttft_sla_seconds("tiny-llm") == 0.2 and SPEC.tpot_sla_seconds("tiny-llm") == 0.05
    # A listed model without LLM SLAs, and a model the spec does not list, get the defaults.
    assert SPEC.ttft_sla_seconds("ranker") == SPEC.ttft_sla_seconds("unlisted") == 1.0
    assert SPEC.tpot_sla_seconds("ranker") == SPEC.tpot_sla_seconds("unlisted") == 0.1
    bare = parse_spec({"models": [{"name": "m", "latency_sla_ms": 100}]})
    assert (bare.defaults.ttft_sla_ms, bare.defaults.tpot_sla_ms) == (1000.0, 100.0)
    assert bare.model("m").ttft_slo is None


def test_the_sidecars_token_buckets_sit_at_each_sla_and_twice_it() -> None:
    ttft = token_latency_buckets(SPEC, "ttft")
    tpot = token_latency_buckets(SPEC, "tpot")
    for sla in (0.2, 1.0):  # tiny-llm's and the default
        assert sla in ttft and 2 * sla in ttft
    for sla in (0.05, 0.1):
        assert sla in tpot and 2 * sla in tpot
    assert list(ttft) == sorted(set(ttft)) and list(tpot) == sorted(set(tpot))
    # The sidecar's own per-model overrides (its --sla style flags) add theirs.
    assert {0.3, 0.6} <= set(token_latency_buckets(SPEC, "ttft", {"other": 0.3}))
    with pytest.raises(ValueError, match="kind must be"):
        token_latency_buckets(SPEC, "e2e")  # type: ignore[arg-type]


def test_the_ttft_slo_bucket_is_the_one_the_rules_read() -> None:
    """The SLO's good-request bucket is spelt as prometheus_client spells the bound."""
    registry = CollectorRegistry()
    hist = Histogram(
        c.TIME_TO_FIRST_TOKEN.name.removesuffix("_seconds"),
        "h",
        unit="seconds",
        buckets=token_latency_buckets(SPEC, "ttft"),
        registry=registry,
    )
    hist.observe(0.1)
    les = {s.labels["le"] for m in registry.collect() for s in m.samples if "le" in s.labels}
    assert llm_slo.le(SPEC.ttft_sla_seconds("tiny-llm")) in les
    assert f'le="{llm_slo.le(0.2)}"' in "".join(
        r["expr"] for r in llm_slo.group(RulesConfig.from_spec(SPEC))["rules"]
    )


def test_the_demo_scales_the_ttft_slo_windows_like_its_error_windows() -> None:
    demo = load_spec(ROOT / "fleet.demo.yaml")
    rules = llm_slo.group(RulesConfig.from_spec(demo))["rules"]
    alerts = {r["alert"]: r for r in rules if "alert" in r}
    fast = alerts[c.ALERT_TTFT_SLO_FAST_BURN]["annotations"]["description"]
    slow = alerts[c.ALERT_TTFT_SLO_SLOW_BURN]["annotations"]["description"]
    # Minutes become seconds: 1h/5m -> 1m/5s, 6h/30m -> 6m/30s, 3d/6h -> 1h12m/6m.
    assert "14.4x over 1m and 5s or 6x over 6m and 30s" in fast
    assert "1x over 1h12m and 6m" in slow
    windows = {r["labels"]["window"] for r in rules if r.get("record") == c.REC_TTFT_SLO_SLOW_RATIO}
    assert windows == {"5s", "30s", "1m", "6m", "1h12m", "12h"}
