"""How long each alert of the spec needs, from a fault to its page: what the demo waits for
and what it holds each delay against. Everything here is read from the fleet spec.

The theoretical minimum of a fault is its rule's condition time (``condition_seconds``) plus
one evaluation interval plus the group wait of its severity's route. The rule's own timing
(its condition time and data window) is the one its alert group exports
(``alert_rules.groups.timings``), so the rules and the demo cannot disagree; this module
adds what the demo's measurement needs on top (the first error window's scrapes, the
evaluation, the routes).
"""

from __future__ import annotations

import math

from alert_rules.config import AlertTiming, RulesConfig
from alert_rules.groups import timings
from inferwatch import contract
from inferwatch.spec import FleetSpec, duration_seconds


def route_for(spec: FleetSpec, severity: str):
    return {
        contract.SEVERITY_CRITICAL: spec.routing.critical,
        contract.SEVERITY_WARNING: spec.routing.warning,
        contract.SEVERITY_INFO: spec.routing.info,
    }[severity]


# LLM alerts whose rules hold the same ``for`` over the same window as a tiered alert
# (alert_rules/groups/llm.py: the latency tier's window and for; llm_saturation.py: the
# KV-cache gauge held the GPU tier's for), so they take that alert's exported timing.
SAME_TIMING_AS = {
    contract.ALERT_HIGH_TTFT: contract.ALERT_HIGH_P99_LATENCY,
    contract.ALERT_HIGH_TPOT: contract.ALERT_HIGH_P99_LATENCY,
}


def rule_timing(spec: FleetSpec, alertname: str) -> AlertTiming:
    """The timing the alert's group exports for this spec (KeyError for an untimed alert)."""
    timed = timings(RulesConfig.from_spec(spec))
    if alertname in SAME_TIMING_AS:
        same = timed[SAME_TIMING_AS[alertname]]
        return AlertTiming(alertname, same.condition_s, same.window_s)
    return timed[alertname]


def _error_window(spec: FleetSpec) -> float:
    return rule_timing(spec, contract.ALERT_HIGH_ERROR_RATE).window_s


def first_window_lead(spec: FleetSpec) -> float:
    """The shortest part of the first error window a burst must cover for that window to count.

    A model's server-error series is created by its first error, so its first sample holds
    errors that no ``rate()`` can see; the window needs a second sample, one scrape later.
    With the first error landing anywhere between two scrapes, that is up to two scrape
    intervals (the worst alignment, as the evaluation interval in the minimum is).
    """
    scrape = duration_seconds(spec.prometheus.scrape_interval)
    return min(2 * scrape, _error_window(spec))


def error_burst_lead(spec: FleetSpec) -> float:
    """How long before the end of an error window the demo starts its burst.

    The rule's windows are tumbling and aligned to multiples of the window in absolute time,
    so where in a window a burst begins adds anything from nothing to a whole window to its
    delay. The demo takes that chance out: it starts the burst this long before a window
    ends, one scrape short of the whole window, which leaves the first failing requests
    (at the demo's rate, about one a second) time to be scraped twice inside it. Shorter
    leads, down to ``first_window_lead``, page sooner when the first errors come at once
    and a window later when they do not."""
    window = _error_window(spec)
    scrape = duration_seconds(spec.prometheus.scrape_interval)
    return min(window, max(first_window_lead(spec), window - scrape))


def condition_seconds(spec: FleetSpec, alertname: str) -> float:
    """The shortest time a fault must last before its rule's condition holds, per the spec.

    The exported condition time, and for the error rule the part of the first window that
    the rate needs to see a burst: its N consecutive tumbling windows are satisfied after
    N-1 whole windows (what the group exports) and ``first_window_lead`` of the first. The
    latency and GPU rules hold their condition for ``for`` (exported as is).
    """
    condition = rule_timing(spec, alertname).condition_s
    if alertname == contract.ALERT_HIGH_ERROR_RATE:
        return condition + first_window_lead(spec)
    return condition


def next_error_window_start(spec: FleetSpec, now: float) -> float:
    """The first instant from ``now`` that lies ``error_burst_lead`` before an error window ends."""
    window = _error_window(spec)
    lead = error_burst_lead(spec)
    return math.ceil((now + lead) / window) * window - lead


def theoretical_minimum(spec: FleetSpec, alertname: str) -> float:
    """Condition time + one evaluation interval + the group wait of the alert's route."""
    severity = contract.ALL_ALERTS[alertname]
    return (
        condition_seconds(spec, alertname)
        + duration_seconds(spec.prometheus.evaluation_interval)
        + duration_seconds(route_for(spec, severity).group_wait)
    )


def resolve_bound(spec: FleetSpec, alertname: str) -> float:
    """Expected time from clearing a fault to its resolved notification: the data window
    the condition looks at (exported by the rule's group), an evaluation, and Alertmanager's
    group interval."""
    window = rule_timing(spec, alertname).window_s
    severity = contract.ALL_ALERTS[alertname]
    return (
        window
        + duration_seconds(spec.prometheus.evaluation_interval)
        + duration_seconds(route_for(spec, severity).group_interval)
    )


def default_steady(spec: FleetSpec) -> float:
    """A steady phase long enough for every tier's rule to have fired from a cold start had
    anything been wrong: the longest time a rule needs (N error windows of data, or a
    ``for``), one evaluation, the longest group wait. So "nothing paged while healthy" is a
    statement about every rule."""
    rules = timings(RulesConfig.from_spec(spec))
    # The error rule needs all N windows of data from a cold start: N-1 and the first one.
    spans = [t.condition_s for t in rules.values()]
    errors = rules[contract.ALERT_HIGH_ERROR_RATE]
    spans.append(errors.condition_s + errors.window_s)
    routes = (spec.routing.critical, spec.routing.warning, spec.routing.info)
    wait = max(duration_seconds(r.group_wait) for r in routes)
    return max(spans) + duration_seconds(spec.prometheus.evaluation_interval) + wait


def deadline_after(minimum: float) -> float:
    """How long past its theoretical minimum a notification may take on a busy machine
    before the demo calls it lost."""
    return max(2.0 * minimum, minimum + 45.0)
