"""info: framebuffer memory used / total of a GPU above the threshold, held ``for``.

Total is used + free + reserved. dcgm-exporter's default counters do not include
FB_RESERVED, so a missing reserved series counts as 0 (then used + free is the total the
driver reports as usable). The ratio keeps every label of the GPU's series (gpu, UUID,
Hostname, modelName, and pod labels where dcgm-exporter adds them).
"""

from __future__ import annotations

from alert_rules import promql
from alert_rules.config import AlertTiming, RulesConfig
from inferwatch import contract as c

NAME = "inferwatch-gpu"


def ratio_expr() -> str:
    used, free, reserved = c.DCGM_FB_USED.name, c.DCGM_FB_FREE.name, c.DCGM_FB_RESERVED.name
    return f"{used}\n/\n(({used} + {free} + ({reserved} or 0 * {used})) > 0)"


def signal(*matchers: str) -> str:
    """The recorded ratio per GPU: what the alert compares, and what its panels draw."""
    return promql.recorded(c.REC_GPU_FB_USED_RATIO, *matchers)


def timing(cfg: RulesConfig) -> AlertTiming:
    # The ratio is instant (no range), so it follows the next scrape.
    return AlertTiming(c.ALERT_GPU_MEMORY_PRESSURE, cfg.gpu_for_s, cfg.scrape_interval_s)


def alert_expr(cfg: RulesConfig) -> str:
    return f"{signal()} > {cfg.gpu_threshold:g}"


def group(cfg: RulesConfig) -> dict:
    labels = (
        f"GPU {{{{ $labels.{c.L_GPU} }}}} ({{{{ $labels.{c.L_UUID} }}}}) on {{{{ $labels.{c.L_HOSTNAME} }}}}"
    )
    return {
        "name": NAME,
        "rules": [
            {"record": c.REC_GPU_FB_USED_RATIO, "expr": ratio_expr()},
            {
                "alert": c.ALERT_GPU_MEMORY_PRESSURE,
                "expr": alert_expr(cfg),
                "for": cfg.gpu_for,
                "labels": {"severity": c.SEVERITY_INFO},
                "annotations": {
                    "summary": f"{labels}: framebuffer memory above {cfg.gpu_threshold:.0%}",
                    "description": (
                        f"{labels} has used {{{{ $value | humanizePercentage }}}} of its framebuffer "
                        f"memory for {cfg.gpu_for}. New model instances or larger batches may fail "
                        "to allocate."
                    ),
                },
            },
        ],
    }
