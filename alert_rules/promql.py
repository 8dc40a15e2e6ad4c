"""Small PromQL builders shared by the alert groups and the dashboards, so each selector is
written once and a panel showing an alert's signal builds it with the alert's own code."""

from __future__ import annotations

from inferwatch import contract as c

MODEL_VERSION = f"{c.L_MODEL}, {c.L_VERSION}"
# Requests that name no model (health checks, repository index) are not a model's traffic.
_HAS_MODEL = f'{c.L_MODEL}!=""'


def requests(outcome: str | None = None) -> str:
    """The sidecar's request counter, restricted to requests that name a model."""
    matchers = [_HAS_MODEL]
    if outcome:
        matchers.append(f'{c.L_OUTCOME}="{outcome}"')
    return f"{c.REQUESTS_TOTAL.name}{{{', '.join(matchers)}}}"


def request_rate(window: str, by: str) -> str:
    return f"sum by ({by}) (rate({requests()}[{window}]))"


def server_error_ratio(window: str, by: str, min_rate: float = 0.0) -> str:
    """Server errors / all requests over ``window``. A model without server-error series
    counts 0 errors; a model with no traffic (rate <= min_rate) has no result at all, so
    the ratio is never NaN and a silent model never alerts."""
    errors = f"sum by ({by}) (rate({requests(c.OUTCOME_SERVER_ERROR)}[{window}]))"
    total = request_rate(window, by)
    return f"(\n  {errors}\n  or\n  0 * {total}\n)\n/\n({total} > {min_rate:g})"


def recorded(name: str, *matchers: str) -> str:
    """A recorded series, narrowed by ``matchers`` (a dashboard adds its variables this way)."""
    body = ", ".join(m for m in matchers if m)
    return f"{name}{{{body}}}" if body else name


def indent(expr: str, spaces: int = 2) -> str:
    pad = " " * spaces
    return "\n".join(pad + line for line in expr.splitlines())
