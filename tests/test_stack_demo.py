"""The demo's arithmetic and bookkeeping, without a stack: timings derived from the spec,
and pages read from what the real pager stores."""

from __future__ import annotations

import json
from pathlib import Path

from alert_rules.pager import PageStore, WebhookPayload
from inferwatch import contract
from inferwatch.spec import load_spec, parse_spec
from inferwatch.stack.demo import Scenario, plan_faults
from inferwatch.stack.observe import Page, parse_pages
from inferwatch.stack.timing import (
    condition_seconds,
    default_steady,
    error_burst_lead,
    first_window_lead,
    next_error_window_start,
    theoretical_minimum,
)
from tests.fixtures.net import ROOT

DEMO = load_spec(ROOT / "fleet.demo.yaml")
FLEET = load_spec(ROOT / "fleet.yaml")


def test_theoretical_minimum_is_condition_plus_evaluation_plus_group_wait() -> None:
    # fleet.demo.yaml: scrape and evaluation 2s; group waits critical 2s, warning 3s, info 5s.
    # Errors: (3 - 1) x 10s windows, and two scrapes of the first (a new series' first
    # sample is invisible to rate()).
    assert condition_seconds(DEMO, contract.ALERT_HIGH_ERROR_RATE) == 20 + 4
    assert theoretical_minimum(DEMO, contract.ALERT_HIGH_ERROR_RATE) == 24 + 2 + 2
    assert theoretical_minimum(DEMO, contract.ALERT_HIGH_P99_LATENCY) == 30 + 2 + 3
    assert theoretical_minimum(DEMO, contract.ALERT_GPU_MEMORY_PRESSURE) == 15 + 2 + 5
    # The production spec, same formula: minutes instead of seconds.
    assert theoretical_minimum(FLEET, contract.ALERT_HIGH_ERROR_RATE) == 120 + 30 + 15 + 10
    assert theoretical_minimum(FLEET, contract.ALERT_GPU_MEMORY_PRESSURE) == 300 + 15 + 60


def test_timings_follow_the_spec_not_code() -> None:
    faster = parse_spec(
        {
            "alerts": {"error_rate": {"window": "5s", "consecutive_windows": 2}, "gpu_memory": {"for": "4s"}},
            "prometheus": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "routing": {"critical": {"receiver": "pager", "group_wait": "1s", "repeat_interval": "1h"}},
        }
    )
    assert theoretical_minimum(faster, contract.ALERT_HIGH_ERROR_RATE) == 5 + 2 + 1 + 1
    # Steady: long enough for the slowest rule from a cold start (latency for 5m here).
    assert default_steady(faster) == 300 + 1 + 60
    assert default_steady(DEMO) == max(30, 30, 15) + 2 + 5


def test_each_fault_expects_its_tier_and_labels() -> None:
    faults = {f.alertname: f for f in plan_faults(DEMO, Scenario())}
    assert {a: f.severity for a, f in faults.items()} == contract.TIERED_ALERTS
    assert faults[contract.ALERT_HIGH_P99_LATENCY].match == {
        contract.L_MODEL: "ranker",
        contract.L_VERSION: "2",
    }
    assert faults[contract.ALERT_GPU_MEMORY_PRESSURE].match == {contract.L_GPU: "0"}
    error = faults[contract.ALERT_HIGH_ERROR_RATE]
    page = Page("k", error.alertname, "critical", dict(error.match), {}, "firing", 0.0, 0.0)
    assert error.matches(page)
    other = Page(
        "k", error.alertname, "critical", {**error.match, contract.L_VERSION: "2"}, {}, "firing", 0, 0
    )
    assert not error.matches(other)


def _payload(status: str, ends_at: str) -> WebhookPayload:
    return WebhookPayload.model_validate(
        {
            "version": "4",
            "groupKey": '{}:{alertname="GPUMemoryPressure"}',
            "status": status,
            "receiver": "low-urgency",
            "alerts": [
                {
                    "status": status,
                    "labels": {"alertname": "GPUMemoryPressure", "severity": "info", "gpu": "0"},
                    "annotations": {"runbook_url": "https://example.invalid/GPUMemoryPressure.md"},
                    "startsAt": "2026-01-01T00:00:00Z",
                    "endsAt": ends_at,
                    "fingerprint": "abc",
                }
            ],
        }
    )


def test_pages_are_read_as_the_pager_stores_them(tmp_path: Path) -> None:
    store = PageStore(tmp_path / "pager.sqlite")
    firing = _payload("firing", "0001-01-01T00:00:00Z")
    store.add(firing, json.dumps(firing.model_dump()))
    [page] = parse_pages({"pages": store.pages({})}, now=0.0)
    assert (page.alertname, page.severity, page.status) == ("GPUMemoryPressure", "info", "firing")
    assert page.labels[contract.L_GPU] == "0"
    assert page.annotations["runbook_url"].endswith("GPUMemoryPressure.md")
    assert page.received_at > 1.7e9 and page.resolved_at is None

    resolved = _payload("resolved", "2026-01-01T00:01:00Z")
    store.add(resolved, json.dumps(resolved.model_dump()))
    [again] = parse_pages({"pages": store.pages({})}, now=0.0)
    assert again.key == page.key  # the same occurrence, now resolved
    assert again.status == "resolved" and again.notifications == 2
    assert again.resolved_at is not None and again.resolved_at >= again.received_at
    store.close()


def test_the_error_burst_starts_at_a_fixed_place_in_its_window() -> None:
    """Where a burst begins in the rule's tumbling window would add 0 to 10 s to its delay:
    the demo starts it one scrape short of a whole window before a window ends."""
    assert first_window_lead(DEMO) == 4  # two 2s scrapes
    assert error_burst_lead(DEMO) == 8  # the 10s window less one scrape
    for now in (1000.0, 1001.5, 1002.0, 1002.01, 1009.99):
        start = next_error_window_start(DEMO, now)
        assert now <= start < now + 10
        assert (start + 8) % 10 == 0
    assert next_error_window_start(DEMO, 1002.0) == 1002.0  # already on the mark
    # The lead never exceeds the window, and never undercuts what the rate needs.
    tiny = parse_spec({"alerts": {"error_rate": {"window": "3s"}}, "prometheus": {"scrape_interval": "2s"}})
    assert error_burst_lead(tiny) == 3


def test_the_rule_timings_are_the_ones_the_alert_groups_export(monkeypatch) -> None:
    """One source: the demo's minimums move with the timing a group exports, and the demo
    reads no alert setting of the spec itself."""
    from alert_rules.config import AlertTiming
    from inferwatch.stack import timing

    exported = timing.timings(timing.RulesConfig.from_spec(DEMO))
    lat = exported[contract.ALERT_HIGH_P99_LATENCY]
    assert theoretical_minimum(DEMO, lat.alertname) == lat.condition_s + 2 + 3
    changed = {**exported, lat.alertname: AlertTiming(lat.alertname, 41.0, 7.0)}
    monkeypatch.setattr(timing, "timings", lambda cfg: changed)
    assert theoretical_minimum(DEMO, lat.alertname) == 41 + 2 + 3
    assert timing.resolve_bound(DEMO, lat.alertname) == 7 + 2 + 5
    source = (ROOT / "inferwatch" / "stack" / "timing.py").read_text()
    assert "spec.alerts" not in source


def test_the_llm_incident_plans_one_page_per_fault_with_its_minimum() -> None:
    from inferwatch.stack.demo_llm import KV_MODEL, LlmDemo, LlmScenario

    demo = LlmDemo.__new__(LlmDemo)  # the plan needs only the spec and the scenario
    demo.spec, demo.sc = DEMO, LlmScenario()
    faults = {f.alertname: f for f in demo._plan()}
    errors = faults[contract.ALERT_HIGH_ERROR_RATE]
    assert (errors.severity, errors.minimum_s) == ("critical", 28)  # as the main demo's burst
    assert errors.match == {contract.L_MODEL: "tiny_stream", contract.L_VERSION: "1"}
    ttft = faults[contract.ALERT_HIGH_TTFT]
    # The TTFT rule holds the latency tier's for (30s) over its window: + evaluation + warning wait.
    assert (ttft.severity, ttft.minimum_s, ttft.resolve_bound_s) == ("warning", 30 + 2 + 3, 20 + 2 + 5)
    assert ttft.match == {contract.L_MODEL: "tiny_stream", contract.L_VERSION: "2"}
    kv = faults[contract.ALERT_LLM_KV_CACHE_SATURATION]
    assert (kv.severity, kv.minimum_s, kv.skipped) == ("info", 15 + 2 + 5, "")
    assert kv.match == {contract.L_MODEL: KV_MODEL} and KV_MODEL == "tiny-llm"  # vLLM's first served name
    assert LlmScenario().ttft_ms > 2 * DEMO.defaults.ttft_sla_ms  # the regression crosses 2x the SLA
    # One round per fault, the KV round first: no other fault shares the CPU with its load.
    demo.faults = demo._plan()
    assert [[f.key for f in r] for r in demo._rounds()] == [
        ["kv-saturation"],
        ["ttft-regression"],
        ["stream-errors"],
    ]


def test_the_kv_round_fills_the_stacks_cache_past_the_alert_and_refuses_one_it_cannot() -> None:
    """The batch load for the cache ``up --llm`` gives vLLM: whole 4-block requests that never
    grow past their blocks, enough of them to stay above the alert's 90% while one is being
    replaced, 3 blocks left for the 1-block interactive streams; a cache sized in GiB is too
    big for this machine and a tiny one cannot stay above 90%: both are refused with a reason."""
    from alert_rules.config import KV_CACHE_THRESHOLD
    from inferwatch.stack.config import LLM_KV_CACHE_BLOCKS
    from inferwatch.stack.demo_llm import BATCH_BLOCKS, BATCH_QUEUE, KvPlan

    plan = KvPlan(block_size=128, blocks=LLM_KV_CACHE_BLOCKS)
    assert plan.why_not() == ""
    assert (plan.usable, plan.running, plan.clients) == (75, 18, 18 + BATCH_QUEUE)
    assert plan.usage(plan.running) > plan.usage(plan.running - 1) > KV_CACHE_THRESHOLD
    assert plan.usable - plan.running * BATCH_BLOCKS == 3  # free for interactive streams
    lo, hi = plan.output_tokens
    assert plan.prompt_tokens == 385 and (plan.prompt_tokens - 1) // 128 + 1 == BATCH_BLOCKS
    assert 0 < lo < hi and plan.prompt_tokens + hi <= BATCH_BLOCKS * 128  # never a fifth block
    assert "more than this machine keeps running" in KvPlan(128, 2048).why_not()  # 1 GiB
    assert "under the alert's 90%" in KvPlan(128, 16).why_not()
