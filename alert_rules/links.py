"""The final pass: every alert gets ``runbook_url`` and ``dashboard_url`` annotations
(kubernetes-mixin's add-runbook-links), so no group has to remember them."""

from __future__ import annotations

from dashboards import urls
from inferwatch import contract as c
from inferwatch.spec import FleetSpec

# Which generated dashboard an alert's dashboard_url opens, and with which variables.
_MODEL_VARS = {c.L_MODEL: f"{{{{ $labels.{c.L_MODEL} }}}}"}
ALERT_DASHBOARDS: dict[str, tuple[str, dict[str, str] | None]] = {
    c.ALERT_HIGH_ERROR_RATE: (urls.MODEL_DETAIL, _MODEL_VARS),
    c.ALERT_HIGH_P99_LATENCY: (urls.MODEL_DETAIL, _MODEL_VARS),
    c.ALERT_SLO_FAST_BURN: (urls.MODEL_DETAIL, _MODEL_VARS),
    c.ALERT_SLO_SLOW_BURN: (urls.MODEL_DETAIL, _MODEL_VARS),
    c.ALERT_CANARY_REGRESSION: (urls.MODEL_DETAIL, _MODEL_VARS),
    c.ALERT_LOAD_SHEDDING: (urls.MODEL_DETAIL, _MODEL_VARS),
    c.ALERT_GPU_MEMORY_PRESSURE: (urls.GPU, None),
    c.ALERT_GPU_XID_ERRORS: (urls.GPU, None),
    c.ALERT_TARGET_DOWN: (urls.FLEET_OVERVIEW, None),
    c.ALERT_UPSTREAM_DOWN: (urls.FLEET_OVERVIEW, None),
    **{alert: (urls.LLM_SERVING, _MODEL_VARS) for alert in c.LLM_ALERTS},
}


def runbook_url(spec: FleetSpec, alert: str) -> str:
    return f"{spec.links.runbook_base_url.rstrip('/')}/{alert}.md"


def add_links(spec: FleetSpec, groups: list[dict]) -> list[dict]:
    """Adds the two link annotations to every alert rule, in place; returns ``groups``."""
    for group in groups:
        for rule in group["rules"]:
            alert = rule.get("alert")
            if alert is None:
                continue
            if alert not in ALERT_DASHBOARDS:
                raise KeyError(f"alert {alert!r} has no dashboard in alert_rules.links.ALERT_DASHBOARDS")
            dashboard, variables = ALERT_DASHBOARDS[alert]
            annotations = rule.setdefault("annotations", {})
            annotations["runbook_url"] = runbook_url(spec, alert)
            annotations["dashboard_url"] = urls.dashboard_url(spec, dashboard, variables)
    return groups
