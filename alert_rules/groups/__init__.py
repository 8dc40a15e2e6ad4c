"""One module per alert group; each exposes ``group(cfg) -> dict`` (a Prometheus rule group).

``GROUPS`` is the order the generator writes them in. The tiered alerts' groups and the KV cache's export
``timing(cfg)``: how long their rule takes (``timings`` collects them by alert name).
"""

from __future__ import annotations

from alert_rules.config import AlertTiming, RulesConfig
from alert_rules.groups import (
    canary,
    errors,
    gpu,
    health,
    latency,
    llm,
    llm_saturation,
    llm_slo,
    overload,
    slo,
)

GROUPS = (errors, latency, gpu, slo, health, canary, llm, llm_slo, llm_saturation, overload)

TIMED = (errors, latency, gpu, llm_saturation)


def timings(cfg: RulesConfig) -> dict[str, AlertTiming]:
    """The timing of each alert whose group exports one (the tiers and the KV cache), by name."""
    return {t.alertname: t for t in (module.timing(cfg) for module in TIMED)}
