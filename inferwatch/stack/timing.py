"""How long each alert of the spec needs, from a fault to its page: what the demo waits for
and what it holds each delay against. Everything here is read from the fleet spec.

The theoretical minimum of a fault is its rule's condition time (``condition_seconds``) plus
one evaluation interval plus the group wait of its severity's route.
"""

from __future__ import annotations

import math

from inferwatch import contract
from inferwatch.spec import FleetSpec, duration_seconds


def route_for(spec: FleetSpec, severity: str):
    return {
        contract.SEVERITY_CRITICAL: spec.routing.critical,
        contract.SEVERITY_WARNING: spec.routing.warning,
        contract.SEVERITY_INFO: spec.routing.info,
    }[severity]


def first_window_lead(spec: FleetSpec) -> float:
    """The shortest part of the first error window a burst must cover for that window to count.

    A model's server-error series is created by its first error, so its first sample holds
    errors that no ``rate()`` can see; the window needs a second sample, one scrape later.
    With the first error landing anywhere between two scrapes, that is up to two scrape
    intervals (the worst alignment, as the evaluation interval in the minimum is).
    """
    scrape = duration_seconds(spec.prometheus.scrape_interval)
    return min(2 * scrape, duration_seconds(spec.alerts.error_rate.window))


def error_burst_lead(spec: FleetSpec) -> float:
    """How long before the end of an error window the demo starts its burst.

    The rule's windows are tumbling and aligned to multiples of the window in absolute time,
    so where in a window a burst begins adds anything from nothing to a whole window to its
    delay. The demo takes that chance out: it starts the burst this long before a window
    ends, one scrape short of the whole window, which leaves the first failing requests
    (at the demo's rate, about one a second) time to be scraped twice inside it. Shorter
    leads, down to ``first_window_lead``, page sooner when the first errors come at once
    and a window later when they do not."""
    window = duration_seconds(spec.alerts.error_rate.window)
    scrape = duration_seconds(spec.prometheus.scrape_interval)
    return min(window, max(first_window_lead(spec), window - scrape))


def condition_seconds(spec: FleetSpec, alertname: str) -> float:
    """The shortest time a fault must last before its rule's condition holds, per the spec.

    The error rule judges N consecutive tumbling windows aligned to multiples of the window
    (alert_rules/groups/errors.py): a burst that starts late in one window can make that
    window's ratio cross the threshold, so N windows are satisfied after N-1 whole windows
    and the part of the first that the rate needs to see it (``first_window_lead``). The
    latency and GPU rules hold their condition for ``for``.
    """
    a = spec.alerts
    if alertname == contract.ALERT_HIGH_ERROR_RATE:
        return (a.error_rate.consecutive_windows - 1) * duration_seconds(a.error_rate.window) + (
            first_window_lead(spec)
        )
    if alertname == contract.ALERT_HIGH_P99_LATENCY:
        return duration_seconds(a.latency.for_)
    if alertname == contract.ALERT_GPU_MEMORY_PRESSURE:
        return duration_seconds(a.gpu_memory.for_)
    raise KeyError(alertname)


def next_error_window_start(spec: FleetSpec, now: float) -> float:
    """The first instant from ``now`` that lies ``error_burst_lead`` before an error window ends."""
    window = duration_seconds(spec.alerts.error_rate.window)
    lead = error_burst_lead(spec)
    return math.ceil((now + lead) / window) * window - lead


def theoretical_minimum(spec: FleetSpec, alertname: str) -> float:
    """Condition time + one evaluation interval + the group wait of the alert's route."""
    severity = contract.TIERED_ALERTS[alertname]
    return (
        condition_seconds(spec, alertname)
        + duration_seconds(spec.prometheus.evaluation_interval)
        + duration_seconds(route_for(spec, severity).group_wait)
    )


def resolve_bound(spec: FleetSpec, alertname: str) -> float:
    """Expected time from clearing a fault to its resolved notification: the data window
    the condition looks at, an evaluation, and Alertmanager's group interval."""
    a = spec.alerts
    window = {
        contract.ALERT_HIGH_ERROR_RATE: duration_seconds(a.error_rate.window),
        contract.ALERT_HIGH_P99_LATENCY: duration_seconds(a.latency.window),
        contract.ALERT_GPU_MEMORY_PRESSURE: duration_seconds(spec.prometheus.scrape_interval),
    }[alertname]
    severity = contract.TIERED_ALERTS[alertname]
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
    a = spec.alerts
    spans = (
        a.error_rate.consecutive_windows * duration_seconds(a.error_rate.window),
        duration_seconds(a.latency.for_),
        duration_seconds(a.gpu_memory.for_),
    )
    routes = (spec.routing.critical, spec.routing.warning, spec.routing.info)
    wait = max(duration_seconds(r.group_wait) for r in routes)
    return max(spans) + duration_seconds(spec.prometheus.evaluation_interval) + wait


def deadline_after(minimum: float) -> float:
    """How long past its theoretical minimum a notification may take on a busy machine
    before the demo calls it lost."""
    return max(2.0 * minimum, minimum + 45.0)
