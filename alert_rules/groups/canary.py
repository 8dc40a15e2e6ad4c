"""warning: a version of a model is worse than another version of the same model.

The tiered alerts compare each version with its SLA alone, so a canary that doubles the
error rate while staying under the error threshold is never called. This group compares the
versions of a model with each other over ``canary.window``, with the spec's canary margins:

- errors: a version's server-error ratio is above the lowest of its model's versions by
  more than ``canary.max_error_ratio_increase``;
- latency: its P99 is above the lowest P99 of its model's versions by more than
  ``canary.max_latency_increase`` x the model's latency SLA.

Only versions with at least ``canary.min_requests`` requests (successful requests, for
latency) in the window are recorded, and a model is compared only while at least two of its
versions are: a canary taking 1% of the traffic is not judged on a handful of requests. The
alert names the worse version and the check (label ``check``). ``inferwatch canary`` adds
significance tests on top for a rollout decision; the alert uses the margins alone.
"""

from __future__ import annotations

from alert_rules import promql
from alert_rules.config import RulesConfig
from inferwatch import contract as c

NAME = "inferwatch-canary"
P99 = 0.99
CHECK_ERRORS, CHECK_LATENCY = "errors", "latency"


def requests_expr(cfg: RulesConfig) -> str:
    return f"sum by ({promql.MODEL_VERSION}) (increase({promql.requests()}[{cfg.canary_window}]))"


def error_ratio_expr(cfg: RulesConfig) -> str:
    """Server errors / requests over the window; the requests are ``requests_expr`` recorded
    just before (read twice here, as the zeros and the denominator, without reading every
    pod's counters twice)."""
    mv, w, total = promql.MODEL_VERSION, cfg.canary_window, c.REC_CANARY_REQUESTS
    errors = f"sum by ({mv}) (increase({promql.requests(c.OUTCOME_SERVER_ERROR)}[{w}]))"
    return f"(\n  {errors}\n  or\n  0 * {total}\n)\n/\n({total} >= {cfg.canary_min_requests})"


def latency_quantile_expr(cfg: RulesConfig) -> str:
    mv, w = promql.MODEL_VERSION, cfg.canary_window
    success = f'{c.L_MODEL}!="", {c.L_OUTCOME}="{c.OUTCOME_SUCCESS}"'
    bucket = f"{c.REQUEST_DURATION.name}_bucket{{{success}}}"
    count = f"{c.REQUEST_DURATION.name}_count{{{success}}}"
    return (
        f"histogram_quantile({P99:g}, sum by ({mv}, le) (rate({bucket}[{w}])))\n"
        f"and on ({mv})\n"
        f"(sum by ({mv}) (increase({count}[{w}])) >= {cfg.canary_min_requests})"
    )


def _worse_than_best(series: str, limit: str) -> str:
    """``series`` minus the lowest of the model's versions, above ``limit``, where the model
    has at least two versions recorded."""
    m = c.L_MODEL
    return (
        f"(\n  {series}\n  - on ({m}) group_left ()\n  min by ({m}) ({series})\n)\n{limit}\n"
        f"and on ({m})\n(count by ({m}) ({series}) >= 2)"
    )


def alert_expr(cfg: RulesConfig) -> str:
    m, check = c.L_MODEL, c.L_CHECK
    errors = _worse_than_best(c.REC_CANARY_ERROR_RATIO, f"> {cfg.canary_max_error_increase:g}")
    p99 = f'{c.REC_CANARY_LATENCY_QUANTILE}{{{c.L_QUANTILE}="{P99:g}"}}'
    # In SLAs, so one margin fits every model; the alert's value is that fraction.
    latency = _worse_than_best(
        f"max without ({c.L_QUANTILE}) ({p99})",
        f"/ on ({m}) group_left () {c.REC_LATENCY_SLA}\n> {cfg.canary_max_latency_increase:g}",
    )
    return (
        f'label_replace(\n{promql.indent(errors)},\n  "{check}", "{CHECK_ERRORS}", "", ""\n)\n'
        f'or\nlabel_replace(\n{promql.indent(latency)},\n  "{check}", "{CHECK_LATENCY}", "", ""\n)'
    )


def group(cfg: RulesConfig) -> dict:
    return {
        "name": NAME,
        "rules": [
            {"record": c.REC_CANARY_REQUESTS, "expr": requests_expr(cfg)},
            {"record": c.REC_CANARY_ERROR_RATIO, "expr": error_ratio_expr(cfg)},
            {
                "record": c.REC_CANARY_LATENCY_QUANTILE,
                "expr": latency_quantile_expr(cfg),
                "labels": {c.L_QUANTILE: f"{P99:g}"},
            },
            {
                "alert": c.ALERT_CANARY_REGRESSION,
                "expr": alert_expr(cfg),
                "for": cfg.canary_for,
                "labels": {"severity": c.SEVERITY_WARNING},
                "annotations": {
                    "summary": (
                        f"{{{{ $labels.{c.L_MODEL} }}}} v{{{{ $labels.{c.L_VERSION} }}}} is worse than "
                        f"another version of the model ({{{{ $labels.{c.L_CHECK} }}}})"
                    ),
                    "description": (
                        f"Over the last {cfg.canary_window}, version {{{{ $labels.{c.L_VERSION} }}}} of "
                        f"model {{{{ $labels.{c.L_MODEL} }}}} is worse than the model's best version "
                        f'by {{{{ $value | printf "%.3g" }}}} ({{{{ $labels.{c.L_CHECK} }}}}: '
                        f"server-error ratio allowed +{cfg.canary_max_error_increase:g}, P99 allowed "
                        f"+{cfg.canary_max_latency_increase:g} x SLA), for {cfg.canary_for}. If it is "
                        f"the version being rolled out, run `inferwatch canary` and roll it back."
                    ),
                },
            },
        ],
    }
