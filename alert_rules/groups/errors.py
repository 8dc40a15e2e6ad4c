"""critical: a model's server-error ratio above the threshold in each of N consecutive windows.

The windows are tumbling: the subquery ``[N*w - 1ms : w]`` evaluates the ratio at the
last N timestamps that are multiples of ``w`` (Prometheus aligns subquery steps to the
step in absolute time), each covering ``(T - w, T]``. The 1 ms shortening makes the range
hold exactly N steps at every evaluation time (a range of exactly N*w holds N+1 steps when
the evaluation lands on a multiple of ``w``). Requiring N present steps keeps a model whose
traffic started inside the range from alerting on fewer windows. So: errors confined to
N-1 windows never alert; N bad windows alert at the first evaluation after the N-th closes.
"""

from __future__ import annotations

from alert_rules import promql
from alert_rules.config import AlertTiming, RulesConfig, fmt_duration
from inferwatch import contract as c

NAME = "inferwatch-errors"


def ratio_expr(cfg: RulesConfig) -> str:
    """One window's server-error ratio per (model, version): what the alert judges window by
    window, recorded as ``signal()``."""
    return promql.server_error_ratio(cfg.error_window, promql.MODEL_VERSION, cfg.error_min_rate)


def signal(*matchers: str) -> str:
    """The recorded per-window ratio, as a panel showing this alert's threshold reads it."""
    return promql.recorded(c.REC_SERVER_ERROR_RATIO, *matchers)


def timing(cfg: RulesConfig) -> AlertTiming:
    # Tumbling windows aligned to multiples of the window: a fault that starts late in one
    # window can tip that window's ratio, so N windows hold after N-1 whole ones and a bit.
    return AlertTiming(
        c.ALERT_HIGH_ERROR_RATE, (cfg.error_windows - 1) * cfg.error_window_s, cfg.error_window_s
    )


def alert_expr(cfg: RulesConfig) -> str:
    ratio = ratio_expr(cfg)
    rng = fmt_duration(cfg.error_windows * cfg.error_window_s - 0.001)
    sub = f"(\n{promql.indent(ratio, 4)}\n  )[{rng}:{cfg.error_window}]"
    return (
        f"min_over_time(\n  {sub}\n) > {cfg.error_threshold:g}\n"
        f"and\ncount_over_time(\n  {sub}\n) >= {cfg.error_windows}"
    )


def group(cfg: RulesConfig) -> dict:
    mv = promql.MODEL_VERSION
    return {
        "name": NAME,
        "rules": [
            {
                "record": c.REC_REQUEST_RATE,
                "expr": promql.request_rate(cfg.error_window, mv),
            },
            {
                "record": c.REC_SERVER_ERROR_RATIO,
                "expr": ratio_expr(cfg),
            },
            {
                "alert": c.ALERT_HIGH_ERROR_RATE,
                "expr": alert_expr(cfg),
                "labels": {"severity": c.SEVERITY_CRITICAL},
                "annotations": {
                    "summary": (
                        f"{{{{ $labels.{c.L_MODEL} }}}} v{{{{ $labels.{c.L_VERSION} }}}}: server errors "
                        f"above {cfg.error_threshold:.0%} for {cfg.error_windows} windows "
                        f"of {cfg.error_window}"
                    ),
                    "description": (
                        f"At least {{{{ $value | humanizePercentage }}}} of the requests to model "
                        f"{{{{ $labels.{c.L_MODEL} }}}} version {{{{ $labels.{c.L_VERSION} }}}} "
                        "failed on the "
                        f"server side in each of the last {cfg.error_windows} {cfg.error_window} windows "
                        f"(threshold {cfg.error_threshold:.0%}). If a new version was just rolled out, "
                        "roll it back."
                    ),
                },
            },
        ],
    }
