"""One module per alert group; each exposes ``group(cfg) -> dict`` (a Prometheus rule group).

``GROUPS`` is the order the generator writes them in.
"""

from __future__ import annotations

from alert_rules.groups import canary, errors, gpu, health, latency, slo

GROUPS = (errors, latency, gpu, slo, health, canary)
