"""A latency SLO on time to first token, for the LLM models whose spec sets ``ttft_slo``.

A request is good when its first token came within the model's ``ttft_sla_ms``: the
sidecar's TTFT histogram has a bucket at that SLA (``inferwatch.spec.token_latency_buckets``),
so good = that bucket's count and the slow ratio is exact. Multi-window, multi-burn-rate
alerts as for availability (``slo.py``): for a 30-day period, 14.4x over 1h and 5m and 6x
over 6h and 30m page; 1x over 3d and 6h opens a ticket. Other periods scale the windows,
which is how the demo spec plays the incident in minutes.
"""

from __future__ import annotations

from collections import defaultdict

from prometheus_client.utils import floatToGoString

from alert_rules import promql
from alert_rules.config import TTFT_SLO_BURN_PAIRS, RulesConfig, TtftSloTarget, fmt_duration
from inferwatch import contract as c
from inferwatch.spec import duration_seconds

NAME = "inferwatch-llm-slo"


def le(seconds: float) -> str:
    """The ``le`` label value the sidecar writes for a bucket bound (prometheus_client's spelling)."""
    return floatToGoString(seconds)


def _by_period(cfg: RulesConfig) -> dict[str, list[TtftSloTarget]]:
    out: dict[str, list[TtftSloTarget]] = defaultdict(list)
    for slo in cfg.ttft_slos:
        out[slo.period].append(slo)
    return dict(sorted(out.items(), key=lambda kv: duration_seconds(kv[0])))


def _objective(period: str) -> str:
    return f'{c.REC_TTFT_SLO_OBJECTIVE}{{{c.L_SLO_PERIOD}="{period}"}}'


def slow_ratio(slo: TtftSloTarget, window: str) -> str:
    """Requests whose first token came later than the SLA / all requests with a first token;
    absent (not NaN) without traffic."""
    name, model = c.TIME_TO_FIRST_TOKEN.name, c.L_MODEL
    sel = f'{model}="{slo.model}"'
    good = f'sum by ({model}) (rate({name}_bucket{{{sel}, le="{le(slo.sla_s)}"}}[{window}]))'
    total = f"sum by ({model}) (rate({name}_count{{{sel}}}[{window}]))"
    return f"1 - (\n  {good}\n  /\n  ({total} > 0)\n)"


def burn(window: str, period: str) -> str:
    ratio = f'max without ({c.L_WINDOW}) ({c.REC_TTFT_SLO_SLOW_RATIO}{{{c.L_WINDOW}="{window}"}})'
    return f"{ratio}\n/ on ({c.L_MODEL})\n(1 - {_objective(period)})"


def windows(slo: TtftSloTarget) -> list[str]:
    ref = sorted({s for _, _, long, short in TTFT_SLO_BURN_PAIRS for s in (long, short)})
    wins = [slo.window(s) for s in ref]
    period = fmt_duration(slo.period_s)
    return [*wins, period] if period not in wins else wins


def pairs(severity: str, example: TtftSloTarget) -> list[tuple[float, str, str]]:
    return [
        (factor, example.window(long), example.window(short))
        for sev, factor, long, short in TTFT_SLO_BURN_PAIRS
        if sev == severity
    ]


def alert_expr(severity: str, period: str, example: TtftSloTarget) -> str:
    parts = [
        f"(\n  (\n{promql.indent(burn(lw, period), 4)}\n  ) > {f:g}\n"
        f"  and on ({c.L_MODEL})\n"
        f"  (\n{promql.indent(burn(sw, period), 4)}\n  ) > {f:g}\n)"
        for f, lw, sw in pairs(severity, example)
    ]
    return f"\nor on ({c.L_MODEL})\n".join(parts)


def group(cfg: RulesConfig) -> dict:
    rules: list[dict] = []
    model = c.L_MODEL
    for period, slos in _by_period(cfg).items():
        for slo in slos:
            rules.append(
                {
                    "record": c.REC_TTFT_SLO_OBJECTIVE,
                    "expr": f"vector({slo.objective:g})",
                    "labels": {model: slo.model, c.L_SLO_PERIOD: period},
                }
            )
        for window in windows(slos[0]):
            rules.append(
                {
                    "record": c.REC_TTFT_SLO_SLOW_RATIO,
                    "expr": "\nor\n".join(f"(\n{promql.indent(slow_ratio(s, window))}\n)" for s in slos),
                    "labels": {c.L_WINDOW: window},
                }
            )
        rules.append(
            {
                "record": c.REC_TTFT_SLO_BUDGET_REMAINING,
                "expr": f"1 - (\n{promql.indent(burn(fmt_duration(slos[0].period_s), period))}\n)",
                "labels": {c.L_SLO_PERIOD: period},
            }
        )
        for alert, severity, what in (
            (c.ALERT_TTFT_SLO_FAST_BURN, c.SEVERITY_CRITICAL, "fast: at this rate it is gone in days"),
            (
                c.ALERT_TTFT_SLO_SLOW_BURN,
                c.SEVERITY_WARNING,
                "steadily: at this rate it is gone by the end of the period",
            ),
        ):
            said = " or ".join(f"{f:g}x over {lw} and {sw}" for f, lw, sw in pairs(severity, slos[0]))
            rules.append(
                {
                    "alert": alert,
                    "expr": alert_expr(severity, period, slos[0]),
                    "labels": {"severity": severity},
                    "annotations": {
                        "summary": (
                            f"{{{{ $labels.{model} }}}} is burning its time-to-first-token budget "
                            f"{what.split(':')[0]}"
                        ),
                        "description": (
                            f"Model {{{{ $labels.{model} }}}} is spending the budget of its "
                            f"time-to-first-token objective over {period} (the share of requests whose "
                            f"first token comes within its TTFT SLA) at "
                            f'{{{{ $value | printf "%.1f" }}}}x the sustainable rate ({what}). '
                            f"Fires on a burn above {said}."
                        ),
                    },
                }
            )
    return {"name": NAME, "rules": rules}
