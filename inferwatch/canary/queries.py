"""The PromQL of canary analysis, written once for the CLI and the rollout templates.

Every builder takes the model, the two versions and the window as text, so the CLI passes
values and the templates pass their placeholders (``{{args.model}}`` for Argo Rollouts,
``{{ variables.model }}`` and ``{{ interval }}`` for Flagger).

The ``*_increase`` queries are what a rollout controller judges: one number, or none when a
version took fewer than the minimum requests in the window (NaN for Argo Rollouts, which
then satisfies neither condition: inconclusive; no sample for Flagger, which would pass a
NaN but halts the rollout on an empty answer).
"""

from __future__ import annotations

from inferwatch import contract as c

BUCKET, COUNT = "_bucket", "_count"


def selector(metric: str, model: str, version: str, outcome: str | None = None) -> str:
    matchers = [f'{c.L_MODEL}="{model}"', f'{c.L_VERSION}="{version}"']
    if outcome:
        matchers.append(f'{c.L_OUTCOME}="{outcome}"')
    return f"{metric}{{{', '.join(matchers)}}}"


def requests(model: str, version: str, window: str) -> str:
    return f"sum(increase({selector(c.REQUESTS_TOTAL.name, model, version)}[{window}]))"


def server_errors(model: str, version: str, window: str) -> str:
    sel = selector(c.REQUESTS_TOTAL.name, model, version, c.OUTCOME_SERVER_ERROR)
    return f"sum(increase({sel}[{window}]))"


def error_ratio(model: str, version: str, window: str) -> str:
    """Server errors / requests; 0 errors when the version has no server-error series."""
    return f"({server_errors(model, version, window)} or vector(0))\n/ {requests(model, version, window)}"


def _outcome(histogram: c.Metric) -> str | None:
    # Request latency is judged on successful requests only: failures are the error check's,
    # and a timeout's duration says more about the timeout than about the model.
    return c.OUTCOME_SUCCESS if c.L_OUTCOME in histogram.labels else None


def buckets(histogram: c.Metric, model: str, version: str, window: str) -> str:
    sel = selector(histogram.name + BUCKET, model, version, _outcome(histogram))
    return f"sum by (le) (increase({sel}[{window}]))"


def observations(histogram: c.Metric, model: str, version: str, window: str) -> str:
    sel = selector(histogram.name + COUNT, model, version, _outcome(histogram))
    return f"sum(increase({sel}[{window}]))"


def quantile(q: float, histogram: c.Metric, model: str, version: str, window: str) -> str:
    sel = selector(histogram.name + BUCKET, model, version, _outcome(histogram))
    return f"histogram_quantile({q:g}, sum by (le) (rate({sel}[{window}])))"


def latency_sla(model: str, default_seconds: float) -> str:
    """The SLA the sidecar exports for the model, else the spec's default."""
    return f'max({c.MODEL_LATENCY_SLA.name}{{{c.L_MODEL}="{model}"}}) or vector({default_seconds:g})'


def _at_least(a: str, b: str, minimum: int) -> str:
    """One sample, present only when both counts are at least ``minimum``: min(a, b) >= min."""
    return f"clamp_max({a}, scalar({b})) >= {minimum}"


def _guarded(expr: str, guard: str, nan: bool) -> str:
    out = f"(\n{expr}\n)\nand on () ({guard})"
    return out + "\nor on () vector(NaN)" if nan else out


def error_ratio_increase(
    model: str, baseline: str, canary: str, window: str, min_requests: int, nan: bool = True
) -> str:
    """Canary's server-error ratio minus the baseline's (0.01 = one point worse). With too
    little traffic: NaN (``nan``, for Argo Rollouts: inconclusive) or no sample at all (for
    Flagger, which would pass a NaN and halts on an empty answer)."""
    diff = f"({error_ratio(model, canary, window)})\n-\n({error_ratio(model, baseline, window)})"
    guard = _at_least(requests(model, baseline, window), requests(model, canary, window), min_requests)
    return _guarded(diff, guard, nan)


def latency_increase(
    q: float,
    model: str,
    baseline: str,
    canary: str,
    window: str,
    min_requests: int,
    default_sla: float,
    nan: bool = True,
) -> str:
    """(canary's quantile - baseline's) / the model's latency SLA: 0.5 = half an SLA slower."""
    h = c.REQUEST_DURATION
    diff = (
        f"(\n{quantile(q, h, model, canary, window)}\n-\n{quantile(q, h, model, baseline, window)}\n)\n"
        f"/ on () ({latency_sla(model, default_sla)})"
    )
    guard = _at_least(
        observations(h, model, baseline, window), observations(h, model, canary, window), min_requests
    )
    return _guarded(diff, guard, nan)
