"""The Pod Security Standards on every rendered pod (deploy/pod_security.py, the published
rules of the baseline and restricted profiles): every inferwatch pod and the example Triton
meet `restricted`; the GPU exporter with per-pod attribution breaks exactly the rules its
documented exception names; the sidecar component's container meets `restricted` in a pod
that sets nothing itself. The checker is shown to catch a planted privileged container and
a missing seccomp profile, so the passing runs mean something."""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.fixtures.deploy import K8S, ROOT, kubectl, kustomize_build, load_all


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pss = _load("deploy_pod_security", ROOT / "deploy" / "pod_security.py")

# The documented exception (components/gpu-attribution, deploy/README.md): hostPID and
# the kubelet's two log folders, read-only. Nothing else.
EXPORTER = "DaemonSet/inferwatch-gpu-exporter"
EXPORTER_EXCEPTION = {
    f"{EXPORTER}: host namespaces: hostPID is true",
    f"{EXPORTER}: hostPath volumes: volume kubelet-pod-logs mounts /var/log/pods",
    f"{EXPORTER}: hostPath volumes: volume kubelet-container-logs mounts /var/log/containers",
    f"{EXPORTER}: volume types: volume kubelet-pod-logs is ['hostPath']",
    f"{EXPORTER}: volume types: volume kubelet-container-logs is ['hostPath']",
}
NO_SECCOMP = "seccomp: no RuntimeDefault or Localhost profile (pod or container)"


def pod_problems(docs: list[dict]) -> set[str]:
    """What the restricted profile finds beyond the documented exception."""
    return set(pss.check(docs, "restricted")) - EXPORTER_EXCEPTION


def workload(docs: list[dict], kind: str, name: str) -> dict:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def test_every_rendered_pod_meets_restricted_but_the_documented_exception(
    overlay_builds: dict[str, list[dict]],
) -> None:
    for name, docs in overlay_builds.items():
        pods = {ref for ref, _, _ in pss.pod_templates(docs)}
        assert pods >= {
            "DaemonSet/inferwatch-gpu-exporter",
            "Deployment/inferwatch-pager",
            "Deployment/triton",
        }, name
        # vLLM too, as far as vLLM allows: all of restricted (deploy/README.md says what that took).
        assert name != "example" or "Deployment/vllm" in pods
        assert pod_problems(docs) == set(), name
        # The exception is exactly what is written down, and it is only a baseline matter
        # of host access: no privileged mode, capability or escalation rides along.
        assert set(pss.check(docs, "restricted")) == EXPORTER_EXCEPTION, name


def test_the_base_exporter_without_attribution_meets_restricted() -> None:
    docs = kustomize_build(K8S / "base")
    assert {ref for ref, _, _ in pss.pod_templates(docs)} == {
        "DaemonSet/inferwatch-gpu-exporter",
        "Deployment/inferwatch-pager",
    }
    assert pss.check(docs, "restricted") == []


def test_sidecar_container_meets_restricted_in_a_pod_that_sets_nothing(tmp_path: Path) -> None:
    """The component applied to a bare Deployment (no pod securityContext at all): the
    sidecar's own settings are enough, whatever the model team's pod says."""
    (tmp_path / "deployment.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": "bare-model", "labels": {"inferwatch.io/sidecar": "true"}},
                "spec": {
                    "selector": {"matchLabels": {"app": "bare-model"}},
                    "template": {
                        "metadata": {"labels": {"app": "bare-model"}},
                        "spec": {"containers": [{"name": "model", "image": "example/model:1"}]},
                    },
                },
            }
        )
    )
    # kustomize takes only relative paths to components.
    component = os.path.relpath(K8S / "components" / "sidecar", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump({"resources": ["deployment.yaml"], "components": [component]})
    )
    proc = subprocess.run(
        [kubectl(), "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    docs = load_all(proc.stdout)
    spec = workload(docs, "Deployment", "bare-model")["spec"]["template"]["spec"]
    assert "securityContext" not in spec
    (sidecar,) = [c for c in spec["initContainers"] if c["name"] == "inferwatch-sidecar"]
    assert pss.violations({"containers": [sidecar], "volumes": spec["volumes"]}) == []
    # The model's own container is the model team's business, and it is flagged as such.
    assert any("container model:" in v for v in pss.violations(spec))
    assert not any("inferwatch-sidecar" in v for v in pss.violations(spec))


# ---------------------------------------------------------------------------------------
# The check fails when it should
# ---------------------------------------------------------------------------------------
@pytest.fixture()
def example(overlay_builds: dict[str, list[dict]]) -> list[dict]:
    return copy.deepcopy(overlay_builds["example"])


def test_a_planted_privileged_container_fails_the_check(example: list[dict]) -> None:
    pager = workload(example, "Deployment", "inferwatch-pager")
    pager["spec"]["template"]["spec"]["containers"][0]["securityContext"]["privileged"] = True
    assert pod_problems(example) == {
        "Deployment/inferwatch-pager: container pager: privileged containers: privileged is true"
    }
    # And in the sidecar, which joins pods inferwatch does not own.
    triton = workload(example, "Deployment", "triton")
    triton["spec"]["template"]["spec"]["initContainers"][0]["securityContext"]["privileged"] = True
    assert any("container inferwatch-sidecar: privileged" in p for p in pod_problems(example))


def test_a_missing_seccomp_profile_fails_the_check(example: list[dict]) -> None:
    pager = workload(example, "Deployment", "inferwatch-pager")
    del pager["spec"]["template"]["spec"]["securityContext"]["seccompProfile"]
    assert pod_problems(example) == {f"Deployment/inferwatch-pager: container pager: {NO_SECCOMP}"}
    # The sidecar sets its own, so the pod it joins need not.
    triton = workload(example, "Deployment", "triton")
    del triton["spec"]["template"]["spec"]["securityContext"]["seccompProfile"]
    assert {p for p in pod_problems(example) if p.startswith("Deployment/triton")} == {
        f"Deployment/triton: container triton: {NO_SECCOMP}"
    }
    del triton["spec"]["template"]["spec"]["initContainers"][0]["securityContext"]["seccompProfile"]
    assert any("container inferwatch-sidecar: seccomp" in p for p in pod_problems(example))


@pytest.mark.parametrize(
    ("plant", "rule"),
    [
        (lambda s, c: s.update(hostNetwork=True), "host namespaces: hostNetwork is true"),
        (lambda s, c: c["securityContext"].update(allowPrivilegeEscalation=True), "privilege escalation"),
        (lambda s, c: c["securityContext"].update(runAsUser=0), "runAsUser is 0"),
        (
            lambda s, c: (
                c["securityContext"].pop("runAsNonRoot") and s["securityContext"].pop("runAsNonRoot")
            ),
            "runAsNonRoot",
        ),
        (
            lambda s, c: c["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]),
            "capabilities: adds ['SYS_ADMIN']",
        ),
        (lambda s, c: c["securityContext"]["capabilities"].update(drop=["NET_RAW"]), "does not drop ALL"),
        (lambda s, c: c["securityContext"].update(seccompProfile={"type": "Unconfined"}), "Unconfined"),
        (lambda s, c: c.setdefault("ports", []).append({"containerPort": 1, "hostPort": 1}), "host ports"),
        (lambda s, c: s["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "hostPath volumes"),
        (
            lambda s, c: s["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
            "sysctls",
        ),
        (lambda s, c: c["securityContext"].update(procMount="Unmasked"), "procMount"),
        (lambda s, c: c["securityContext"].update(seLinuxOptions={"type": "spc_t"}), "SELinux"),
    ],
)
def test_each_rule_catches_what_it_names(example: list[dict], plant, rule: str) -> None:
    spec = workload(example, "Deployment", "inferwatch-pager")["spec"]["template"]["spec"]
    plant(spec, spec["containers"][0])
    found = pod_problems(example)
    assert found and all(p.startswith("Deployment/inferwatch-pager") for p in found), found
    assert any(rule in p for p in found), found


def test_the_command_line_reports_and_exits_1(tmp_path: Path, overlay_builds: dict[str, list[dict]]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump_all(kustomize_build(K8S / "base")))
    assert pss.main([str(good)]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump_all(overlay_builds["example"]))
    assert pss.main([str(bad), "--level", "baseline"]) == 1
    assert pss.main([str(tmp_path / "missing.yaml")]) == 2
