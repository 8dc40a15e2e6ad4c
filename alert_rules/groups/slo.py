"""SLO alerts for the models whose spec declares an availability objective.

Multi-window, multi-burn-rate alerts from the SRE workbook: a pair fires when the error
budget burns faster than its factor over both its long window (the budget really is being
spent) and its short window (it still is, so the alert resolves soon after a fix). For a
30-day period: 14.4x over 1h and 5m, 6x over 6h and 30m page; 3x over 1d and 2h, 1x over
3d and 6h open a ticket. Other periods scale the windows. The burn rate is the error ratio
divided by the budget (1 - objective); the alert's value is the long window's burn rate.
"""

from __future__ import annotations

from collections import defaultdict

from alert_rules import promql
from alert_rules.config import SLO_BURN_PAIRS, RulesConfig, SloTarget, fmt_duration
from inferwatch import contract as c
from inferwatch.spec import duration_seconds

NAME = "inferwatch-slo"


def _by_period(cfg: RulesConfig) -> dict[str, list[SloTarget]]:
    out: dict[str, list[SloTarget]] = defaultdict(list)
    for slo in cfg.slos:
        out[slo.period].append(slo)
    return dict(sorted(out.items(), key=lambda kv: duration_seconds(kv[0])))


def _objective(period: str) -> str:
    return f'{c.REC_SLO_OBJECTIVE}{{{c.L_SLO_PERIOD}="{period}"}}'


def _ratio(window: str) -> str:
    return f'max without ({c.L_WINDOW}) ({c.REC_SLO_ERROR_RATIO}{{{c.L_WINDOW}="{window}"}})'


def burn(window: str, period: str) -> str:
    """The burn rate over ``window`` of the models with this period: error ratio / budget."""
    return f"{_ratio(window)}\n/ on ({c.L_MODEL})\n(1 - {_objective(period)})"


def windows(slo: SloTarget) -> list[str]:
    """Every window recorded for an objective: the workbook's, scaled, and the period."""
    ref = sorted({s for _, _, long, short in SLO_BURN_PAIRS for s in (long, short)})
    wins = [slo.window(s) for s in ref]
    period = fmt_duration(slo.period_s)
    return [*wins, period] if period not in wins else wins


def alert_expr(severity: str, period: str, example: SloTarget) -> str:
    parts = []
    for sev, factor, long, short in SLO_BURN_PAIRS:
        if sev != severity:
            continue
        lw, sw = example.window(long), example.window(short)
        parts.append(
            f"(\n  (\n{promql.indent(burn(lw, period), 4)}\n  ) > {factor:g}\n"
            f"  and on ({c.L_MODEL})\n"
            f"  (\n{promql.indent(burn(sw, period), 4)}\n  ) > {factor:g}\n)"
        )
    return f"\nor on ({c.L_MODEL})\n".join(parts)


def group(cfg: RulesConfig) -> dict:
    rules: list[dict] = []
    model = c.L_MODEL
    for period, slos in _by_period(cfg).items():
        for slo in slos:
            rules.append(
                {
                    "record": c.REC_SLO_OBJECTIVE,
                    "expr": f"vector({slo.objective:g})",
                    "labels": {model: slo.model, c.L_SLO_PERIOD: period},
                }
            )
        for window in windows(slos[0]):
            rules.append(
                {
                    "record": c.REC_SLO_ERROR_RATIO,
                    "expr": (
                        f"(\n{promql.indent(promql.server_error_ratio(window, model))}\n)\n"
                        f"and on ({model})\n{_objective(period)}"
                    ),
                    "labels": {c.L_WINDOW: window},
                }
            )
        period_window = fmt_duration(slos[0].period_s)
        rules.append(
            {
                "record": c.REC_SLO_BUDGET_REMAINING,
                "expr": f"1 - (\n{promql.indent(burn(period_window, period))}\n)",
                "labels": {c.L_SLO_PERIOD: period},
            }
        )
        for alert, severity, what in (
            (c.ALERT_SLO_FAST_BURN, c.SEVERITY_CRITICAL, "fast: at this rate it is gone in days"),
            (
                c.ALERT_SLO_SLOW_BURN,
                c.SEVERITY_WARNING,
                "steadily: at this rate it is gone before the period ends",
            ),
        ):
            pairs = [
                f"{f:g}x over {slos[0].window(lw)} and {slos[0].window(sw)}"
                for s, f, lw, sw in SLO_BURN_PAIRS
                if s == severity
            ]
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
