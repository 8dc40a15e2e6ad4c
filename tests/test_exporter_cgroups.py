"""GPU process attribution: /proc/<pid>/cgroup contents as each runtime and cgroup version write
them, kubelet log names, and per-pod memory served end to end."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from exporters.backends.simulated import SimulatedBackend
from exporters.cgroups import Names, Owner, attribute, label_owner, parse_cgroup, read_names
from exporters.collector import GpuSource
from exporters.fields import load_fields
from exporters.model import GpuProcess
from inferwatch import contract as c
from tests.fixtures.gpu_exporter import serve_in_thread

UID = "5f3a2b1c-8d7e-4f60-a1b2-c3d4e5f60718"
UID_ = UID.replace("-", "_")  # the systemd driver's spelling in slice names
CID = "3f9c1e0a7b2d4c6e8f1a3b5c7d9e0f2a4b6c8d0e1f3a5b7c9d1e3f5a7b9c0d2e"
CID2 = "a" * 64

V1_SYSTEMD_CONTAINERD = (
    "\n".join(
        f"{n}:{ctrl}:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope"
        for n, ctrl in [
            (12, "hugetlb"),
            (11, "memory"),
            (10, "cpu,cpuacct"),
            (9, "devices"),
            (8, "pids"),
            (7, "blkio"),
            (6, "net_cls,net_prio"),
            (5, "cpuset"),
            (4, "perf_event"),
            (3, "freezer"),
            (2, "rdma"),
            (1, "name=systemd"),
        ]
    )
    + "\n0::/\n"
)  # hybrid hierarchy: the unified line says nothing

V1_CGROUPFS = "".join(
    f"{n}:{ctrl}:/kubepods/burstable/pod{UID}/{CID}\n"
    for n, ctrl in [(11, "memory"), (10, "devices"), (4, "cpu,cpuacct"), (1, "name=systemd")]
)

CASES = {
    # cgroup v2, systemd driver (the default of current kubeadm, EKS, GKE images)
    "v2 systemd containerd burstable": (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
        Owner(UID, CID, "containerd"),
    ),
    "v2 systemd CRI-O guaranteed": (
        f"0::/kubepods.slice/kubepods-pod{UID_}.slice/crio-{CID}.scope\n",
        Owner(UID, CID, "cri-o"),
    ),
    "v2 systemd docker besteffort": (
        f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/docker-{CID}.scope\n",
        Owner(UID, CID, "docker"),
    ),
    "v2 systemd kind (cgroup root /kubelet)": (
        "0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
        f"kubelet-kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
        Owner(UID, CID, "containerd"),
    ),
    "v2 seen from another container's cgroup namespace": (
        f"0::/../../kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
        Owner(UID, CID, "containerd"),
    ),
    "v2 cgroupfs guaranteed": (f"0::/kubepods/pod{UID}/{CID}\n", Owner(UID, CID, "")),
    "v2 cgroupfs CRI-O": (f"0::/kubepods/besteffort/pod{UID}/crio-{CID}\n", Owner(UID, CID, "cri-o")),
    # defect 8: cgroupfs, private cgroup namespace, reader and workload in different QoS classes
    "v2 cgroupfs seen from another QoS class": (
        f"0::/../../burstable/pod{UID}/{CID}\n",
        Owner(UID, CID, ""),
    ),
    "v2 cgroupfs CRI-O seen from another QoS class": (
        f"0::/../../besteffort/pod{UID}/crio-{CID}\n",
        Owner(UID, CID, "cri-o"),
    ),
    "v1 systemd containerd (all hierarchies)": (V1_SYSTEMD_CONTAINERD, Owner(UID, CID, "containerd")),
    "v1 cgroupfs (containerd or dockershim)": (V1_CGROUPFS, Owner(UID, CID, "")),
    "v2 pod cgroup, no container": (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice\n",
        Owner(UID, "", ""),
    ),
    "v1 docker outside Kubernetes": (
        f"12:memory:/docker/{CID}\n1:name=systemd:/docker/{CID}\n",
        Owner("", CID, "docker"),
    ),
    "v2 docker outside Kubernetes": (f"0::/system.slice/docker-{CID}.scope\n", Owner("", CID, "docker")),
}

UNKNOWN = {
    "host process": "0::/user.slice/user-1000.slice/session-3.scope\n",
    "root": "0::/\n",
    "a service": "0::/system.slice/containerd.service\n",
    "empty file": "",
    "garbage": "not a cgroup file",
    "pod slice with a bad uid": (
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podnotauid.slice/"
        f"cri-containerd-{CID}.scope\n"
    ),
    "conmon, not a container": f"0::/kubepods.slice/kubepods-pod{UID_}.slice/crio-conmon-{CID}.scope\n",
    "short container id": f"0::/kubepods/burstable/pod{UID}/{CID[:12]}\n",
    "deeper than the kubelet makes": f"0::/kubepods/burstable/pod{UID}/{CID}/nested\n",
    "unknown runtime scope": f"0::/kubepods.slice/kubepods-pod{UID_}.slice/garden-{CID}.scope\n",
    "v1 lines naming two different pods": (
        f"11:memory:/kubepods/burstable/pod{UID}/{CID}\n"
        f"10:devices:/kubepods/burstable/pod{UID[:-1]}9/{CID2}\n"
    ),
    "podman outside Kubernetes": f"0::/machine.slice/libpod-{CID}.scope\n",
}


@pytest.mark.parametrize("case", list(CASES))
def test_owner_from_each_runtime_and_cgroup_version(case: str) -> None:
    text, owner = CASES[case]
    assert parse_cgroup(text) == owner


@pytest.mark.parametrize("case", list(UNKNOWN))
def test_unknown_formats_give_no_owner(case: str) -> None:
    assert parse_cgroup(UNKNOWN[case]) is None


def kubelet_logs(root: Path, namespace: str, pod: str, uid: str, container: str, cid: str) -> None:
    (root / "pods" / f"{namespace}_{pod}_{uid}" / container).mkdir(parents=True)
    (root / "containers").mkdir(exist_ok=True)
    (root / "containers" / f"{pod}_{namespace}_{container}-{cid}.log").symlink_to(
        root / "pods" / f"{namespace}_{pod}_{uid}" / container / "0.log"
    )


def test_names_come_from_the_kubelet_log_folders(tmp_path: Path) -> None:
    kubelet_logs(tmp_path, "serving", "llm-7d9f-x2k4", UID, "triton", CID)
    names = read_names(tmp_path)
    assert names.pods == {UID: ("serving", "llm-7d9f-x2k4")}
    assert names.containers == {CID: ("serving", "llm-7d9f-x2k4", "triton")}
    assert label_owner(Owner(UID, CID, "containerd"), names) == (
        "llm-7d9f-x2k4",
        "serving",
        "triton",
        UID,
        CID,
    )
    # a container id the logs do not know: the pod is named, the container only by id
    assert label_owner(Owner(UID, CID2, "containerd"), names) == ("llm-7d9f-x2k4", "serving", "", UID, CID2)
    # unknown pod: ids only, never a guessed name
    other = "00000000-0000-4000-8000-000000000000"
    assert label_owner(Owner(other, CID, ""), names) == ("", "", "", other, CID)
    assert label_owner(None, names) == ("", "", "", "", "")
    assert read_names(tmp_path / "missing") == Names({}, {})
    assert read_names(None) == Names({}, {})


def test_a_container_link_naming_another_pod_gives_no_container_name() -> None:
    names = Names({UID: ("serving", "llm-0")}, {CID: ("serving", "llm-1", "triton")})
    assert label_owner(Owner(UID, CID, "containerd"), names) == ("llm-0", "serving", "", UID, CID)


def test_attribution_sums_by_owner_and_keeps_unknown_processes() -> None:
    cgroups = {
        101: CASES["v2 systemd containerd burstable"][0],
        102: CASES["v2 systemd containerd burstable"][0],  # a second process of the same container
        103: UNKNOWN["host process"],
        # 104 ended before its cgroup was read
    }
    per_gpu = [
        (0, [GpuProcess(101, 1000), GpuProcess(102, 500), GpuProcess(103, 7), GpuProcess(104, 3)]),
        (1, [GpuProcess(101, 42)]),
    ]
    usage = attribute(per_gpu, cgroups.get, Names({UID: ("serving", "llm-0")}, {}))
    assert [(u.gpu, u.pod, u.pod_uid, u.container_id, u.used_bytes) for u in usage] == [
        (0, "", "", "", 10),
        (0, "llm-0", UID, CID, 1500),
        (1, "llm-0", UID, CID, 42),
    ]


class GpuWithProcesses(SimulatedBackend):
    def processes(self, index: int) -> list[GpuProcess]:
        return {0: [GpuProcess(4242, 30 * 2**30), GpuProcess(4343, 2**30)], 1: [GpuProcess(4444, 5)]}[index]


def test_per_pod_memory_is_served_from_the_background_refresh(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    for pid, text in {
        4242: CASES["v2 systemd containerd burstable"][0],
        4343: CASES["v1 cgroupfs (containerd or dockershim)"][0],  # same container, other format
        4444: UNKNOWN["host process"],
    }.items():
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(text)
    logs = tmp_path / "log"
    kubelet_logs(logs, "serving", "llm-0", UID, "triton", CID)
    source = GpuSource(
        [lambda: GpuWithProcesses(gpus=2)],
        label="simulated",
        hostname="node-a",
        proc_root=proc,
        log_root=logs,
        process_interval_s=0.05,
    )
    with serve_in_thread(source, load_fields()) as exp:
        deadline = time.monotonic() + 10
        while (
            c.GPU_PROCESS_MEMORY.name not in (fams := exp.scrape())
            or not fams[c.GPU_PROCESS_MEMORY.name].samples
        ):
            assert time.monotonic() < deadline, "per-process memory never appeared"
            time.sleep(0.05)
    got = {
        (
            s.labels["gpu"],
            s.labels["pod"],
            s.labels["namespace"],
            s.labels["container"],
            s.labels["pod_uid"],
        ): s.value
        for s in fams[c.GPU_PROCESS_MEMORY.name].samples
    }
    assert got == {
        ("0", "llm-0", "serving", "triton", UID): 31 * 2**30,
        ("1", "", "", "", ""): 5,
    }
    for s in fams[c.GPU_PROCESS_MEMORY.name].samples:
        assert set(s.labels) == set(c.GPU_PROCESS_MEMORY.labels)
        assert s.labels["Hostname"] == "node-a"
