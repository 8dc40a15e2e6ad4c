"""warning: a model's latency quantile above sla_factor x its SLA, held ``for``.

Generic across models: the SLA is the sidecar's SLA gauge, else the spec's default, so a
new model needs no new rule. The comparison is exact (no interpolation error) whenever
sla_factor x SLA is a bucket boundary of the sidecar's histogram, which it is for factors
1 and 2: ``histogram_quantile(q) > X`` with a bucket ending at X holds exactly when fewer
than q of the requests took <= X, i.e. when more than 1-q of them were slower than X.
"""

from __future__ import annotations

from alert_rules import promql
from alert_rules.config import AlertTiming, RulesConfig
from inferwatch import contract as c

NAME = "inferwatch-latency"


def sla_expr(cfg: RulesConfig) -> str:
    # Every model that has request series gets the default; the sidecar's gauge wins.
    return (
        f"max by ({c.L_MODEL}) ({c.MODEL_LATENCY_SLA.name})\n"
        f"or on ({c.L_MODEL})\n"
        f"(0 * count by ({c.L_MODEL}) ({promql.requests()}) + {cfg.default_sla_seconds:g})"
    )


def quantile_signal(q: float, *matchers: str) -> str:
    """The recorded quantile ``q`` per (model, version); the alert's left-hand side for its
    quantile, and what latency panels draw."""
    series = promql.recorded(c.REC_LATENCY_QUANTILE, f'{c.L_QUANTILE}="{q:g}"', *matchers)
    return f"max without ({c.L_QUANTILE}) ({series})"


def sla_signal(*matchers: str) -> str:
    """The recorded SLA per model (exported, else the spec's default)."""
    return promql.recorded(c.REC_LATENCY_SLA, *matchers)


def limit_expr(cfg: RulesConfig, *matchers: str) -> str:
    """The alert's right-hand side: sla_factor x the SLA."""
    return f"({cfg.latency_factor:g} * {sla_signal(*matchers)})"


# How the quantile (per model and version) meets the SLA (per model).
SLA_MATCH = f"on ({c.L_MODEL}) group_left ()"


def timing(cfg: RulesConfig) -> AlertTiming:
    return AlertTiming(c.ALERT_HIGH_P99_LATENCY, cfg.latency_for_s, cfg.latency_window_s)


def alert_expr(cfg: RulesConfig) -> str:
    return f"{quantile_signal(cfg.latency_quantile)}\n> {SLA_MATCH}\n{limit_expr(cfg)}"


def group(cfg: RulesConfig) -> dict:
    quantiles = [cfg.latency_quantile] + ([0.5] if cfg.latency_quantile != 0.5 else [])
    # The buckets are summed over every pod once; each quantile reads that sum.
    rules: list[dict] = [
        {
            "record": c.REC_LATENCY_BUCKET_RATE,
            "expr": promql.bucket_rate(c.REQUEST_DURATION.name, cfg.latency_window),
        }
    ]
    rules += [
        {
            "record": c.REC_LATENCY_QUANTILE,
            "expr": promql.quantile_of_record(q, c.REC_LATENCY_BUCKET_RATE),
            "labels": {c.L_QUANTILE: f"{q:g}"},
        }
        for q in quantiles
    ]
    rules.append({"record": c.REC_LATENCY_SLA, "expr": sla_expr(cfg)})
    qn = cfg.quantile_name
    rules.append(
        {
            "alert": c.ALERT_HIGH_P99_LATENCY,
            "expr": alert_expr(cfg),
            "for": cfg.latency_for,
            "labels": {"severity": c.SEVERITY_WARNING},
            "annotations": {
                "summary": (
                    f"{{{{ $labels.{c.L_MODEL} }}}} v{{{{ $labels.{c.L_VERSION} }}}}: {qn} latency "
                    f"above {cfg.latency_factor:g}x its SLA"
                ),
                "description": (
                    f"{qn} latency of model {{{{ $labels.{c.L_MODEL} }}}} version "
                    f"{{{{ $labels.{c.L_VERSION} }}}} over {cfg.latency_window} is "
                    f"{{{{ $value | humanizeDuration }}}}, above {cfg.latency_factor:g}x its SLA, "
                    f"for {cfg.latency_for}. Compare Triton's queue time with its compute time to "
                    "tell overload from a slow model."
                ),
            },
        }
    )
    return {"name": NAME, "rules": rules}
