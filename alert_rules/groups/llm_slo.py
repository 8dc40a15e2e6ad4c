"""A latency SLO on time to first token, for the LLM models whose spec sets ``ttft_slo``.

A request is good when its first token came within the model's ``ttft_sla_ms``: the
sidecar's TTFT histogram has a bucket at that SLA (``inferwatch.spec.token_latency_buckets``),
so good = that bucket's count and the slow ratio is exact. Multi-window, multi-burn-rate
alerts as for availability (``slo.py``): for a 30-day period, 14.4x over 1h and 5m and 6x
over 6h and 30m page; 1x over 3d and 6h opens a ticket. Other periods scale the windows,
which is how the demo spec plays the incident in minutes.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client.utils import floatToGoString

from alert_rules import promql
from alert_rules.config import TTFT_SLO_BURN_PAIRS, RulesConfig, TtftSloTarget
from inferwatch import contract as c

NAME = "inferwatch-llm-slo"
_M = c.L_MODEL
_TTFT = c.TIME_TO_FIRST_TOKEN.name


def le(seconds: float) -> str:
    """The ``le`` label value the sidecar writes for a bucket bound (prometheus_client's spelling)."""
    return floatToGoString(seconds)


def _on_time(slo: TtftSloTarget, window: str) -> str:
    sel = f'{_M}="{slo.model}", le="{le(slo.sla_s)}"'
    return f"sum by ({_M}) (rate({_TTFT}_bucket{{{sel}}}[{window}]))"


def _first_tokens(slo: TtftSloTarget, window: str) -> str:
    return f'sum by ({_M}) (rate({_TTFT}_count{{{_M}="{slo.model}"}}[{window}]))'


def _per_model(parts: list[str]) -> str:
    return "\nor\n".join(f"(\n{promql.indent(p)}\n)" for p in parts) if len(parts) > 1 else parts[0]


def _numerator(slos: Sequence[TtftSloTarget], window: str, _objective: str, _zero: str) -> str:
    # Each model's own SLA bucket. A model whose bucket is missing has no slow share at all.
    return _per_model([_on_time(s, window) for s in slos])


def _denominator(slos: Sequence[TtftSloTarget], window: str, _objective: str) -> str:
    return _per_model([_first_tokens(s, window) for s in slos])


KIND = promql.BurnRateSlo(
    objective_record=c.REC_TTFT_SLO_OBJECTIVE,
    ratio_record=c.REC_TTFT_SLO_SLOW_RATIO,
    budget_record=c.REC_TTFT_SLO_BUDGET_REMAINING,
    numerator_record=c.REC_TTFT_SLO_ON_TIME_RATE,
    denominator_record=c.REC_TTFT_SLO_FIRST_TOKEN_RATE,
    pairs=TTFT_SLO_BURN_PAIRS,
    good=True,
    numerator=_numerator,
    denominator=_denominator,
)


def alert_expr(severity: str, period: str, example: TtftSloTarget) -> str:
    return KIND.alert_expr(severity, period, example)


def group(cfg: RulesConfig) -> dict:
    rules: list[dict] = []
    model = c.L_MODEL
    for period, slos in promql.by_period(cfg.ttft_slos).items():
        rules += KIND.recording_rules(slos)
        for alert, severity, what in (
            (c.ALERT_TTFT_SLO_FAST_BURN, c.SEVERITY_CRITICAL, "fast: at this rate it is gone in days"),
            (
                c.ALERT_TTFT_SLO_SLOW_BURN,
                c.SEVERITY_WARNING,
                "steadily: at this rate it is gone by the end of the period",
            ),
        ):
            pairs = KIND.pairs_for(severity, slos[0])
            said = " or ".join(f"{f:g}x over {lw} and {sw}" for f, lw, sw in pairs)
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
