"""Check a dashboard against Grafana's own published types, without a Grafana.

The schema is derived by ``dashboards/schema/derive.mjs`` from ``@grafana/schema`` pinned to
the Grafana image of docker-compose.yml (scripts/bootstrap runs it). Every interface there is
a closed object, so a key Grafana no longer reads is reported, not ignored. On top of the
dashboard model (whose ``options``, ``custom`` and ``targets`` are open maps) each panel's
``options`` and ``fieldConfig.defaults.custom`` are held to its plugin's schema, each target
to the Prometheus query type and each data link to Grafana's data link type. Two rules the
types cannot say are added: no ``null`` (except the base threshold step, which Grafana
writes as null), and no ``${__field...}`` in a panel link, where Grafana never resolves it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft7Validator

SCHEMA_DIR = Path(__file__).resolve().parent / "schema"
DERIVED = SCHEMA_DIR / "derived" / "grafana-schema.json"
PACKAGE = SCHEMA_DIR / "package.json"
FIELD_VAR_RE = re.compile(r"\$\{__(field|value|data)\b")
BASE_STEP_RE = re.compile(r"/thresholds/steps/0/value$")


class SchemaMissing(RuntimeError):
    """The derived schema has not been generated on this machine."""


@cache
def derived() -> dict[str, Any]:
    if not DERIVED.is_file():
        raise SchemaMissing(f"{DERIVED} is missing: run scripts/bootstrap (it derives Grafana's schema)")
    return json.loads(DERIVED.read_text(encoding="utf-8"))


def pinned_version() -> str:
    """The @grafana/schema version package.json pins (the Grafana version it describes)."""
    return json.loads(PACKAGE.read_text(encoding="utf-8"))["dependencies"]["@grafana/schema"]


@cache
def _validator(*path: str) -> Draft7Validator:
    schema: Any = derived()
    for key in path:
        schema = schema[key]
    return Draft7Validator(schema)


def _errors(instance: Any, where: str, *schema_path: str) -> Iterator[str]:
    for err in sorted(_validator(*schema_path).iter_errors(instance), key=lambda e: list(e.absolute_path)):
        loc = where + "".join(f"/{p}" for p in err.absolute_path)
        yield f"{loc}: {err.message}"


def _nulls(value: Any, where: str) -> Iterator[str]:
    if value is None:
        if not BASE_STEP_RE.search(where):
            yield f"{where}: null"
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _nulls(v, f"{where}/{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _nulls(v, f"{where}/{i}")


def _panel(panel: dict[str, Any], where: str) -> Iterator[str]:
    kind = panel.get("type")
    if kind == "row":
        yield from _errors(panel, where, "row")
        for i, child in enumerate(panel.get("panels", [])):
            yield from _panel(child, f"{where}/panels/{i}")
        return
    yield from _errors(panel, where, "panel")
    plugin = derived()["panels"].get(kind)
    if plugin is None:
        yield f"{where}: no schema for panel type {kind!r}"
        return
    if "options" in panel:
        yield from _errors(panel["options"], f"{where}/options", "panels", kind, "options")
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    if "custom" in defaults:
        yield from _errors(
            defaults["custom"], f"{where}/fieldConfig/defaults/custom", "panels", kind, "fieldConfig"
        )
    for i, link in enumerate(defaults.get("links", [])):
        yield from _errors(link, f"{where}/fieldConfig/defaults/links/{i}", "dataLink")
    for i, target in enumerate(panel.get("targets", [])):
        yield from _errors(target, f"{where}/targets/{i}", "query")
    for i, link in enumerate(panel.get("links", [])):
        if FIELD_VAR_RE.search(json.dumps(link)):
            yield (
                f"{where}/links/{i}: a panel link cannot resolve ${{__field...}}/${{__value...}}; "
                "use a data link (fieldConfig.defaults.links)"
            )


def violations(dash: dict[str, Any]) -> list[str]:
    """Every way ``dash`` departs from Grafana's published model, as ``/json/pointer: why``."""
    out = list(_nulls(dash, ""))
    # Panels are checked one by one below (against their own type's schema), which reads far
    # better than the dashboard schema's "not valid under any of Panel | RowPanel".
    out += _errors({k: v for k, v in dash.items() if k != "panels"}, "", "dashboard")
    want = derived()["schemaVersion"]
    if dash.get("schemaVersion") != want:
        out.append(f"/schemaVersion: {dash.get('schemaVersion')!r}, Grafana {pinned_version()} writes {want}")
    for i, panel in enumerate(dash.get("panels", [])):
        out += _panel(panel, f"/panels/{i}")
    return out
