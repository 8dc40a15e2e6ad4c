"""checkov, the policy scanner platform teams run, on every rendered overlay and on the
image's Dockerfile, offline (--skip-download), from its own virtual environment
(.venv-checkov, deploy/install-tools.sh). Zero failures; each remaining exception is a
checkov skip annotation on the object, with its reason, and the list of them is fixed
here. One scan covers the overlays and two planted variants (a privileged container, a
missing seccomp profile), which must fail, so a passing scan means something.

kustomize writes `matchType: =` unquoted; checkov's YAML reader then drops the whole file
with only a debug line ("is it a yaml?") and reports zero failures. The rendered documents
are therefore written back out with PyYAML, and the scan must count every resource."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.fixtures.deploy import ROOT

CHECKOV = ROOT / ".venv-checkov" / "bin" / "checkov"
INSTALL_TOOLS = ROOT / "deploy" / "install-tools.sh"
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
# Offline, JSON, and exit 0 with failures too: the tests read the report.
FLAGS = ["--skip-download", "--output", "json", "--soft-fail"]

# Every exception, with the objects it is allowed on. A new one must be added here, with
# its reason on the object itself.
ALLOWED_SKIPS = {
    # The GPU exporter's hostPID for per-pod memory (components/gpu-attribution).
    ("CKV_K8S_17", "DaemonSet.monitoring.inferwatch-gpu-exporter"),
    # No digest for the image you build until you push it, none established for Triton.
    ("CKV_K8S_43", "DaemonSet.monitoring.inferwatch-gpu-exporter"),
    ("CKV_K8S_43", "Deployment.monitoring.inferwatch-pager"),
    ("CKV_K8S_43", "Deployment.inference.triton"),
    # IfNotPresent is exact once pinned by digest; until then, the same reason.
    ("CKV_K8S_15", "DaemonSet.monitoring.inferwatch-gpu-exporter"),
    ("CKV_K8S_15", "Deployment.monitoring.inferwatch-pager"),
    ("CKV_K8S_15", "Deployment.inference.triton"),
}
# The example overlay also runs vLLM, whose image digest is not established either.
ALLOWED_SKIPS_BY_OVERLAY = {
    "example": ALLOWED_SKIPS
    | {("CKV_K8S_43", "Deployment.inference.vllm"), ("CKV_K8S_15", "Deployment.inference.vllm")},
}


def _checkov() -> Path:
    if not CHECKOV.exists():
        proc = subprocess.run(["bash", str(INSTALL_TOOLS)], capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"deploy/install-tools.sh failed:\n{proc.stderr}"
    return CHECKOV


def _pager(docs: list[dict]) -> dict:
    (d,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "inferwatch-pager"]
    return d


def _planted(docs: list[dict], how: str) -> list[dict]:
    docs = copy.deepcopy(docs)
    spec = _pager(docs)["spec"]["template"]["spec"]
    if how == "privileged":
        spec["containers"][0]["securityContext"]["privileged"] = True
    else:
        del spec["securityContext"]["seccompProfile"]
    return docs


@pytest.fixture(scope="session")
def scan(overlay_builds: dict[str, list[dict]], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """{file name: {"failed": [...], "skipped": [...], "passed": n}} from one checkov run."""
    folder = tmp_path_factory.mktemp("checkov")
    files = {f"{name}.yaml": docs for name, docs in overlay_builds.items()}
    files["planted-privileged.yaml"] = _planted(overlay_builds["example"], "privileged")
    files["planted-no-seccomp.yaml"] = _planted(overlay_builds["example"], "no-seccomp")
    for name, docs in files.items():
        (folder / name).write_text(yaml.safe_dump_all(docs, sort_keys=False))
    (folder / "Dockerfile").write_text(DOCKERFILE.read_text())
    proc = subprocess.run(
        [str(_checkov()), "-d", str(folder), "--framework", "kubernetes", "dockerfile", *FLAGS],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    reports = json.loads(proc.stdout)
    reports = {r["check_type"]: r for r in (reports if isinstance(reports, list) else [reports])}
    assert set(reports) == {"kubernetes", "dockerfile"}, set(reports)
    assert reports["kubernetes"]["summary"]["parsing_errors"] == 0
    out: dict[str, dict] = {}
    for report in reports.values():
        results = report["results"]
        for key in ("failed_checks", "skipped_checks", "passed_checks"):
            for r in results.get(key, []):
                entry = out.setdefault(Path(r["file_path"]).name, {"failed": [], "skipped": [], "passed": 0})
                if key == "passed_checks":
                    entry["passed"] += 1
                else:
                    entry[key.split("_")[0]].append(r)
                entry.setdefault("resources", set()).add(r["resource"])
    # Every file was read, every workload in it checked (see the module docstring).
    for name, docs in files.items():
        workloads = {
            f"{d['kind']}.{d['metadata']['namespace']}.{d['metadata']['name']}"
            for d in docs
            if d["kind"] in ("Deployment", "DaemonSet", "Service")
        }
        assert len(workloads) >= 6 and workloads <= out[name]["resources"], name
    return out


def test_every_overlay_has_zero_failures(scan: dict, overlay_builds: dict[str, list[dict]]) -> None:
    for name in overlay_builds:
        result = scan[f"{name}.yaml"]
        failed = [f"{r['check_id']} {r['resource']}: {r['check_name']}" for r in result["failed"]]
        assert failed == [], name
        assert result["passed"] > 200, name  # it did look


def test_each_exception_is_skipped_on_its_object_with_a_reason(
    scan: dict, overlay_builds: dict[str, list[dict]]
) -> None:
    for name in overlay_builds:
        skipped = scan[f"{name}.yaml"]["skipped"]
        assert {(r["check_id"], r["resource"]) for r in skipped} == ALLOWED_SKIPS_BY_OVERLAY.get(
            name, ALLOWED_SKIPS
        ), name
        for r in skipped:
            reason = r["check_result"]["suppress_comment"]
            assert reason != "No comment provided" and len(reason) > 30, r["check_id"]


def test_the_dockerfile_passes_with_a_healthcheck(scan: dict) -> None:
    result = scan["Dockerfile"]
    assert [r["check_id"] for r in result["failed"]] == []
    assert result["skipped"] == []
    assert result["passed"] >= 10


def test_a_planted_privileged_container_fails(scan: dict) -> None:
    failed = {(r["check_id"], r["resource"]) for r in scan["planted-privileged.yaml"]["failed"]}
    assert ("CKV_K8S_16", "Deployment.monitoring.inferwatch-pager") in failed  # privileged
    assert {resource for _, resource in failed} == {"Deployment.monitoring.inferwatch-pager"}


def test_a_missing_seccomp_profile_fails(scan: dict) -> None:
    failed = {(r["check_id"], r["resource"]) for r in scan["planted-no-seccomp.yaml"]["failed"]}
    assert failed == {("CKV_K8S_31", "Deployment.monitoring.inferwatch-pager")}
