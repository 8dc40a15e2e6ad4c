"""SLO alerts for the models whose spec declares an availability objective.

Multi-window, multi-burn-rate alerts from the SRE workbook: a pair fires when the error
budget burns faster than its factor over both its long window (the budget really is being
spent) and its short window (it still is, so the alert resolves soon after a fix). For a
30-day period: 14.4x over 1h and 5m, 6x over 6h and 30m page; 3x over 1d and 2h, 1x over
3d and 6h open a ticket. Other periods scale the windows. The burn rate is the error ratio
divided by the budget (1 - objective); the alert's value is the long window's burn rate.
"""

from __future__ import annotations

from collections.abc import Sequence

from alert_rules import promql
from alert_rules.config import SLO_BURN_PAIRS, RulesConfig, SloTarget
from inferwatch import contract as c

NAME = "inferwatch-slo"
_M = c.L_MODEL


# Each rate selects the models of its objectives by name: the ``and on (model) objective``
# keeps exactly those anyway, and the selector spares reading every other model's pods.
def _denominator(targets: Sequence[SloTarget], window: str, objective: str) -> str:
    models = [t.model for t in targets]
    return f"{promql.request_rate(window, _M, models)}\nand on ({_M})\n{objective}"


def _numerator(targets: Sequence[SloTarget], window: str, objective: str, zero: str) -> str:
    # A model with traffic and no server-error series has 0 errors/s, not none.
    errors = promql.server_error_rate(window, _M, [t.model for t in targets])
    return f"(\n  {errors}\n  and on ({_M})\n  {objective}\n)\nor\n{zero}"


KIND = promql.BurnRateSlo(
    objective_record=c.REC_SLO_OBJECTIVE,
    ratio_record=c.REC_SLO_ERROR_RATIO,
    budget_record=c.REC_SLO_BUDGET_REMAINING,
    numerator_record=c.REC_SLO_ERROR_RATE,
    denominator_record=c.REC_SLO_REQUEST_RATE,
    pairs=SLO_BURN_PAIRS,
    good=False,
    numerator=_numerator,
    denominator=_denominator,
)


def alert_expr(severity: str, period: str, example: SloTarget) -> str:
    return KIND.alert_expr(severity, period, example)


def group(cfg: RulesConfig) -> dict:
    rules: list[dict] = []
    model = c.L_MODEL
    for period, slos in promql.by_period(cfg.slos).items():
        rules += KIND.recording_rules(slos)
        for alert, severity, what in (
            (c.ALERT_SLO_FAST_BURN, c.SEVERITY_CRITICAL, "fast: at this rate it is gone in days"),
            (
                c.ALERT_SLO_SLOW_BURN,
                c.SEVERITY_WARNING,
                "steadily: at this rate it is gone before the period ends",
            ),
        ):
            pairs = [f"{f:g}x over {lw} and {sw}" for f, lw, sw in KIND.pairs_for(severity, slos[0])]
            rules.append(
                {
                    "alert": alert,
                    "expr": alert_expr(severity, period, slos[0]),
                    "labels": {"severity": severity},
                    "annotations": {
                        "summary": (
                            f"{{{{ $labels.{model} }}}} is burning its error budget {what.split(':')[0]}"
                        ),
                        "description": (
                            f"Model {{{{ $labels.{model} }}}} is spending the error budget of its "
                            f"availability objective over {period} at "
                            f'{{{{ $value | printf "%.1f" }}}}x the sustainable rate ({what}). '
                            f"Fires on a burn above {' or '.join(pairs)}."
                        ),
                    },
                }
            )
    return {"name": NAME, "rules": rules}
