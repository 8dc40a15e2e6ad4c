"""critical: a model's server-error ratio above the threshold in each of N consecutive windows.

The windows are tumbling: the subquery ``[N*w - 1ms : w]`` evaluates the ratio at the
last N timestamps that are multiples of ``w`` (Prometheus aligns subquery steps to the
step in absolute time), each covering ``(T - w, T]``. The 1 ms shortening makes the range
hold exactly N steps at every evaluation time (a range of exactly N*w holds N+1 steps when
the evaluation lands on a multiple of ``w``). Requiring N present steps keeps a model whose
traffic started inside the range from alerting on fewer windows. So: errors confined to
N-1 windows never alert; N bad windows alert at the first evaluation after the N-th closes.

Cost: the subquery reads every pod's request counters once per step, so it is written once
(``count_over_time`` of the windows above the threshold: N of them means all N steps present
and bad), and the alert's value, the newest window's ratio, is the same last step again
(a one-step subquery). The recorded ratio divides by the recorded request rate.
"""

from __future__ import annotations

from alert_rules import promql
from alert_rules.config import AlertTiming, RulesConfig, fmt_duration
from inferwatch import contract as c

NAME = "inferwatch-errors"


def ratio_expr(cfg: RulesConfig) -> str:
    """One window's server-error ratio per (model, version): what the alert judges window by
    window, recorded as ``signal()`` (its total is the request rate recorded just before it)."""
    return promql.server_error_ratio(
        cfg.error_window, promql.MODEL_VERSION, cfg.error_min_rate, total=c.REC_REQUEST_RATE
    )


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
    w = cfg.error_window
    # Without zeros: they never pass the threshold (> 0), and the count needs no step below it.
    ratio = promql.server_error_ratio_where_errors(w, promql.MODEL_VERSION, cfg.error_min_rate)
    bad = f"{ratio}\n> {cfg.error_threshold:g}"
    n_steps = fmt_duration(cfg.error_windows * cfg.error_window_s - 0.001)
    one_step = fmt_duration(cfg.error_window_s - 0.001)
    # The value: the newest window's ratio, present whenever the count holds (its step passed).
    return (
        f"last_over_time(\n  (\n{promql.indent(ratio, 4)}\n  )[{one_step}:{w}]\n)\n"
        f"and\ncount_over_time(\n  (\n{promql.indent(bad, 4)}\n  )[{n_steps}:{w}]\n)"
        f" >= {cfg.error_windows}"
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
                        f"More than {cfg.error_threshold:.0%} of the requests to model "
                        f"{{{{ $labels.{c.L_MODEL} }}}} version {{{{ $labels.{c.L_VERSION} }}}} "
                        "failed on the server side in each of the last "
                        f"{cfg.error_windows} {cfg.error_window} windows, "
                        "{{ $value | humanizePercentage }} in the latest. If a new version was just "
                        "rolled out, roll it back."
                    ),
                },
            },
        ],
    }
