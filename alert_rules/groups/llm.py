"""warning: an LLM model's time to first token (TTFT) or time per output token (TPOT), at
the latency tier's quantile, above its sla_factor x its SLA, held the latency tier's ``for``.

The same shape as the request-latency warning (``latency.py``), on the sidecar's TTFT and
TPOT histograms: generic across models (the SLA is the sidecar's gauge, else the spec's
default), exact whenever sla_factor x SLA is a bucket boundary, which the sidecar's
buckets guarantee for factors 1 and 2 (``inferwatch.spec.token_latency_buckets``). A
model without streams has no TTFT series and no rule result, so Triton's non-LLM models
never meet these alerts.
"""

from __future__ import annotations

from alert_rules import promql
from alert_rules.config import RulesConfig
from inferwatch import contract as c

NAME = "inferwatch-llm"

# (alert, histogram, its bucket-rate record, its quantile record, its SLA gauge, its SLA record,
#  what, default SLA attr)
SIGNALS = (
    (
        c.ALERT_HIGH_TTFT,
        c.TIME_TO_FIRST_TOKEN,
        c.REC_TTFT_BUCKET_RATE,
        c.REC_TTFT_QUANTILE,
        c.MODEL_TTFT_SLA,
        c.REC_TTFT_SLA,
        "time to first token",
        "default_ttft_sla_seconds",
    ),
    (
        c.ALERT_HIGH_TPOT,
        c.TIME_PER_OUTPUT_TOKEN,
        c.REC_TPOT_BUCKET_RATE,
        c.REC_TPOT_QUANTILE,
        c.MODEL_TPOT_SLA,
        c.REC_TPOT_SLA,
        "time per output token",
        "default_tpot_sla_seconds",
    ),
)
# What each warning's description tells the reader to look at first.
_HINTS = {
    c.ALERT_HIGH_TTFT: (
        "Waiting requests and a full KV cache in vLLM mean overload (scale out); "
        "a high TPOT as well means the model itself got slower."
    ),
    c.ALERT_HIGH_TPOT: (
        "Each token is slower to decode: a slower version or a contended accelerator, "
        "or many more requests decoding together (compare requests running)."
    ),
}


def sla_expr(histogram: c.Metric, gauge: c.Metric, default_s: float) -> str:
    """Every model with this histogram gets the spec's default; the sidecar's gauge wins."""
    return (
        f"max by ({c.L_MODEL}) ({gauge.name})\n"
        f"or on ({c.L_MODEL})\n"
        f'(0 * count by ({c.L_MODEL}) ({histogram.name}_count{{{c.L_MODEL}!=""}}) + {default_s:g})'
    )


def quantile_signal(record: str, q: float, *matchers: str) -> str:
    """The recorded quantile ``q`` per (model, version); what the alert and the panels draw."""
    series = promql.recorded(record, f'{c.L_QUANTILE}="{q:g}"', *matchers)
    return f"max without ({c.L_QUANTILE}) ({series})"


def limit_expr(cfg: RulesConfig, sla_record: str, *matchers: str) -> str:
    return f"({cfg.latency_factor:g} * {promql.recorded(sla_record, *matchers)})"


def alert_expr(cfg: RulesConfig, alert: str) -> str:
    _, _, _, record, _, sla_record, _, _ = next(s for s in SIGNALS if s[0] == alert)
    return (
        f"{quantile_signal(record, cfg.latency_quantile)}\n"
        f"> on ({c.L_MODEL}) group_left ()\n{limit_expr(cfg, sla_record)}"
    )


def group(cfg: RulesConfig) -> dict:
    quantiles = [cfg.latency_quantile] + ([0.5] if cfg.latency_quantile != 0.5 else [])
    qn = cfg.quantile_name
    model, version = c.L_MODEL, c.L_VERSION
    rules: list[dict] = []
    for alert, histogram, buckets, record, gauge, sla_record, what, default_attr in SIGNALS:
        # The buckets are summed over every pod once; each quantile reads that sum.
        rules.append({"record": buckets, "expr": promql.bucket_rate(histogram.name, cfg.latency_window)})
        rules += [
            {
                "record": record,
                "expr": promql.quantile_of_record(q, buckets),
                "labels": {c.L_QUANTILE: f"{q:g}"},
            }
            for q in quantiles
        ]
        rules.append({"record": sla_record, "expr": sla_expr(histogram, gauge, getattr(cfg, default_attr))})
        rules.append(
            {
                "alert": alert,
                "expr": alert_expr(cfg, alert),
                "for": cfg.latency_for,
                "labels": {"severity": c.SEVERITY_WARNING},
                "annotations": {
                    "summary": (
                        f"{{{{ $labels.{model} }}}} v{{{{ $labels.{version} }}}}: {qn} {what} "
                        f"above {cfg.latency_factor:g}x its SLA"
                    ),
                    "description": (
                        f"{qn} {what} of model {{{{ $labels.{model} }}}} version "
                        f"{{{{ $labels.{version} }}}} over {cfg.latency_window} is "
                        f"{{{{ $value | humanizeDuration }}}}, above {cfg.latency_factor:g}x its SLA, "
                        f"for {cfg.latency_for}. {_HINTS[alert]}"
                    ),
                },
            }
        )
    return {"name": NAME, "rules": rules}
