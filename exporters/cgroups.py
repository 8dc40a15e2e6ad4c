"""Who owns a GPU process: pod UID and container id from ``/proc/<pid>/cgroup``; names from kubelet log links.

``parse_cgroup`` understands the paths the kubelet creates under cgroup v1 and v2, with the
systemd cgroup driver (``kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice/
cri-containerd-<id>.scope``, ``crio-<id>.scope``, ``docker-<id>.scope``) and the cgroupfs driver
(``/kubepods/burstable/pod<uid>/<id>``), plus plain Docker containers. Anything else, or lines
that disagree, gives None: an unknown format yields no owner rather than a wrong one.

Names come from the files the kubelet writes for log collectors, which need no API access:
``/var/log/pods/<namespace>_<pod>_<uid>/`` (pod UID -> namespace and pod) and
``/var/log/containers/<pod>_<namespace>_<container>-<container id>.log`` (container id ->
container). A name is given only when both agree; otherwise only the UID and id are.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from exporters.convert import ProcessUsage
from exporters.model import GpuProcess
from exporters.state import ErrorCounter
from exporters.workers import DONE, PerGpuCalls

log = logging.getLogger("inferwatch.gpu_exporter")

_UID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_UID_SYSTEMD = r"[0-9a-f]{8}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{12}"
_CID = r"[0-9a-f]{64}"
# systemd driver: [kubelet-]kubepods[-<qos>]-pod<uid with _>.slice under kubepods slices
# (the kubelet.slice/kubelet-kubepods.slice form comes from --cgroup-root=/kubelet, as in kind)
_KUBE_SLICE = re.compile(r"kubelet\.slice|(?:kubelet-)?kubepods(?:-besteffort|-burstable)?\.slice")
_POD_SLICE = re.compile(rf"(?:kubelet-)?kubepods(?:-besteffort|-burstable)?-pod({_UID_SYSTEMD})\.slice")
_SCOPE = re.compile(rf"(cri-containerd|crio|docker)-({_CID})\.scope")
# cgroupfs driver: pod<uid> then the container id, optionally with the runtime's prefix
_POD_DIR = re.compile(rf"pod({_UID})")
_CONTAINER_DIR = re.compile(rf"(?:(cri-containerd|crio|docker)-)?({_CID})")
_RUNTIMES = {"cri-containerd": "containerd", "crio": "cri-o", "docker": "docker"}
_QOS = ("besteffort", "burstable")  # guaranteed pods sit directly under kubepods
# The inode of the initial PID namespace, fixed by the kernel (PROC_PID_INIT_INO, since 3.8).
INIT_PID_NS = "pid:[4026531836]"


@dataclass(frozen=True, slots=True)
class Owner:
    pod_uid: str  # "" for a container outside Kubernetes
    container_id: str  # "" for a process in a pod's cgroup but no container's
    runtime: str  # "containerd", "cri-o", "docker", or "" when the path does not say


def _parse_path(path: str) -> Owner | None:
    parts = [p for p in path.split("/") if p]
    # A reader in its own cgroup namespace sees other containers' paths relative to its root.
    relative = False
    while parts and parts[0] == "..":
        parts.pop(0)
        relative = True
    if not parts:
        return None
    if _KUBE_SLICE.fullmatch(parts[0]) or _POD_SLICE.fullmatch(parts[0]):  # systemd driver
        for i, p in enumerate(parts):  # noqa: B007 (i is used after the loop)
            m = _POD_SLICE.fullmatch(p)
            if m:
                break
            if not _KUBE_SLICE.fullmatch(p):
                return None
        else:
            return None
        uid = m.group(1).replace("_", "-")
        rest = parts[i + 1 :]
        if not rest:
            return Owner(uid, "", "")
        sm = _SCOPE.fullmatch(rest[0]) if len(rest) == 1 else None
        return Owner(uid, sm.group(2), _RUNTIMES[sm.group(1)]) if sm else None
    # cgroupfs driver. Seen from a private cgroup namespace the path starts below kubepods: at
    # the pod (same QoS class as the reader) or at the QoS folder (another class), e.g.
    # 0::/../../burstable/pod<uid>/<id> from a besteffort exporter.
    if parts[0] == "kubepods" or (relative and (_POD_DIR.fullmatch(parts[0]) or parts[0] in _QOS)):
        rest = parts[1:] if parts[0] == "kubepods" else parts
        if rest and rest[0] in _QOS:
            rest = rest[1:]
        if not rest or len(rest) > 2:
            return None
        m = _POD_DIR.fullmatch(rest[0])
        if not m:
            return None
        if len(rest) == 1:
            return Owner(m.group(1), "", "")
        cm = _CONTAINER_DIR.fullmatch(rest[1])
        if not cm:
            return None
        return Owner(m.group(1), cm.group(2), _RUNTIMES.get(cm.group(1) or "", ""))
    # Docker outside Kubernetes: /docker/<id> (cgroupfs) or /system.slice/docker-<id>.scope (systemd)
    if len(parts) == 2 and parts[0] == "docker" and re.fullmatch(_CID, parts[1]):
        return Owner("", parts[1], "docker")
    if len(parts) == 2 and parts[0] == "system.slice":
        m = _SCOPE.fullmatch(parts[1])
        if m and m.group(1) == "docker":
            return Owner("", m.group(2), "docker")
    return None


def parse_cgroup(text: str) -> Owner | None:
    """The owner named by the contents of a ``/proc/<pid>/cgroup`` file, or None.

    cgroup v2 has one line ``0::<path>``; v1 has one line per hierarchy. Lines whose path
    names no owner (``/``, ``/user.slice``) are ignored; if two lines name different owners
    the answer is None.
    """
    found: Owner | None = None
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        owner = _parse_path(fields[2].strip())
        if owner is None:
            continue
        if found is not None and owner != found:
            # The same container seen with and without the runtime's prefix is the same owner.
            if (owner.pod_uid, owner.container_id) != (found.pod_uid, found.container_id):
                return None
            found = found if found.runtime else owner
            continue
        found = owner
    return found


@dataclass(frozen=True, slots=True)
class Names:
    """Pod UID -> (namespace, pod), container id -> (namespace, pod, container)."""

    pods: dict[str, tuple[str, str]]
    containers: dict[str, tuple[str, str, str]]


_POD_LOG_DIR = re.compile(rf"([a-z0-9][a-z0-9-]*)_([a-z0-9][a-z0-9.-]*)_({_UID})")
_CONTAINER_LOG = re.compile(rf"([a-z0-9][a-z0-9.-]*)_([a-z0-9][a-z0-9-]*)_([a-z0-9][a-z0-9-]*)-({_CID})\.log")


def read_names(log_root: Path | None) -> Names:
    """Names from the kubelet's ``pods/`` and ``containers/`` folders under ``log_root``
    (``/var/log`` on a node); empty where a folder is missing."""
    pods: dict[str, tuple[str, str]] = {}
    containers: dict[str, tuple[str, str, str]] = {}
    if log_root is None:
        return Names(pods, containers)
    try:
        for entry in os.listdir(log_root / "pods"):
            m = _POD_LOG_DIR.fullmatch(entry)
            if m:
                pods[m.group(3)] = (m.group(1), m.group(2))
    except OSError:
        pass
    try:
        for entry in os.listdir(log_root / "containers"):
            m = _CONTAINER_LOG.fullmatch(entry)
            if m:
                containers[m.group(4)] = (m.group(2), m.group(1), m.group(3))
    except OSError:
        pass
    return Names(pods, containers)


def label_owner(owner: Owner | None, names: Names) -> tuple[str, str, str, str, str]:
    """(pod, namespace, container, pod_uid, container_id) for an owner; names only where the
    pod's log folder and the container's log link agree on them."""
    if owner is None:
        return ("", "", "", "", "")
    pod = namespace = container = ""
    if owner.pod_uid and owner.pod_uid in names.pods:
        namespace, pod = names.pods[owner.pod_uid]
        hit = names.containers.get(owner.container_id) if owner.container_id else None
        if hit is not None and (hit[0], hit[1]) == (namespace, pod):
            container = hit[2]
    return (pod, namespace, container, owner.pod_uid, owner.container_id)


def attribute(
    per_gpu: Sequence[tuple[int, Sequence[GpuProcess]]],
    read_cgroup: Callable[[int], str | None],
    names: Names,
) -> list[ProcessUsage]:
    """Sum each GPU's process memory by owner. Processes whose cgroup cannot be read or parsed
    are summed under empty owner labels."""
    owners: dict[int, Owner | None] = {}
    sums: dict[tuple[int, tuple[str, str, str, str, str]], int] = {}
    for gpu, procs in per_gpu:
        for p in procs:
            if p.pid not in owners:
                text = read_cgroup(p.pid)
                owners[p.pid] = parse_cgroup(text) if text is not None else None
            key = (gpu, label_owner(owners[p.pid], names))
            sums[key] = sums.get(key, 0) + p.used_bytes
    return [ProcessUsage(gpu, *labels, used) for (gpu, labels), used in sorted(sums.items())]


def proc_cgroup_reader(proc_root: Path) -> Callable[[int], str | None]:
    def read(pid: int) -> str | None:
        try:
            return (proc_root / str(pid) / "cgroup").read_text()
        except OSError:
            return None  # the process ended, or its /proc is not visible

    return read


def host_pid_namespace(proc: Path = Path("/proc")) -> bool | None:
    """Whether this process runs in the host's (initial) PID namespace; None if unknown.

    Current drivers give NVML's process list in the caller's PID namespace and leave out the
    processes it cannot see, so outside the host's namespace NVML lists none of the workload's
    processes, whatever /proc is mounted: per-pod memory then needs ``hostPID: true``."""
    try:
        return os.readlink(proc / "self" / "ns" / "pid") == INIT_PID_NS
    except OSError:
        return None


class ProcessAttributor:
    """Refreshes per-owner GPU memory in a background thread; the scrape reads the last result.

    ``list_processes(index)`` is the backend's process listing, already guarded by the caller
    (None when it failed). Each GPU is listed on its own worker with a deadline, so a call hung
    on one GPU neither stops the others nor the loop: it is counted (``processes.timeout``, then
    ``processes.stalled`` while still hung), that GPU's last listing is served for at most
    ``max_age`` and then dropped, and ``ages()`` says how old each GPU's listing is."""

    def __init__(
        self,
        list_processes: Callable[[int], Sequence[GpuProcess] | None],
        gpus: Callable[[], tuple[object, Sequence[int]]],
        proc_root: Path,
        log_root: Path | None,
        interval: float,
        *,
        timeout_s: float = 5.0,
        max_age_s: float | None = None,
        errors: ErrorCounter | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._list = list_processes
        self._gpus = gpus
        self._read = proc_cgroup_reader(proc_root)
        self._log_root = log_root
        self._interval = interval
        self._timeout = timeout_s
        self._max_age = max_age_s if max_age_s is not None else 3 * interval + timeout_s
        self._errors = errors or ErrorCounter()
        self._clock = clock
        self._snapshot: tuple[ProcessUsage, ...] = ()
        self._ages: dict[int, float] = {}
        self._last: dict[int, tuple[float, Sequence[GpuProcess]]] = {}  # GPU -> (when, listing)
        self._generation: object = None
        self._since = clock()
        self._calls = PerGpuCalls("gpu-processes")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def snapshot(self) -> tuple[ProcessUsage, ...]:
        return self._snapshot

    def ages(self) -> dict[int, float]:
        """Seconds since each GPU's processes were last listed (since start if never)."""
        return self._ages

    def _guarded_list(self, index: int) -> Sequence[GpuProcess] | None:
        try:
            return self._list(index)
        except Exception as exc:  # the listing is guarded upstream; this is a bug, counted
            self._errors.add("processes", str(index), exc)
            return None

    def refresh(self) -> None:
        generation, indexes = self._gpus()
        if generation is not self._generation:  # the backend was (re)started: new GPUs, new workers
            self._calls.close()
            self._calls = PerGpuCalls("gpu-processes")
            self._last, self._generation, self._since = {}, generation, self._clock()
        results = self._calls.run({i: (lambda i=i: self._guarded_list(i)) for i in indexes}, self._timeout)
        now = self._clock()
        for index, (outcome, procs) in results.items():
            if outcome == DONE:
                if procs is not None:
                    self._last[index] = (now, procs)
            else:
                self._errors.add(f"processes.{outcome}", str(index))
        fresh = sorted((i, when, procs) for i, (when, procs) in self._last.items() if procs)
        per_gpu = [(i, procs) for i, when, procs in fresh if now - when <= self._max_age]
        names = read_names(self._log_root) if per_gpu else Names({}, {})
        self._snapshot = tuple(attribute(per_gpu, self._read, names))
        self._ages = {i: now - self._last[i][0] if i in self._last else now - self._since for i in indexes}

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception:  # never let attribution take the exporter down
                log.exception("process attribution failed")
            self._stop.wait(self._interval)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpu-processes", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._calls.close()
