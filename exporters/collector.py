"""The GPU collector (a prometheus_client custom collector) and the source that owns the backend.

``GpuSource`` starts the backend (NVML, simulated, or NVML with a simulated fallback), retries a
failed NVML start with backoff, and runs the two background readers: XID events and per-process
memory attribution. ``GpuCollector`` reads every GPU on each scrape, each call inside its own
guard, and never waits past its deadline for a GPU that hangs.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from exporters.cgroups import ProcessAttributor
from exporters.convert import GpuRow, gpu_families, gpu_labels, health_families
from exporters.fields import Field
from exporters.model import Backend, DeviceInfo, GpuProcess, RawGpu
from exporters.podresources import PodResourcesWatcher
from exporters.state import NO_GPU, ErrorCounter, XidLog
from inferwatch import contract as c

log = logging.getLogger("inferwatch.gpu_exporter")
T = TypeVar("T")

# Backend error "calls" that are not NVML functions.
CALL_READ = "read"  # the backend's read raised outside any single call
CALL_TIMEOUT = "timeout"  # a GPU's reads did not finish by the scrape deadline
CALL_STALLED = "stalled"  # a GPU's previous reads are still hung; not read again until they return
CALL_INIT = "nvmlInit"
CALL_POD_RESOURCES = "podresources.List"  # the kubelet's pod-resources API


class Guard:
    """The guard of one GPU: unsupported calls are remembered and skipped, failures counted."""

    __slots__ = ("errors", "gpu", "not_supported", "unsupported")

    def __init__(
        self, gpu: int, errors: ErrorCounter, not_supported: tuple[type[BaseException], ...]
    ) -> None:
        self.gpu = str(gpu)
        self.errors = errors
        self.not_supported = not_supported
        self.unsupported: set[str] = set()

    def __call__(self, call: str, fn: Callable[[], T]) -> T | None:
        if call in self.unsupported:
            return None
        try:
            return fn()
        except self.not_supported:
            self.unsupported.add(call)
            log.info(
                "call not supported by this GPU; its series is left out",
                extra={"fields": {"call": call, "gpu": self.gpu}},
            )
            return None
        except Exception as exc:
            self.errors.add(call, self.gpu, exc)
            return None


@dataclass(frozen=True, slots=True)
class Ready:
    """A started backend and what the scrape needs of it, swapped in as one object."""

    backend: Backend
    devices: tuple[DeviceInfo, ...]
    guards: tuple[Guard, ...]
    labels: tuple[dict[str, str], ...] = field(default=())


class GpuSource:
    """Owns the backend's life. ``candidates`` are tried in order at start (auto: NVML, then
    simulated); with ``retry`` the first one is retried with backoff until it starts."""

    def __init__(
        self,
        candidates: Sequence[Callable[[], Backend]],
        label: str,
        hostname: str,
        *,
        retry: bool = False,
        retry_initial_s: float = 1.0,
        retry_max_s: float = 60.0,
        proc_root: Path = Path("/proc"),
        log_root: Path | None = None,
        process_interval_s: float = 10.0,
        pod_resources_socket: str = "",
        errors: ErrorCounter | None = None,
        xids: XidLog | None = None,
    ) -> None:
        self._candidates = list(candidates)
        self.label = label  # the backend label until a backend starts
        self.hostname = hostname
        self.errors = errors or ErrorCounter()
        self.xids = xids or XidLog()
        self.ready: Ready | None = None
        self.last_error = ""
        self._retry = retry
        self._retry_initial = retry_initial_s
        self._retry_max = retry_max_s
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.processes = ProcessAttributor(
            self._list_processes, self._gpu_indexes, proc_root, log_root, process_interval_s
        )
        # dcgm series labels per GPU: the GPU's labels, plus its container's when the kubelet
        # allocated it to exactly one (replaced whole by the pod-resources thread)
        self.dcgm_labels: tuple[dict[str, str], ...] = ()
        self._pod_socket = pod_resources_socket
        self._pod_interval = process_interval_s
        self._pods: PodResourcesWatcher | None = None

    # -- start and stop -------------------------------------------------------------------
    def start(self) -> None:
        for i, make in enumerate(self._candidates):
            try:
                backend = make()
                self._activate(backend, backend.init())
                return
            except Exception as exc:
                self._init_failed(exc)
                if i + 1 < len(self._candidates):
                    log.warning(
                        "backend did not start; trying the next one",
                        extra={"fields": {"error": self.last_error}},
                    )
        if self._retry:
            self._spawn(self._retry_loop, "gpu-backend-retry")

    def _init_failed(self, exc: BaseException) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}"
        self.errors.add(CALL_INIT, NO_GPU, exc)

    def _activate(self, backend: Backend, devices: Sequence[DeviceInfo]) -> None:
        guards = tuple(Guard(d.index, self.errors, backend.not_supported) for d in devices)
        labels = tuple(gpu_labels(d, self.hostname) for d in devices)
        self.label = backend.name
        self.dcgm_labels = labels
        self.ready = Ready(backend, tuple(devices), guards, labels)
        self.last_error = ""
        fields = {"backend": backend.name, "gpus": len(devices), "models": sorted({d.name for d in devices})}
        if backend.name == "simulated":
            log.warning("GPU metrics are SIMULATED, not read from a GPU", extra={"fields": fields})
        else:
            log.info("backend started", extra={"fields": fields})
        watch = getattr(backend, "watch_xids", None)
        if watch is not None:
            self._spawn(lambda: self._watch_xids(watch), "gpu-xid-events")
        self.processes.start()
        if PodResourcesWatcher.available(self._pod_socket):
            self._pods = PodResourcesWatcher(
                self._pod_socket,
                self._pod_interval,
                self._set_pod_owners,
                lambda exc: self.errors.add(CALL_POD_RESOURCES, NO_GPU, exc),
            )
            self._pods.start()

    def _set_pod_owners(self, owners: dict[str, tuple[str, str, str]]) -> None:
        ready = self.ready
        if ready is None:
            return
        labeled = []
        for dev, labels in zip(ready.devices, ready.labels, strict=True):
            owner = owners.get(dev.uuid)
            if owner is None:
                labeled.append(labels)
            else:
                namespace, pod, container = owner
                labeled.append({**labels, c.L_POD: pod, c.L_NAMESPACE: namespace, c.L_CONTAINER: container})
        self.dcgm_labels = tuple(labeled)

    def _watch_xids(self, watch: Callable[..., None]) -> None:
        try:
            watch(self._stop, self.xids.record, lambda call: self.errors.add(call, NO_GPU))
        except Exception as exc:
            self.errors.add("nvmlEventSetCreate", NO_GPU, exc)

    def _retry_loop(self) -> None:
        delay = self._retry_initial
        make = self._candidates[0]
        while not self._stop.wait(delay):
            try:
                backend = make()
                devices = backend.init()
            except Exception as exc:
                self._init_failed(exc)
                delay = min(delay * 2, self._retry_max)
                log.info(
                    "backend still down; retrying",
                    extra={"fields": {"error": self.last_error, "retry_in_s": delay}},
                )
                continue
            self._activate(backend, devices)
            return

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def stop(self) -> None:
        self._stop.set()
        self.processes.stop()
        if self._pods is not None:
            self._pods.stop()
        for t in self._threads:
            t.join(timeout=5)
        if self.ready is not None:
            self.ready.backend.shutdown()

    # -- reads ----------------------------------------------------------------------------
    def _gpu_indexes(self) -> list[int]:
        ready = self.ready
        return [d.index for d in ready.devices] if ready else []

    def _list_processes(self, index: int) -> Sequence[GpuProcess] | None:
        ready = self.ready
        if ready is None:
            return None
        return ready.guards[index](
            "nvmlDeviceGetComputeRunningProcesses", lambda: ready.backend.processes(index)
        )


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
        self._workers: list[_Worker] = []
        self._workers_for: Ready | None = None
        self._inflight: dict[int, Future[RawGpu | None]] = {}
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
                finally:
                    self._lock.release()
            else:  # another scrape holds the GPUs past its own deadline
                source.errors.add("concurrent_scrape", NO_GPU)
                raws = [None] * len(ready.devices)
            dcgm_labels = source.dcgm_labels
            if len(dcgm_labels) != len(ready.devices):
                dcgm_labels = ready.labels
            rows = [
                GpuRow(d.index, ready.labels[d.index], raw, dcgm_labels[d.index])
                for d, raw in zip(ready.devices, raws, strict=True)
            ]
            xid_counts, last_xid = source.xids.snapshot()
            families = gpu_families(self.fields, rows, xid_counts, last_xid, source.processes.snapshot)
        health = health_families(
            source.label,
            source.hostname,
            ready is not None,
            source.errors.snapshot(),
            time.perf_counter() - start,
        )
        yield from families
        yield from health

    # -- one read per GPU, each bounded --------------------------------------------------
    def _read_one(self, ready: Ready, index: int) -> RawGpu | None:
        try:
            return ready.backend.read(index, ready.guards[index])
        except Exception as exc:
            self.source.errors.add(CALL_READ, str(index), exc)
            return None

    def _read_all(self, ready: Ready) -> list[RawGpu | None]:
        if not ready.backend.may_block:
            return [self._read_one(ready, d.index) for d in ready.devices]
        if self._workers_for is not ready:
            # One worker per GPU, at most one read in flight on it: a hung GPU holds only its own.
            self._workers = [_Worker(f"gpu-read-{d.index}") for d in ready.devices]
            self._workers_for = ready
            self._inflight = {}
        deadline = time.monotonic() + self.timeout_s
        futures: dict[int, Future[Any]] = {}
        for d in ready.devices:
            prev = self._inflight.get(d.index)
            if prev is not None and not prev.done():
                self.source.errors.add(CALL_STALLED, str(d.index))
                continue
            fut = self._workers[d.index].submit(lambda d=d: self._read_one(ready, d.index))
            futures[d.index] = self._inflight[d.index] = fut
        wait_futures(list(futures.values()), timeout=max(0.0, deadline - time.monotonic()))
        out: list[RawGpu | None] = []
        for d in ready.devices:
            fut = futures.get(d.index)
            if fut is not None and fut.done():
                out.append(fut.result())
            else:
                if fut is not None:
                    self.source.errors.add(CALL_TIMEOUT, str(d.index))
                out.append(None)
        return out


class _Worker:
    """A daemon thread running one GPU's reads in turn. Daemon, unlike a ThreadPoolExecutor's
    workers, so a read hung inside NVML cannot hold the process open after SIGTERM."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()
        self._jobs.put((fn, fut))
        return fut

    def _run(self) -> None:
        while True:
            fn, fut = self._jobs.get()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:
                    fut.set_exception(exc)
