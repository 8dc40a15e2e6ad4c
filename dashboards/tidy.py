"""The one pass that turns grafanalib's output into the dashboard model of the pinned Grafana.

grafanalib (0.7) still writes for Grafana 6-8: ``null`` for every unset attribute, the
Angular-era keys (``span``, ``height``, ``minSpan``, ``error``; the old heatmap's ``cards``,
``xAxis``, ``yBucket*``; the old table's ``columns``, ``fontSize``; ``step``, ``metric`` on
targets; ``auto*``, ``tags*`` on variables) and ``schemaVersion`` as given. Grafana ignores
them on load and drops them on save, so a reviewer reads noise in every diff. Here each
object kind keeps only the keys of its type in ``@grafana/schema`` (the lists below; the
schema test checks them against the derived schema) and nulls go, so the generator modules
can keep grafanalib's readable constructors. Kept on grafanalib rather than moved to
grafana-foundation-sdk: its Python builders are generated per Grafana version and would
rewrite every dashboard module for the same JSON this pass already yields.
"""

from __future__ import annotations

from typing import Any

# Grafana 12.1's dashboard schema version (defaultDashboard.schemaVersion in @grafana/schema
# 12.1.1): older versions make Grafana migrate the JSON in memory on every load.
SCHEMA_VERSION = 41

# The keys of each object's type in @grafana/schema (raw/dashboard/x/dashboard_types.gen.ts,
# the Prometheus query for targets) that inferwatch may write.
DASHBOARD_KEYS = frozenset(
    {
        "annotations", "description", "editable", "fiscalYearStartMonth", "graphTooltip", "links",
        "liveNow", "panels", "preload", "refresh", "schemaVersion", "tags", "templating", "time",
        "timepicker", "timezone", "title", "uid", "version", "weekStart",
    }
)  # fmt: skip
PANEL_KEYS = frozenset(
    {
        "cacheTimeout", "datasource", "description", "fieldConfig", "gridPos", "hideTimeOverride", "id",
        "interval", "links", "maxDataPoints", "maxPerRow", "options", "pluginVersion", "queryCachingTTL",
        "repeat", "repeatDirection", "targets", "timeFrom", "timeShift", "title", "transformations",
        "transparent", "type",
    }
)  # fmt: skip
ROW_KEYS = frozenset({"collapsed", "gridPos", "id", "panels", "repeat", "title", "type"})
TARGET_KEYS = frozenset(
    {"datasource", "editorMode", "exemplar", "expr", "format", "hide", "instant", "intervalFactor",
     "legendFormat", "range", "refId"}
)  # fmt: skip
VARIABLE_KEYS = frozenset(
    {
        "allValue", "allowCustomValue", "current", "datasource", "description", "hide", "includeAll",
        "label", "multi", "name", "options", "query", "refresh", "regex", "skipUrlSync", "sort", "type",
    }
)  # fmt: skip
OPTION_KEYS = frozenset({"selected", "text", "value"})
TIMEPICKER_KEYS = frozenset({"hidden", "nowDelay", "quick_ranges", "refresh_intervals"})
# A table column's field options: displayMode is the pre-10 spelling of cellOptions.
TABLE_CUSTOM_KEYS = frozenset(
    {
        "align",
        "cellOptions",
        "filterable",
        "hidden",
        "hideHeader",
        "inspect",
        "minWidth",
        "width",
        "wrapHeaderText",
    }
)


def drop_nulls(value: Any, _parent: str = "") -> Any:
    """``value`` without null members. A threshold step keeps a null value: it is how Grafana
    spells the base step ("from minus infinity"), the one null its schema allows."""
    if isinstance(value, dict):
        return {
            k: drop_nulls(v, k)
            for k, v in value.items()
            if v is not None or (k == "value" and _parent == "steps")
        }
    if isinstance(value, list):
        return [drop_nulls(v, _parent) for v in value]
    return value


def _keep(obj: dict[str, Any], keys: frozenset[str]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k in keys}


def _panel(panel: dict[str, Any]) -> dict[str, Any]:
    if panel["type"] == "row":
        row = _keep(panel, ROW_KEYS)
        row["panels"] = [_panel(p) for p in row.get("panels", [])]
        return row
    out = _keep(panel, PANEL_KEYS)
    out["targets"] = [_keep(t, TARGET_KEYS) for t in out.get("targets", [])]
    defaults = out.get("fieldConfig", {}).get("defaults", {})
    if out["type"] == "table" and "custom" in defaults:
        defaults["custom"] = _keep(defaults["custom"], TABLE_CUSTOM_KEYS)
    if not out.get("links"):
        out.pop("links", None)
    if out.get("repeat") is None:
        out.pop("repeatDirection", None)
        out.pop("maxPerRow", None)
    return out


def _variable(var: dict[str, Any]) -> dict[str, Any]:
    out = _keep(var, VARIABLE_KEYS)
    if var.get("includeAll") and var.get("multi"):
        # "All" selected, as Grafana writes it, so the variable reads All before any query.
        out["current"] = {"selected": True, "text": ["All"], "value": ["$__all"]}
    elif "current" in out:
        current = _keep(out["current"], OPTION_KEYS)
        # Nothing chosen yet: leave current out, Grafana picks the first value on load.
        if {"text", "value"} <= current.keys():
            out["current"] = current
        else:
            del out["current"]
    return out


def tidy(data: dict[str, Any]) -> dict[str, Any]:
    """grafanalib's dashboard JSON as Grafana 12.1 itself would save it."""
    data = drop_nulls(data)
    # No __inputs: a provisioned dashboard never gets them resolved; the datasource variable
    # serves UI import and provisioning alike. id is Grafana's database key, not ours.
    out = _keep(data, DASHBOARD_KEYS)
    out["schemaVersion"] = SCHEMA_VERSION
    out["panels"] = [_panel(p) for p in out.get("panels", [])]
    out["templating"] = {"list": [_variable(v) for v in out["templating"]["list"]]}
    if "timepicker" in out:
        # time_options went in schema version 41 (Grafana deletes it on load).
        out["timepicker"] = _keep(out["timepicker"], TIMEPICKER_KEYS)
    return out
