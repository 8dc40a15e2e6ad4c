"""The GPU collector (a prometheus_client custom collector) and the source that owns the backend.

``GpuSource`` starts the backend (NVML, simulated, or NVML with a simulated fallback where the
host has no NVIDIA driver at all), watches it, and brings it back: a GPU that could not be
opened, whose reads all fail, or that reported Xid 79 gets the backend re-initialized (with
backoff), and a driver that went away (every GPU failing) gets NVML shut down and started again
until it answers. It also runs the background readers: XID events, per-process memory and the
kubelet's pod-resources. ``GpuCollector`` reads every GPU on each scrape, each call inside its
own guard, and never waits past its deadline for a GPU that hangs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from exporters.cgroups import ProcessAttributor, host_pid_namespace
from exporters.convert import GpuRow, gpu_families, gpu_labels, health_families
from exporters.fields import Field
from exporters.model import Backend, DeviceFailure, DeviceInfo, GpuProcess, RawGpu
from exporters.podresources import Allocation, PodResourcesWatcher, owners_by_gpu
from exporters.state import NO_GPU, ErrorCounter, XidLog
from exporters.workers import DONE, STALLED, PerGpuCalls
from inferwatch import contract as c

log = logging.getLogger("inferwatch.gpu_exporter")
T = TypeVar("T")

# Backend error "calls" that are not NVML functions.
CALL_READ = "read"  # the backend's read raised outside any single call
CALL_TIMEOUT = "timeout"  # a GPU's reads did not finish by the scrape deadline
CALL_STALLED = "stalled"  # a GPU's previous reads are still hung; not read again until they return
CALL_INIT = "nvmlInit"
CALL_POD_RESOURCES = "podresources.List"  # the kubelet's pod-resources API
XID_GPU_LOST = 79  # "GPU has fallen off the bus": the GPU needs the backend re-initialized
# Failed reads in a row before a GPU counts as down for recovery: one slow scrape is no reason
# to restart NVML (its gauge, inferwatch_gpu_up, still says 0 at once).
DOWN_AFTER_FAILED_READS = 2
UNSUPPORTED_RECHECK_S = 300.0  # an unsupported call is asked again after this long


class Guard:
    """The guard of one GPU: unsupported calls are skipped for a while, failures counted.

    "Not supported" is not forever: a call can answer NOT_SUPPORTED while the GPU is in a
    transient state (a reset, a MIG mode change, a power state) and answer again later, so it
    is asked again after ``recheck_s``."""

    __slots__ = ("clock", "errors", "gpu", "not_supported", "recheck_s", "unsupported")

    def __init__(
        self,
        gpu: int,
        errors: ErrorCounter,
        not_supported: tuple[type[BaseException], ...],
        recheck_s: float = UNSUPPORTED_RECHECK_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.gpu = str(gpu)
        self.errors = errors
        self.not_supported = not_supported
        self.recheck_s = recheck_s
        self.clock = clock
        self.unsupported: dict[str, float] = {}  # call -> when to ask again

    def __call__(self, call: str, fn: Callable[[], T]) -> T | None:
        again_at = self.unsupported.get(call)
        if again_at is not None and self.clock() < again_at:
            return None
        try:
            value = fn()
        except self.not_supported:
            if again_at is None:
                log.info(
                    "call not supported by this GPU; its series is left out",
                    extra={"fields": {"call": call, "gpu": self.gpu, "ask_again_s": self.recheck_s}},
                )
            self.unsupported[call] = self.clock() + self.recheck_s
            return None
        except Exception as exc:
            self.errors.add(call, self.gpu, exc)
            return None
        if again_at is not None:
            del self.unsupported[call]
            log.info("call supported again", extra={"fields": {"call": call, "gpu": self.gpu}})
        return value


def _has_values(raw: RawGpu | None) -> bool:
    return raw is not None and any(getattr(raw, f.name) is not None for f in fields(raw))


@dataclass(frozen=True, slots=True)
class Ready:
    """A started backend and what the scrape needs of it, swapped in as one object."""

    backend: Backend
    make: Callable[[], Backend]
    devices: tuple[DeviceInfo, ...]
    guards: dict[int, Guard]
    labels: dict[int, dict[str, str]]
    failed: tuple[DeviceFailure, ...] = ()
    fallback: bool = False  # the simulated stand-in of auto mode, replaced once NVML starts
    stop: threading.Event = field(default_factory=threading.Event)  # ends this backend's threads


def _host_has_nvidia_driver() -> bool:
    # /proc/driver/nvidia is the kernel module's, visible in containers too; /dev/nvidiactl its device.
    return any(Path(p).exists() for p in ("/proc/driver/nvidia/version", "/dev/nvidiactl"))


def nvml_absent(exc: BaseException, driver_present: Callable[[], bool] = _host_has_nvidia_driver) -> bool:
    """True only when NVML failed because there is no NVIDIA library and no NVIDIA driver on
    this host: then (and only then) auto mode may serve simulated GPUs. Any other failure on a
    host with a driver is a real failure, reported as such."""
    missing = isinstance(exc, ImportError | OSError) or type(exc).__name__ == "NVMLError_LibraryNotFound"
    return missing and not driver_present()


class GpuSource:
    """Owns the backend's life. ``candidates[0]`` is the backend wanted; ``candidates[1]``, if
    given, stands in when ``fall_back(error)`` says the first cannot exist on this host. With
    ``retry`` a backend that did not start is retried with backoff until it does (also while
    the stand-in serves, so a driver library mounted late is picked up)."""

    def __init__(
        self,
        candidates: Sequence[Callable[[], Backend]],
        label: str,
        hostname: str,
        *,
        retry: bool = False,
        retry_initial_s: float = 1.0,
        retry_max_s: float = 60.0,
        recheck_s: float = 30.0,
        fall_back: Callable[[BaseException], bool] = lambda exc: True,
        unsupported_recheck_s: float = UNSUPPORTED_RECHECK_S,
        proc_root: Path = Path("/proc"),
        log_root: Path | None = None,
        process_interval_s: float = 10.0,
        process_timeout_s: float = 5.0,
        pod_resources_socket: str = "",
        pid_namespace: Callable[[], bool | None] = host_pid_namespace,
        errors: ErrorCounter | None = None,
        xids: XidLog | None = None,
    ) -> None:
        if not candidates:
            raise ValueError("no backend to start")
        self._primary = candidates[0]
        self._fallback = candidates[1] if len(candidates) > 1 else None
        self._fall_back = fall_back
        self.label = label  # the backend label until a backend starts
        self.hostname = hostname
        self.errors = errors or ErrorCounter()
        self.xids = xids or XidLog()
        self.ready: Ready | None = None
        self.last_error = ""
        self._last_exc: BaseException | None = None  # why the last start failed
        self._retry = retry
        self._was_up = False
        self._retry_initial = retry_initial_s
        self._retry_max = retry_max_s
        self._recheck = recheck_s
        self._unsupported_recheck = unsupported_recheck_s
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._swap = threading.Lock()
        # last read outcome per GPU of the current backend (True: values came back), and how
        # many reads in a row failed
        self._gpu_ok: dict[int, bool] = {}
        self._failed_reads: dict[int, int] = {}
        self._lost: set[int] = set()  # GPUs that reported Xid 79 since the backend started
        self.processes = ProcessAttributor(
            self._list_processes,
            self._gpu_indexes,
            proc_root,
            log_root,
            process_interval_s,
            timeout_s=process_timeout_s,
            errors=self.errors,
        )
        # dcgm series labels per GPU index: the GPU's labels, plus the driver version, plus its
        # container's when the kubelet allocated it to exactly one (replaced whole, never edited)
        self.dcgm_labels: dict[int, dict[str, str]] = {}
        self._allocations: list[Allocation] = []
        self._pod_socket = pod_resources_socket
        self._pod_interval = process_interval_s
        self._pods: PodResourcesWatcher | None = None
        self._pid_namespace = pid_namespace
        self.host_pid: bool | None = None

    # -- start and stop -------------------------------------------------------------------
    def start(self) -> None:
        self.host_pid = self._pid_namespace()
        if not self._try_start(self._primary) and self._fallback is not None:
            cause = self._last_exc
            if cause is not None and self._fall_back(cause):
                log.warning(
                    "NVML unavailable and no NVIDIA driver on this host; serving simulated GPUs",
                    extra={"fields": {"error": self.last_error}},
                )
                self._try_start(self._fallback, fallback=True)
            else:
                log.error(
                    "NVML did not start on a host with an NVIDIA driver; reporting the error, "
                    "not simulated values",
                    extra={"fields": {"error": self.last_error}},
                )
        self.processes.start()
        if PodResourcesWatcher.available(self._pod_socket):
            self._pods = PodResourcesWatcher(
                self._pod_socket,
                self._pod_interval,
                self._set_allocations,
                lambda exc: self.errors.add(CALL_POD_RESOURCES, NO_GPU, exc),
            )
            self._pods.start()
        self._spawn(self._supervise, "gpu-backend-supervisor")

    def _try_start(self, make: Callable[[], Backend], fallback: bool = False) -> bool:
        try:
            backend = make()
            devices = backend.init()
        except Exception as exc:
            self._init_failed(exc)
            return False
        self._activate(backend, make, devices, fallback)
        return True

    def _init_failed(self, exc: BaseException) -> None:
        self._last_exc = exc
        self.last_error = f"{type(exc).__name__}: {exc}"
        self.errors.add(CALL_INIT, NO_GPU, exc)

    def _activate(
        self, backend: Backend, make: Callable[[], Backend], devices: Sequence[DeviceInfo], fallback: bool
    ) -> None:
        failed = tuple(getattr(backend, "failed", ()))
        for f in failed:
            self.errors.add(f.call, str(f.index), f.error)
        recheck = self._unsupported_recheck
        guards = {d.index: Guard(d.index, self.errors, backend.not_supported, recheck) for d in devices}
        labels = {d.index: gpu_labels(d, self.hostname) for d in devices}
        ready = Ready(backend, make, tuple(devices), guards, labels, failed, fallback)
        with self._swap:
            old = self.ready
            self._gpu_ok, self._failed_reads = {}, {}
            self._lost = set()
            self.ready = ready
            self.dcgm_labels = self._dcgm_labels(ready, self._allocations)
        if old is not None:
            self._retire(old)
        self.label = backend.name
        self.last_error = (
            ""
            if devices
            else "no GPU could be opened: " + "; ".join(f"GPU {f.index}: {f.call}: {f.error}" for f in failed)
        )
        if devices:
            self._was_up = True
        info = {
            "backend": backend.name,
            "gpus": len(devices),
            "failed": [f.index for f in failed],
            "models": sorted({d.name for d in devices}),
            "driver": getattr(backend, "driver_version", ""),
        }
        if backend.name == "simulated":
            log.warning("GPU metrics are SIMULATED, not read from a GPU", extra={"fields": info})
        else:
            log.info("backend started", extra={"fields": info})
            if self.host_pid is False:
                log.warning(
                    "not in the host's PID namespace: NVML lists no GPU processes from here, so "
                    "per-pod GPU memory stays empty; run the exporter with hostPID: true",
                    extra={"fields": {"metric": c.GPU_HOST_PID_NAMESPACE.name}},
                )
        watch = getattr(backend, "watch_xids", None)
        if watch is not None:
            self._spawn(lambda: self._watch_xids(watch, ready.stop), "gpu-xid-events")

    def _retire(self, old: Ready) -> None:
        old.stop.set()
        old.backend.shutdown()

    def _dcgm_labels(self, ready: Ready, allocations: Sequence[Allocation]) -> dict[int, dict[str, str]]:
        driver = getattr(ready.backend, "driver_version", "")
        owners = owners_by_gpu(allocations, ready.devices)
        out: dict[int, dict[str, str]] = {}
        for d in ready.devices:
            labels = dict(ready.labels[d.index])
            found = owners.get(d.index, [])
            if len(found) == 1:  # shared GPUs get no pod labels: one value cannot carry several owners
                namespace, pod, container = found[0]
                labels.update({c.L_POD: pod, c.L_NAMESPACE: namespace, c.L_CONTAINER: container})
            if driver:
                labels[c.L_DRIVER_VERSION] = driver
            out[d.index] = labels
        return out

    def _set_allocations(self, allocations: list[Allocation]) -> None:
        with self._swap:
            self._allocations = allocations
            if self.ready is not None:
                self.dcgm_labels = self._dcgm_labels(self.ready, allocations)

    def _watch_xids(self, watch: Callable[..., None], stop: threading.Event) -> None:
        try:
            watch(stop, self._on_xid, lambda call: self.errors.add(call, NO_GPU))
        except Exception as exc:
            self.errors.add("nvmlEventSetCreate", NO_GPU, exc)

    def _on_xid(self, gpu: int, xid: int) -> None:
        self.xids.record(gpu, xid)
        if xid == XID_GPU_LOST:
            self._lost.add(gpu)

    # -- health and recovery --------------------------------------------------------------
    def note_reads(self, ready: Ready, ok: dict[int, bool], hung: frozenset[int] = frozenset()) -> None:
        """The collector's last read outcome per GPU (ignored if the backend changed since).

        A read still hung in the driver makes its GPU not up, but does not count towards
        re-initializing: shutting NVML down under a thread blocked inside it is not safe, and a
        new instance would not unblock the call anyway."""
        with self._swap:
            if self.ready is ready:
                self._gpu_ok.update(ok)
                for i, good in ok.items():
                    if i not in hung:
                        self._failed_reads[i] = 0 if good else self._failed_reads.get(i, 0) + 1

    def gpu_up(self, index: int) -> bool:
        return self._gpu_ok.get(index, True) and index not in self._lost

    def down_gpus(self, ready: Ready | None = None) -> list[int]:
        """GPUs of the current backend that are down: not opened at start, reads that returned
        nothing on the last scrapes, or Xid 79."""
        ready = ready or self.ready
        if ready is None:
            return []
        down = {f.index for f in ready.failed} | set(self._lost)
        down |= {i for i, n in self._failed_reads.items() if n >= DOWN_AFTER_FAILED_READS}
        return sorted(down)

    def up(self) -> bool:
        """The backend tells the truth about the GPUs: started, and at least one GPU answers."""
        ready = self.ready
        if ready is None or not ready.devices:
            return False
        return any(self.gpu_up(d.index) for d in ready.devices)

    def _supervise(self) -> None:
        backoff = self._retry_initial
        delay = self._retry_initial if self.ready is None or self.ready.fallback else self._recheck
        while not self._stop.wait(delay):
            ready = self.ready
            if ready is None or ready.fallback or not ready.devices:
                if not (self._retry or self._was_up):
                    delay = self._recheck
                    continue
                if ready is not None and not ready.fallback:
                    self._reinit(ready, full=True)
                elif self._try_start(self._primary):
                    backoff, delay = self._retry_initial, self._recheck
                    continue
                else:
                    retry_in = min(backoff * 2, self._retry_max)
                    log.info(
                        "backend still down; retrying",
                        extra={"fields": {"error": self.last_error, "retry_in_s": retry_in}},
                    )
                backoff = min(backoff * 2, self._retry_max)
                delay = backoff
                continue
            down = self.down_gpus(ready)
            if not down:
                backoff, delay = self._retry_initial, self._recheck
                continue
            every = len(down) >= len(ready.devices) + len(ready.failed)
            log.warning(
                "GPUs down; re-initializing the backend",
                extra={"fields": {"gpus": down, "full": every}},
            )
            self._reinit(ready, full=every)
            delay = backoff
            backoff = min(backoff * 2, self._retry_max)

    def _reinit(self, ready: Ready, full: bool) -> None:
        """Starts the backend again. ``full`` (every GPU down: a driver reload looks like this)
        shuts NVML down first, since nvmlInit on a library still initialized only counts a
        reference and keeps the stale state; otherwise the new instance starts while the old
        one still serves the healthy GPUs, and replaces it."""
        if full:
            with self._swap:
                if self.ready is ready:
                    self.ready = None
                    self.dcgm_labels = {}
            self._retire(ready)
        self._try_start(ready.make, fallback=ready.fallback)

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        # each re-initialization starts an event reader: forget the ones that ended
        self._threads = [x for x in self._threads if x.is_alive()]
        self._threads.append(t)
        t.start()

    def stop(self) -> None:
        self._stop.set()
        ready = self.ready
        if ready is not None:
            ready.stop.set()
        self.processes.stop()
        if self._pods is not None:
            self._pods.stop()
        for t in self._threads:
            t.join(timeout=5)
        if ready is not None:
            ready.backend.shutdown()

    def health(self) -> dict[str, Any]:
        ready = self.ready
        return {
            "status": "ok",  # the process serves; a down backend is reported, not fatal
            "backend": self.label,
            "backend_up": self.up(),
            "gpus": len(ready.devices) if ready else 0,
            # as inferwatch_gpu_up says: not opened, Xid 79, or the last read failed
            "gpus_down": sorted(
                [f.index for f in ready.failed] + [d.index for d in ready.devices if not self.gpu_up(d.index)]
            )
            if ready
            else [],
            "driver_version": getattr(ready.backend, "driver_version", "") if ready else "",
            # False: NVML lists no processes from this PID namespace (needs hostPID: true)
            "host_pid_namespace": self.host_pid,
            "error": self.last_error or None,
        }

    # -- reads ----------------------------------------------------------------------------
    def _gpu_indexes(self) -> tuple[object, list[int]]:
        ready = self.ready
        return ready, ([d.index for d in ready.devices] if ready else [])

    def _list_processes(self, index: int) -> Sequence[GpuProcess] | None:
        ready = self.ready
        if ready is None or index not in ready.guards:
            return None
        call = "nvmlDeviceGetComputeRunningProcesses"
        return ready.guards[index](call, lambda: ready.backend.processes(index))


class GpuCollector(Collector):
    """Builds fresh metric families on every scrape from ``source``.

    ``describe`` lists the families without touching the backend, so registering is free."""

    def __init__(
        self,
        source: GpuSource,
        fields: Sequence[Field],
        registry: CollectorRegistry | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self.source = source
        self.fields = tuple(fields)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._calls: PerGpuCalls | None = None
        self._calls_for: Ready | None = None
        self._hung: frozenset[int] = frozenset()  # GPUs whose last read timed out or stalled
        if registry is not None:
            registry.register(self)

    def describe(self) -> Iterator[Metric]:
        for f in self.fields:
            yield Metric(f.metric.name, f.help, f.metric.type)
        for m in c.GPU_EXPORTER_METRICS:
            yield Metric(m.name, m.help, m.type)

    def collect(self) -> Iterator[Metric]:
        start = time.perf_counter()
        source = self.source
        ready = source.ready
        families: list[Metric] = []
        if ready is not None:
            if self._lock.acquire(timeout=self.timeout_s):
                try:
                    raws = self._read_all(ready)
                    hung = self._hung
                finally:
                    self._lock.release()
            else:  # another scrape holds the GPUs past its own deadline: not the GPUs' failure
                source.errors.add("concurrent_scrape", NO_GPU)
                raws = {d.index: None for d in ready.devices}
                hung = frozenset(raws)
            source.note_reads(ready, {i: _has_values(raw) for i, raw in raws.items()}, hung)
            dcgm_labels = source.dcgm_labels
            rows = [
                GpuRow(d.index, ready.labels[d.index], raws[d.index], dcgm_labels.get(d.index))
                for d in ready.devices
            ]
            xid_counts, last_xid = source.xids.snapshot()
            families = gpu_families(self.fields, rows, xid_counts, last_xid, source.processes.snapshot)
            families.append(self._gpu_up(ready))
            families.append(self._scan_age(ready))
        health = health_families(
            source.label,
            source.hostname,
            source.up(),
            source.errors.snapshot(),
            time.perf_counter() - start,
            source.host_pid,
        )
        yield from families
        yield from health

    def _gpu_up(self, ready: Ready) -> Metric:
        fam = Metric(c.GPU_UP.name, c.GPU_UP.help, c.GPU_UP.type)
        for d in ready.devices:
            fam.add_sample(c.GPU_UP.name, ready.labels[d.index], 1 if self.source.gpu_up(d.index) else 0)
        for f in ready.failed:  # counted by NVML but never opened: no UUID to give
            lost = DeviceInfo(f.index, "", "", -1)
            fam.add_sample(c.GPU_UP.name, gpu_labels(lost, self.source.hostname), 0)
        return fam

    def _scan_age(self, ready: Ready) -> Metric:
        m = c.GPU_PROCESS_SCAN_AGE
        fam = Metric(m.name, m.help, m.type)
        ages = self.source.processes.ages()
        for d in ready.devices:
            if d.index in ages:
                fam.add_sample(m.name, ready.labels[d.index], round(ages[d.index], 3))
        return fam

    # -- one read per GPU, each bounded --------------------------------------------------
    def _read_one(self, ready: Ready, index: int) -> RawGpu | None:
        try:
            return ready.backend.read(index, ready.guards[index])
        except Exception as exc:
            self.source.errors.add(CALL_READ, str(index), exc)
            return None

    def _read_all(self, ready: Ready) -> dict[int, RawGpu | None]:
        if not ready.backend.may_block:
            self._hung = frozenset()
            return {d.index: self._read_one(ready, d.index) for d in ready.devices}
        if self._calls_for is not ready:
            # One worker per GPU, at most one read in flight on it: a hung GPU holds only its own.
            if self._calls is not None:
                self._calls.close()
            self._calls = PerGpuCalls("gpu-read")
            self._calls_for = ready
        assert self._calls is not None
        results = self._calls.run(
            {d.index: (lambda i=d.index: self._read_one(ready, i)) for d in ready.devices}, self.timeout_s
        )
        out: dict[int, RawGpu | None] = {}
        hung = set()
        for index, (outcome, raw) in results.items():
            if outcome != DONE:
                hung.add(index)
                self.source.errors.add(CALL_STALLED if outcome == STALLED else CALL_TIMEOUT, str(index))
            out[index] = raw
        self._hung = frozenset(hung)
        return out
