#!/usr/bin/env python3
"""The Pod Security Standards' rules, checked on rendered manifests without a cluster.

Written from the published standard (kubernetes.io, "Pod Security Standards", the
baseline and restricted profiles as of Kubernetes 1.33), field by field, as Pod Security
Admission applies them to a pod template: every container, init container and ephemeral
container, with container settings overriding the pod's where the standard says so.

    python deploy/pod_security.py rendered.yaml [--level baseline|restricted]

prints one line per violation (``Kind/name: container x: rule: what``) and exits 1 if
there is any. Standard library and PyYAML only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

LEVELS = ("baseline", "restricted")

# Baseline: capabilities a container may add beyond the runtime's default set.
BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
        "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
    }
)  # fmt: skip
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    }
)  # fmt: skip
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
# Restricted: the only volume sources allowed.
RESTRICTED_VOLUMES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"
WORKLOAD_KINDS = {"Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job", "ReplicationController"}


def all_containers(spec: dict) -> list[dict]:
    return [
        *spec.get("initContainers", []),
        *spec.get("containers", []),
        *spec.get("ephemeralContainers", []),
    ]


def _baseline(spec: dict, annotations: dict) -> Iterator[str]:
    psc = spec.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            yield f"host namespaces: {field} is true"
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        yield "HostProcess: the pod is a Windows HostProcess pod"
    for v in spec.get("volumes", []):
        if "hostPath" in v:
            yield f"hostPath volumes: volume {v['name']} mounts {v['hostPath'].get('path')}"
    for sysctl in psc.get("sysctls", []):
        if sysctl.get("name") not in SAFE_SYSCTLS:
            yield f"sysctls: {sysctl.get('name')} is not in the safe set"
    yield from _profiles("pod", psc)
    for key, value in annotations.items():
        if (
            key.startswith(APPARMOR_ANNOTATION)
            and value != "runtime/default"
            and not value.startswith("localhost/")
        ):
            yield f"AppArmor: annotation {key} is {value}"
    for c in all_containers(spec):
        sc = c.get("securityContext") or {}
        where = f"container {c['name']}"
        if sc.get("privileged"):
            yield f"{where}: privileged containers: privileged is true"
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            yield f"{where}: HostProcess: hostProcess is true"
        extra = set((sc.get("capabilities") or {}).get("add", [])) - BASELINE_CAPABILITIES
        if extra:
            yield f"{where}: capabilities: adds {sorted(extra)}"
        for port in c.get("ports", []):
            if port.get("hostPort"):
                yield f"{where}: host ports: hostPort {port['hostPort']}"
        if sc.get("procMount", "Default") != "Default":
            yield f"{where}: /proc mount type: procMount is {sc['procMount']}"
        yield from _profiles(where, sc)


def _profiles(where: str, sc: dict) -> Iterator[str]:
    """AppArmor, SELinux and seccomp fields, allowed the same way at pod and container level."""
    apparmor = (sc.get("appArmorProfile") or {}).get("type")
    if apparmor not in (None, "RuntimeDefault", "Localhost"):
        yield f"{where}: AppArmor: appArmorProfile.type is {apparmor}"
    se = sc.get("seLinuxOptions") or {}
    if se.get("type", "") not in SELINUX_TYPES:
        yield f"{where}: SELinux: seLinuxOptions.type is {se['type']}"
    for field in ("user", "role"):
        if se.get(field):
            yield f"{where}: SELinux: seLinuxOptions.{field} is set"
    if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        yield f"{where}: seccomp: seccompProfile.type is Unconfined"


def _restricted(spec: dict) -> Iterator[str]:
    psc = spec.get("securityContext") or {}
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            yield f"volume types: volume {v['name']} is {sorted(kinds - RESTRICTED_VOLUMES)}"
    if psc.get("runAsUser") == 0:
        yield "running as non-root user: the pod's runAsUser is 0"
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    for c in all_containers(spec):
        sc = c.get("securityContext") or {}
        where = f"container {c['name']}"
        if sc.get("allowPrivilegeEscalation") is not False:
            yield f"{where}: privilege escalation: allowPrivilegeEscalation is not false"
        # The container's setting wins; without one, the pod's applies.
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            yield f"{where}: running as non-root: runAsNonRoot is not true (pod or container)"
        if sc.get("runAsUser") == 0:
            yield f"{where}: running as non-root user: runAsUser is 0"
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            yield f"{where}: seccomp: no RuntimeDefault or Localhost profile (pod or container)"
        caps = sc.get("capabilities") or {}
        if "ALL" not in caps.get("drop", []):
            yield f"{where}: capabilities: does not drop ALL"
        extra = set(caps.get("add", [])) - {"NET_BIND_SERVICE"}
        if extra:
            yield f"{where}: capabilities: adds {sorted(extra)} (only NET_BIND_SERVICE may be added)"


def violations(pod_spec: dict, level: str = "restricted", annotations: dict | None = None) -> list[str]:
    """Every rule of ``level`` that ``pod_spec`` breaks, one line each; empty when it meets it."""
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}: one of {', '.join(LEVELS)}")
    found = list(_baseline(pod_spec, annotations or {}))
    if level == "restricted":
        found += _restricted(pod_spec)
    return found


def pod_templates(docs: list[dict]) -> Iterator[tuple[str, dict, dict]]:
    """(Kind/name, pod spec, pod annotations) of every Pod, workload and CronJob in ``docs``."""
    for d in docs:
        kind, name = d.get("kind"), d.get("metadata", {}).get("name")
        if kind == "Pod":
            yield f"Pod/{name}", d["spec"], d["metadata"].get("annotations", {})
        elif kind in WORKLOAD_KINDS:
            tpl = d["spec"]["template"]
            yield f"{kind}/{name}", tpl["spec"], tpl.get("metadata", {}).get("annotations", {})
        elif kind == "CronJob":
            tpl = d["spec"]["jobTemplate"]["spec"]["template"]
            yield f"{kind}/{name}", tpl["spec"], tpl.get("metadata", {}).get("annotations", {})


def check(docs: list[dict], level: str = "restricted") -> list[str]:
    return [f"{ref}: {v}" for ref, spec, ann in pod_templates(docs) for v in violations(spec, level, ann)]


def main(argv: list[str] | None = None) -> int:
    import yaml

    class Loader(yaml.SafeLoader):
        """kustomize writes `matchType: =` unquoted, which YAML 1.1 reads as the 'value' tag."""

    Loader.add_constructor("tag:yaml.org,2002:value", lambda loader, node: loader.construct_scalar(node))
    parser = argparse.ArgumentParser(description="Check rendered manifests against a Pod Security Standard.")
    parser.add_argument("files", nargs="+", type=Path, help="YAML files (e.g. kubectl kustomize output)")
    parser.add_argument("--level", choices=LEVELS, default="restricted")
    args = parser.parse_args(argv)
    docs = []
    for path in args.files:
        try:
            docs += [
                d
                for d in yaml.load_all(path.read_text(encoding="utf-8"), Loader=Loader)
                if isinstance(d, dict)
            ]
        except (OSError, yaml.YAMLError) as exc:
            print(f"pod_security: cannot read {path}: {exc}", file=sys.stderr)
            return 2
    problems = check(docs, args.level)
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
