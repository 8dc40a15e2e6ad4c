"""Every generated dashboard against Grafana's own published types, pinned to the Grafana
image the stack runs (docker-compose.yml): the dashboard model, each panel's options and
field options against its plugin's schema, targets, data links, schemaVersion, no nulls, no
keys Grafana no longer reads, no panel link that cannot resolve. The schema is derived from
@grafana/schema by dashboards/schema/derive.mjs, which scripts/bootstrap runs.

What this cannot prove (only a real Grafana would): that a panel renders what its queries
return, that a data link's variables interpolate, that the provisioned files load."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from dashboards import build, live, schema_check, tidy, urls
from inferwatch.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ROOT / "dashboards" / "generated"
SPEC = load_spec(ROOT / "fleet.yaml")
BUILT = build.build(SPEC)
DERIVED = schema_check.derived()  # fails with "run scripts/bootstrap" when not derived yet


def test_schema_is_grafanas_for_the_pinned_image() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    image = compose["services"]["grafana"]["image"]
    assert re.fullmatch(
        rf"grafana/grafana:{re.escape(schema_check.pinned_version())}(@sha256:[0-9a-f]{{64}})?", image
    )
    assert DERIVED["grafanaSchemaVersion"] == schema_check.pinned_version(), "rerun scripts/bootstrap"
    assert DERIVED["schemaVersion"] == tidy.SCHEMA_VERSION
    lock = json.loads((schema_check.SCHEMA_DIR / "package-lock.json").read_text())
    assert lock["packages"]["node_modules/@grafana/schema"]["version"] == schema_check.pinned_version()


def test_the_kept_keys_are_keys_of_grafanas_types() -> None:
    """tidy() keeps a key only if Grafana's type for that object has it."""
    dash = DERIVED["dashboard"]
    defs = dash["definitions"]
    for kept, schema in (
        (tidy.DASHBOARD_KEYS, dash),
        (tidy.PANEL_KEYS, DERIVED["panel"]),
        (tidy.ROW_KEYS, DERIVED["row"]),
        (tidy.TARGET_KEYS, DERIVED["query"]),
        (tidy.VARIABLE_KEYS, defs["VariableModel"]),
        (tidy.OPTION_KEYS, defs["VariableOption"]),
        (tidy.TIMEPICKER_KEYS, defs["TimePickerConfig"]),
        (tidy.TABLE_CUSTOM_KEYS, DERIVED["panels"]["table"]["fieldConfig"]),
    ):
        assert kept <= set(schema["properties"]), kept - set(schema["properties"])


@pytest.mark.parametrize("name", list(BUILT))
def test_every_dashboard_has_zero_violations(name: str) -> None:
    committed = json.loads((GENERATED / build.filename(name)).read_text())
    assert committed == BUILT[name], "run: inferwatch dashboards build"
    assert schema_check.violations(committed) == []


def test_every_panel_type_is_checked_against_its_plugin_schema() -> None:
    used = {p["type"] for d in BUILT.values() for p in live.panels(d)}
    assert used == {"timeseries", "heatmap", "table"}
    for kind in used:
        assert DERIVED["panels"][kind]["options"]["properties"], kind
    # The schema is strict where the issue found drift: the current heatmap's options.
    heatmap = DERIVED["panels"]["heatmap"]["options"]
    assert {"color", "tooltip", "yAxis"} <= set(heatmap["required"])
    assert "cellValues" in heatmap["properties"]


def _fleet() -> dict[str, Any]:
    return copy.deepcopy(BUILT[urls.FLEET_OVERVIEW])


def _model() -> dict[str, Any]:
    return copy.deepcopy(BUILT[urls.MODEL_DETAIL])


def _first(dash: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(p for p in dash["panels"] if p["type"] == kind)


def _legacy_key(d: dict[str, Any]) -> None:
    _first(d, "timeseries")["span"] = 4


def _null(d: dict[str, Any]) -> None:
    _first(d, "timeseries")["fieldConfig"]["defaults"]["max"] = None


def _field_panel_link(d: dict[str, Any]) -> None:
    panel = _first(d, "timeseries")
    panel["links"] = [dict(panel["fieldConfig"]["defaults"].pop("links")[0])]


def _old_heatmap_tooltip(d: dict[str, Any]) -> None:
    _first(d, "heatmap")["options"]["tooltip"] = {"show": True, "yHistogram": True}


def _angular_heatmap_key(d: dict[str, Any]) -> None:
    _first(d, "heatmap")["cards"] = {"cardPadding": 1}


def _legend_without_show_legend(d: dict[str, Any]) -> None:
    del _first(d, "timeseries")["options"]["legend"]["showLegend"]


def _table_display_mode(d: dict[str, Any]) -> None:
    _first(d, "table")["fieldConfig"]["defaults"]["custom"]["displayMode"] = "auto"
    del _first(d, "table")["fieldConfig"]["defaults"]["custom"]["cellOptions"]


def _target_step(d: dict[str, Any]) -> None:
    _first(d, "timeseries")["targets"][0]["step"] = 10


def _old_schema_version(d: dict[str, Any]) -> None:
    d["schemaVersion"] = 39


def _unknown_panel_type(d: dict[str, Any]) -> None:
    _first(d, "timeseries")["type"] = "graph"


def _bad_data_link(d: dict[str, Any]) -> None:
    _first(d, "timeseries")["fieldConfig"]["defaults"]["links"][0]["url"] = 7


PLANTED: dict[str, tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None], str]] = {
    "legacy key": (_fleet, _legacy_key, r"^/panels/\d+: Additional properties .*'span'"),
    "null": (_fleet, _null, r"^/panels/\d+/fieldConfig/defaults/max: null$"),
    "panel link with ${__field}": (_fleet, _field_panel_link, r"^/panels/\d+/links/0: a panel link cannot"),
    "old heatmap tooltip": (_model, _old_heatmap_tooltip, r"/options/tooltip: 'mode' is a required"),
    "Angular heatmap key": (_model, _angular_heatmap_key, r"^/panels/\d+: Additional properties .*'cards'"),
    "legend without showLegend": (_fleet, _legend_without_show_legend, r"'showLegend' is a required"),
    "table displayMode": (_fleet, _table_display_mode, r"custom: 'cellOptions' is a required"),
    "target step": (_fleet, _target_step, r"/targets/0: Additional properties .*'step'"),
    "old schemaVersion": (_fleet, _old_schema_version, r"^/schemaVersion: 39, Grafana 12\.1\.1 writes 41$"),
    "panel type without schema": (_fleet, _unknown_panel_type, r"no schema for panel type 'graph'"),
    "bad data link": (_fleet, _bad_data_link, r"/fieldConfig/defaults/links/0/url: 7 is not of type"),
}


@pytest.mark.parametrize("fault", list(PLANTED))
def test_a_planted_fault_is_a_violation(fault: str) -> None:
    make, plant, expected = PLANTED[fault]
    dash = make()
    assert schema_check.violations(dash) == []
    plant(dash)
    found = schema_check.violations(dash)
    assert any(re.search(expected, v) for v in found), found


def test_the_base_threshold_step_is_the_only_null_allowed() -> None:
    dash = _fleet()
    steps = _first(dash, "timeseries")["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert steps[0]["value"] is None and schema_check.violations(dash) == []
    steps.append({"color": "red", "value": None})
    assert any(v.endswith("/thresholds/steps/1/value: null") for v in schema_check.violations(dash))


def test_tidy_removes_what_grafanalib_adds() -> None:
    """The raw grafanalib output has the noise the schema flags; tidy() is what removes it."""
    from grafanalib._gen import DashboardEncoder

    raw = json.loads(
        json.dumps(build.DASHBOARDS[urls.MODEL_DETAIL](SPEC).to_json_data(), cls=DashboardEncoder)
    )
    assert len(schema_check.violations(raw)) > 100
    assert schema_check.violations(tidy.tidy(raw)) == []
