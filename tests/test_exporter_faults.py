"""Failing GPUs and a failing NVML, served by the exporter's real HTTP server in this process.

A failing GPU cannot be produced on these machines, so the backends here are simulated GPUs
with one GPU made to fail in a stated way; everything from the guard to the HTTP answer is the
exporter's own code.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx
import pynvml
from prometheus_client.registry import CollectorRegistry

from exporters.backends.simulated import SimulatedBackend
from exporters.collector import GpuCollector, GpuSource
from exporters.fields import load_fields
from exporters.model import Backend, Guard, RawGpu
from inferwatch import contract as c
from tests.fixtures.gpu_exporter import serve_in_thread

FIELDS = load_fields()
ERRORS = c.GPU_BACKEND_ERRORS.name[: -len("_total")]  # the parser files counters without _total


class GpuOneRaises(SimulatedBackend):
    """Two simulated GPUs; every call on GPU 1 raises NVML's "unknown error"."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    def read(self, index: int, guard: Guard) -> RawGpu:
        if index != 1:
            return super().read(index, guard)

        def recorder(call: str, fn: Callable[[], object]) -> object:
            self.calls.append(call)

            def fail() -> object:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

            return guard(call, fail)

        return super().read(index, recorder)  # same calls as GPU 0, each one failing


class GpuOneLost(SimulatedBackend):
    def read(self, index: int, guard: Guard) -> RawGpu:
        if index == 1:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return super().read(index, guard)


class GpuOneHangs(SimulatedBackend):
    """GPU 1's reads block (as NVML does on a GPU that fell off the bus) until released."""

    may_block = True

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.release = threading.Event()

    def read(self, index: int, guard: Guard) -> RawGpu:
        if index == 1:
            self.release.wait(30)
        return super().read(index, guard)


def source_of(make: Callable[[], Backend], **kwargs: object) -> GpuSource:
    return GpuSource([make], label="nvml", hostname="node-a", **kwargs)


def gpus_with(fams, name: str) -> set[str]:
    return {s.labels["gpu"] for s in fams[name].samples} if name in fams else set()


def errors(fams) -> dict[tuple[str, str], float]:
    return {(s.labels["call"], s.labels["gpu"]): s.value for s in fams[ERRORS].samples}


def test_a_gpu_that_raises_on_every_call_costs_only_its_own_series() -> None:
    backend = GpuOneRaises(gpus=2, model="H100")
    with serve_in_thread(source_of(lambda: backend), FIELDS) as exp:
        fams = exp.scrape()
        for field in FIELDS:  # dcgm names carry no _total, so the parser keeps them
            expected = {"0", "1"} if field.metric is c.DCGM_XID_ERRORS else {"0"}  # XIDs come from events
            assert gpus_with(fams, field.metric.name) == expected, field.metric.name
        assert gpus_with(fams, c.GPU_FB_TOTAL_BYTES.name) == {"0"}
        first = errors(fams)
        assert set(backend.calls) == {call for call, gpu in first}
        assert all(gpu == "1" and n == 1 for (_, gpu), n in first.items())
        assert ("nvmlDeviceGetMemoryInfo", "1") in first
        second = errors(exp.scrape())
        assert all(second[k] == 2 for k in first), "every scrape counts its failures"
        assert httpx.get(f"{exp.url}/healthz", timeout=5).json()["backend_up"] is True


def test_a_lost_gpu_is_counted_once_per_scrape_and_the_others_are_served() -> None:
    with serve_in_thread(source_of(lambda: GpuOneLost(gpus=3)), FIELDS) as exp:
        fams = exp.scrape()
        assert gpus_with(fams, c.DCGM_GPU_UTIL.name) == {"0", "2"}
        assert gpus_with(fams, c.DCGM_XID_ERRORS.name) == {"0", "1", "2"}
        assert errors(fams) == {("read", "1"): 1}


def test_a_hanging_gpu_never_hangs_the_scrape() -> None:
    backend = GpuOneHangs(gpus=2)
    try:
        with serve_in_thread(source_of(lambda: backend), FIELDS, timeout_s=0.3) as exp:
            start = time.monotonic()
            fams = exp.scrape()
            first = time.monotonic() - start
            assert first < 2.0, f"scrape took {first:.2f}s with a 0.3s deadline"
            assert gpus_with(fams, c.DCGM_GPU_UTIL.name) == {"0"}
            assert errors(fams) == {("timeout", "1"): 1}
            # GPU 1's read is still hung: it is not read again (no pile of stuck threads)
            start = time.monotonic()
            fams = exp.scrape()
            assert time.monotonic() - start < 2.0
            assert errors(fams) == {("timeout", "1"): 1, ("stalled", "1"): 1}
            assert gpus_with(fams, c.DCGM_GPU_UTIL.name) == {"0"}
            backend.release.set()  # the GPU comes back
            time.sleep(0.1)
            fams = exp.scrape()
            assert gpus_with(fams, c.DCGM_GPU_UTIL.name) == {"0", "1"}
    finally:
        backend.release.set()


def test_an_unsupported_call_drops_its_series_quietly() -> None:
    # An L4 (GDDR6) has no memory temperature; NVML answers NotSupported for it.
    with serve_in_thread(source_of(lambda: SimulatedBackend(gpus=2, model="L4")), FIELDS) as exp:
        fams = exp.scrape()
        assert c.DCGM_MEMORY_TEMP.name not in fams
        assert f"# TYPE {c.DCGM_MEMORY_TEMP.name}" not in exp.scrape_text()
        assert gpus_with(fams, c.DCGM_GPU_TEMP.name) == {"0", "1"}
        assert errors(fams) == {}


def test_nvml_init_failure_keeps_serving_then_recovers_with_backoff() -> None:
    attempts: list[float] = []
    driver_loaded = threading.Event()

    def make() -> Backend:
        attempts.append(time.monotonic())
        if not driver_loaded.is_set():
            raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        return SimulatedBackend(gpus=1)

    source = source_of(make, retry=True, retry_initial_s=0.2, retry_max_s=0.8)
    with serve_in_thread(source, FIELDS) as exp:
        health = httpx.get(f"{exp.url}/healthz", timeout=5)
        assert health.status_code == 200
        assert health.json()["backend_up"] is False
        assert "Driver Not Loaded" in health.json()["error"]
        fams = exp.scrape()
        assert [s.value for s in fams[c.GPU_BACKEND_UP.name].samples] == [0]
        assert [s.labels["backend"] for s in fams[c.GPU_BACKEND_INFO.name].samples] == ["nvml"]
        assert errors(fams)[("nvmlInit", "")] >= 1
        assert c.DCGM_GPU_UTIL.name not in fams

        deadline = time.monotonic() + 20
        while len(attempts) < 4:
            assert time.monotonic() < deadline, f"only {len(attempts)} attempts"
            time.sleep(0.05)
        driver_loaded.set()  # the driver comes back
        while not httpx.get(f"{exp.url}/healthz", timeout=5).json()["backend_up"]:
            assert time.monotonic() < deadline, "backend never recovered"
            time.sleep(0.05)
        fams = exp.scrape()
        assert [s.value for s in fams[c.GPU_BACKEND_UP.name].samples] == [1]
        assert gpus_with(fams, c.DCGM_GPU_UTIL.name) == {"0"}
        assert errors(fams)[("nvmlInit", "")] == len(attempts) - 1  # every failed attempt counted
    gaps = [b - a for a, b in itertools.pairwise(attempts[:4])]
    assert gaps[0] >= 0.2 and gaps[1] >= 0.4 and gaps[2] >= 0.8, f"waits must double: {gaps}"


def test_describe_and_register_never_touch_the_backend() -> None:
    def make() -> Backend:
        raise AssertionError("the backend was started by registration")

    source = source_of(make)
    registry = CollectorRegistry()  # auto_describe: registration calls describe()
    collector = GpuCollector(source, FIELDS, registry)
    described = {m.name for m in collector.describe()}
    assert {f.metric.name for f in FIELDS} <= described
    assert {m.name for m in c.GPU_EXPORTER_METRICS} <= described
    # not started: only the exporter's health, with the backend down
    fams = {m.name: m for m in registry.collect()}
    assert [s.value for s in fams[c.GPU_BACKEND_UP.name].samples] == [0]
    assert c.DCGM_GPU_UTIL.name not in fams


HUNG_EXIT = """
import threading, sys
from exporters.backends.simulated import SimulatedBackend
from exporters.collector import GpuCollector, GpuSource
from exporters.fields import load_fields

class Hung(SimulatedBackend):
    may_block = True
    def read(self, index, guard):
        threading.Event().wait()  # never returns, like NVML on a GPU that fell off the bus

source = GpuSource([lambda: Hung(gpus=2)], label="nvml", hostname="h")
source.start()
families = list(GpuCollector(source, load_fields(), timeout_s=0.2).collect())
source.stop()
print("collected", len(families))
"""


def test_a_read_hung_in_the_driver_does_not_hold_the_process_at_exit() -> None:
    proc = subprocess.run([sys.executable, "-c", HUNG_EXIT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("collected ")
