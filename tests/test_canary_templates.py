"""deploy/kubernetes/components/canary: the Argo Rollouts AnalysisTemplate and the Flagger
MetricTemplates are what the fleet spec generates, build with the real kustomize, carry the
fields their CRDs require (and no others), hold the spec's thresholds, and their queries are
valid PromQL (promtool). Their verdicts on live data are in tests/test_canary_live.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml

from inferwatch.canary import templates
from inferwatch.spec import load_spec, parse_spec
from tests.fixtures.deploy import K8S, ROOT, kubectl, load_all
from tests.fixtures.net import inferwatch_cmd

COMPONENT = K8S / "components" / "canary"
FLEET = ROOT / "fleet.yaml"

# From the CRDs: argoproj.io/v1alpha1 AnalysisTemplate (spec.metrics required; a metric
# requires name and provider) and flagger.app/v1beta1 MetricTemplate (spec.provider.type and
# spec.query required; type is an enum).
ANALYSIS_SPEC_KEYS = {"args", "metrics", "dryRun", "measurementRetention"}
ARG_KEYS = {"name", "value", "valueFrom"}
METRIC_KEYS = {
    "name", "interval", "initialDelay", "count", "successCondition", "failureCondition",
    "failureLimit", "inconclusiveLimit", "consecutiveErrorLimit", "consecutiveSuccessLimit", "provider",
}  # fmt: skip
ARGO_PROMETHEUS_KEYS = {"address", "query", "timeout", "insecure", "headers", "authentication", "rangeQuery"}
FLAGGER_SPEC_KEYS = {"provider", "query"}
FLAGGER_PROVIDER_KEYS = {"type", "address", "secretRef", "insecureSkipVerify", "region"}
FLAGGER_TYPES = {
    "prometheus", "influxdb", "datadog", "stackdriver", "cloudwatch", "newrelic", "graphite",
    "dynatrace", "keptn", "splunk",
}  # fmt: skip


def build(tmp_path: Path) -> list[dict]:
    """The component as an overlay sees it: a Kustomization that includes it."""
    rel = os.path.relpath(COMPONENT, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "components": [rel]}
        )
    )
    proc = subprocess.run(
        [kubectl(), "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return load_all(proc.stdout)


def test_committed_component_is_what_the_spec_generates(tmp_path: Path) -> None:
    """Else run `inferwatch canary --templates deploy/kubernetes/components/canary`."""
    proc = subprocess.run(
        inferwatch_cmd("canary", "--spec", str(FLEET), "--templates", str(tmp_path)),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(templates.FILES)
    assert sorted(p.name for p in COMPONENT.iterdir()) == sorted(templates.FILES)
    for name in templates.FILES:
        assert (tmp_path / name).read_text() == (COMPONENT / name).read_text(), f"{name} is stale"


def test_objects_carry_their_crds_required_fields(tmp_path: Path) -> None:
    docs = build(tmp_path)
    assert sorted(d["kind"] for d in docs) == ["AnalysisTemplate", "MetricTemplate", "MetricTemplate"]
    for doc in docs:
        assert doc["metadata"]["name"].startswith(templates.NAME)
        if doc["kind"] == "AnalysisTemplate":
            assert doc["apiVersion"] == "argoproj.io/v1alpha1"
            spec = doc["spec"]
            assert set(spec) <= ANALYSIS_SPEC_KEYS and spec["metrics"]
            assert [a["name"] for a in spec["args"]] == ["model", "baseline", "canary", "prometheus"]
            for arg in spec["args"]:
                assert set(arg) <= ARG_KEYS
            for metric in spec["metrics"]:
                assert set(metric) <= METRIC_KEYS, metric.keys()
                assert metric["name"] and list(metric["provider"]) == ["prometheus"]
                prom = metric["provider"]["prometheus"]
                assert set(prom) <= ARGO_PROMETHEUS_KEYS and prom["address"] and prom["query"]
                # Both conditions, so too little traffic (NaN) is Inconclusive, not Failed.
                assert metric["successCondition"] and metric["failureCondition"]
                for arg in ("model", "baseline", "canary"):
                    assert f"{{{{args.{arg}}}}}" in prom["query"]
        else:
            assert doc["apiVersion"] == "flagger.app/v1beta1"
            spec = doc["spec"]
            assert set(spec) == FLAGGER_SPEC_KEYS and spec["query"]
            assert set(spec["provider"]) <= FLAGGER_PROVIDER_KEYS
            assert spec["provider"]["type"] in FLAGGER_TYPES
            for var in ("model", "baseline", "canary"):
                assert f"{{{{ variables.{var} }}}}" in spec["query"]
            assert "{{ interval }}" in spec["query"] and "NaN" not in spec["query"]


def test_thresholds_and_window_come_from_the_spec() -> None:
    data = yaml.safe_load(FLEET.read_text())
    data["canary"] = {
        "window": "7m",
        "min_requests": 55,
        "max_error_ratio_increase": 0.03,
        "max_latency_increase": 0.25,
    }
    files = templates.render(parse_spec(data))
    argo = yaml.safe_load(files["analysistemplate.yaml"])
    conditions = {m["name"]: m["failureCondition"] for m in argo["spec"]["metrics"]}
    assert conditions == {
        "error-ratio-increase": "result[0] > 0.03",
        "p99-latency-increase": "result[0] > 0.25",
    }
    assert all("[7m]" in m["provider"]["prometheus"]["query"] for m in argo["spec"]["metrics"])
    assert all(">= 55)" in m["provider"]["prometheus"]["query"] for m in argo["spec"]["metrics"])
    flagger = files["metrictemplates.yaml"]
    assert "thresholdRange: {max: 0.03}" in flagger and "thresholdRange: {max: 0.25}" in flagger
    assert "interval: 7m" in flagger


def test_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses every query, with the placeholders filled in as the controllers do."""
    spec = load_spec(FLEET)
    rules = []
    for name, query, _ in templates.checks(spec, templates.ARGO, spec.canary.window, nan=True):
        rules.append({"record": f"argo:{name.replace('-', '_')}", "expr": query})
    for name, query, _ in templates.checks(spec, templates.FLAGGER, "{{ interval }}", nan=False):
        rules.append({"record": f"flagger:{name.replace('-', '_')}", "expr": query})
    filled = []
    for rule in rules:
        expr = rule["expr"].replace("{{ interval }}", "10m")
        for var in ("model", "baseline", "canary"):
            expr = expr.replace(f"{{{{args.{var}}}}}", "x").replace(f"{{{{ variables.{var} }}}}", "x")
        assert "{{" not in expr
        filled.append({**rule, "expr": expr})
    path = tmp_path / "queries.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "canary-templates", "rules": filled}]}))
    proc = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
