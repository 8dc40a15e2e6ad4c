"""Build every dashboard from the fleet spec into Grafana JSON, provisioning-ready.

The JSON is written with sorted keys and a fixed indent so generated files diff cleanly,
and ``check`` tells which committed files are stale against the spec.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grafanalib import core as g
from grafanalib._gen import DashboardEncoder

from dashboards import fleet_overview, gpu, llm_serving, model_detail, urls
from dashboards.tidy import tidy
from inferwatch.spec import FleetSpec

# name -> the function building it; one module per dashboard.
DASHBOARDS: dict[str, Callable[[FleetSpec], g.Dashboard]] = {
    fleet_overview.NAME: fleet_overview.dashboard,
    model_detail.NAME: model_detail.dashboard,
    gpu.NAME: gpu.dashboard,
    llm_serving.NAME: llm_serving.dashboard,
}
DEFAULT_OUT = Path(__file__).resolve().parent / "generated"
CONFIGMAP_LABEL = "grafana_dashboard"  # what kube-prometheus-stack's Grafana sidecar watches


def dashboard_json(spec: FleetSpec, name: str) -> dict[str, Any]:
    """One dashboard as plain JSON data."""
    return tidy(json.loads(json.dumps(DASHBOARDS[name](spec).to_json_data(), cls=DashboardEncoder)))


def build(spec: FleetSpec) -> dict[str, dict[str, Any]]:
    """Every dashboard, by name."""
    return {name: dashboard_json(spec, name) for name in DASHBOARDS}


def render(data: dict[str, Any]) -> str:
    return json.dumps(data, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def filename(name: str) -> str:
    return f"{name}.json"


def write(spec: FleetSpec, out_dir: Path = DEFAULT_OUT) -> list[Path]:
    """Write every dashboard to ``out_dir``; returns the written paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, data in build(spec).items():
        path = out_dir / filename(name)
        path.write_text(render(data), encoding="utf-8")
        paths.append(path)
    return paths


def stale(spec: FleetSpec, out_dir: Path = DEFAULT_OUT) -> list[Path]:
    """The files in ``out_dir`` that are missing or differ from what ``spec`` builds."""
    out = []
    for name, data in build(spec).items():
        path = out_dir / filename(name)
        if not path.is_file() or path.read_text(encoding="utf-8") != render(data):
            out.append(path)
    return out


def configmaps(spec: FleetSpec, namespace: str | None = None) -> list[dict[str, Any]]:
    """One ConfigMap per dashboard, labelled for kube-prometheus-stack's Grafana dashboard sidecar."""
    out = []
    for name, data in build(spec).items():
        metadata: dict[str, Any] = {
            "name": f"inferwatch-dashboard-{name}",
            "labels": {CONFIGMAP_LABEL: "1", "app.kubernetes.io/part-of": "inferwatch"},
            "annotations": {"grafana_folder": "inferwatch", "inferwatch/dashboard-uid": urls.uid(name)},
        }
        if namespace:
            metadata["namespace"] = namespace
        out.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": metadata,
                "data": {filename(name): render(data)},
            }
        )
    return out
