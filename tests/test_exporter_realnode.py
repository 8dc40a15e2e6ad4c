"""The GPU exporter against the faults of real nodes (issue 20), one test or more per defect.

NVML is the fake of ``tests/fixtures/fake_nvml.py`` (nvidia-ml-py's structs, constants and
errors; functions answering as real GPUs and drivers do, faults injected on request); everything
from ``NvmlBackend`` to the HTTP answer is the exporter's own code. Defect 8 (a cgroup path) is in
``test_exporter_cgroups.py`` and defect 10 (device-id types) in ``test_exporter_podresources.py``.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import httpx
import pynvml
import pytest

from exporters.backends import nvml as nvml_module
from exporters.backends.nvml import NvmlBackend
from exporters.backends.simulated import SimulatedBackend
from exporters.cgroups import ProcessAttributor, host_pid_namespace
from exporters.collector import GpuSource, Guard, nvml_absent
from exporters.fields import load_fields
from exporters.model import Backend
from exporters.state import ErrorCounter
from inferwatch import contract as c
from tests.fixtures.fake_nvml import DRIVER, MIB, UUIDS, FakeNvml, wait_for
from tests.fixtures.gpu_exporter import serve_in_thread

FIELDS = load_fields()
ERRORS = c.GPU_BACKEND_ERRORS.name[: -len("_total")]  # the parser files counters without _total
XIDS = c.GPU_XID_ERRORS_TOTAL.name[: -len("_total")]


def nvml_source(nvml: FakeNvml, **kwargs: object) -> GpuSource:
    kwargs.setdefault("pid_namespace", lambda: True)
    return GpuSource([lambda: NvmlBackend(nvml)], label="nvml", hostname="node-a", **kwargs)  # type: ignore[arg-type]


def by_gpu(fams, name: str) -> dict[str, float]:
    return {s.labels["gpu"]: s.value for s in fams[name].samples} if name in fams else {}


def errors(fams) -> dict[tuple[str, str], float]:
    return {(s.labels["call"], s.labels["gpu"]): s.value for s in fams[ERRORS].samples}


def health(exp) -> dict:
    return httpx.get(f"{exp.url}/healthz", timeout=5).json()


# -- 1. one bad GPU stops all of them; auto serves simulated values on a real node ---------------
def test_1_a_gpu_lost_at_start_leaves_the_others_served() -> None:
    nvml = FakeNvml(gpus=3)
    nvml.lost_at_start = {1}  # nvmlDeviceGetHandleByIndex answers GPU_IS_LOST for it
    with serve_in_thread(nvml_source(nvml), FIELDS) as exp:
        fams = exp.scrape()
        assert set(by_gpu(fams, c.DCGM_GPU_UTIL.name)) == {"0", "2"}
        assert by_gpu(fams, c.GPU_UP.name) == {"0": 1, "1": 0, "2": 1}
        assert errors(fams)[("nvmlDeviceGetHandleByIndex", "1")] == 1
        assert [s.value for s in fams[c.GPU_BACKEND_UP.name].samples] == [1]
        body = health(exp)
        assert (body["backend_up"], body["gpus"], body["gpus_down"]) == (True, 2, [1])


def failing_nvml(error: int) -> Backend:
    raise pynvml.NVMLError(error)


def test_1_auto_on_a_host_with_a_driver_reports_the_nvml_error_instead_of_simulating() -> None:
    source = GpuSource(
        [lambda: failing_nvml(pynvml.NVML_ERROR_DRIVER_NOT_LOADED), lambda: SimulatedBackend(gpus=2)],
        label="nvml",
        hostname="node-a",
        fall_back=lambda exc: nvml_absent(exc, driver_present=lambda: True),
        pid_namespace=lambda: True,
    )
    with serve_in_thread(source, FIELDS) as exp:
        fams = exp.scrape()
        assert c.DCGM_GPU_UTIL.name not in fams  # no simulated value on a real node
        assert [s.labels["backend"] for s in fams[c.GPU_BACKEND_INFO.name].samples] == ["nvml"]
        assert [s.value for s in fams[c.GPU_BACKEND_UP.name].samples] == [0]
        assert "Driver Not Loaded" in health(exp)["error"]


def test_1_auto_without_any_driver_simulates_until_the_library_appears() -> None:
    nvml = FakeNvml(gpus=2)
    mounted = False

    def make() -> Backend:
        if not mounted:  # the driver library is mounted late at boot
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        return NvmlBackend(nvml)

    source = GpuSource(
        [make, lambda: SimulatedBackend(gpus=1)],
        label="nvml",
        hostname="node-a",
        retry=True,
        retry_initial_s=0.05,
        retry_max_s=0.1,
        fall_back=lambda exc: nvml_absent(exc, driver_present=lambda: False),
        pid_namespace=lambda: True,
    )
    with serve_in_thread(source, FIELDS) as exp:
        fams = exp.scrape()
        assert [s.labels["backend"] for s in fams[c.GPU_BACKEND_INFO.name].samples] == ["simulated"]
        mounted = True
        wait_for(lambda: health(exp)["backend"] == "nvml", what="the switch to NVML")
        fams = exp.scrape()
        assert {s.labels["UUID"] for s in fams[c.DCGM_GPU_UTIL.name].samples} == set(UUIDS[:2])


def test_1_only_a_missing_library_on_a_host_without_a_driver_allows_simulation() -> None:
    lib = pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    assert type(lib).__name__ == "NVMLError_LibraryNotFound"  # nvidia-ml-py's own subclass
    assert nvml_absent(lib, driver_present=lambda: False)
    assert not nvml_absent(lib, driver_present=lambda: True)
    assert not nvml_absent(
        pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED), driver_present=lambda: False
    )


# -- 2. device label: nvidia<index>, as dcgm-exporter; and pci_bus_id, DCGM_FI_DRIVER_VERSION ---
def test_2_labels_are_dcgm_exporters_even_where_minor_and_index_differ() -> None:
    nvml = FakeNvml(gpus=2)  # minors 4 and 5
    with serve_in_thread(nvml_source(nvml), FIELDS) as exp:
        (s0, s1) = sorted(exp.scrape()[c.DCGM_GPU_UTIL.name].samples, key=lambda s: s.labels["gpu"])
    assert (s0.labels["device"], s1.labels["device"]) == ("nvidia0", "nvidia1")
    assert (s0.labels["pci_bus_id"], s1.labels["pci_bus_id"]) == ("00000000:9A:00.0", "00000000:1B:00.0")
    assert s0.labels[c.L_DRIVER_VERSION] == DRIVER


# -- 3. memory temperature tagged as a double -----------------------------------------------------
@pytest.mark.parametrize(
    ("tag", "value", "expected"),
    [
        (pynvml.NVML_VALUE_TYPE_DOUBLE, 70, 70),  # the r545 bug: integer written, tagged double
        (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, 70, 70),
        (pynvml.NVML_VALUE_TYPE_DOUBLE, 71.0, 71),  # a driver that really writes a double
        (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, 250, None),  # over 200: garbage, dropped
        (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, (0xDEADBEEF << 32) | 68, 68),  # the union's other half
    ],
)
def test_3_memory_temperature_is_read_as_dcgm_reads_it(tag: int, value: float, expected: int | None) -> None:
    nvml = FakeNvml(gpus=1)
    nvml.memory_temp_tag, nvml.memory_temp_c = tag, value
    backend = NvmlBackend(nvml)
    backend.init()
    errors_ = ErrorCounter()
    assert backend.read(0, Guard(0, errors_, backend.not_supported)).mem_temp == expected
    assert errors_.snapshot() == {}


# -- 4. per-pod memory needs the host's PID namespace: detected and said ---------------------------
def test_4_outside_the_host_pid_namespace_the_exporter_says_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="inferwatch.gpu_exporter")
    with serve_in_thread(nvml_source(FakeNvml(), pid_namespace=lambda: False), FIELDS) as exp:
        fams = exp.scrape()
        assert [s.value for s in fams[c.GPU_HOST_PID_NAMESPACE.name].samples] == [0]
        assert health(exp)["host_pid_namespace"] is False
    assert any("hostPID: true" in r.getMessage() for r in caplog.records)


def test_4_the_pid_namespace_is_read_from_its_link(tmp_path: Path) -> None:
    ns = tmp_path / "self" / "ns"
    ns.mkdir(parents=True)
    os.symlink("pid:[4026531836]", ns / "pid")  # the kernel's initial PID namespace
    assert host_pid_namespace(tmp_path) is True
    (ns / "pid").unlink()
    os.symlink("pid:[4026532719]", ns / "pid")  # a container's own
    assert host_pid_namespace(tmp_path) is False
    assert host_pid_namespace(tmp_path / "absent") is None
    assert host_pid_namespace() in (True, False, None)  # this machine's, whatever it is


# -- 5. one lost GPU blinds XID collection for all ------------------------------------------------
def test_5_xid_79_on_one_gpu_does_not_blind_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvml_module, "XID_REBUILD_S", 0.05)
    nvml = FakeNvml(gpus=2)
    with serve_in_thread(nvml_source(nvml), FIELDS) as exp:
        nvml.events.put((1, 79))  # GPU 1 falls off the bus; the shared set's wait now fails at once

        def count(gpu: str, xid: str) -> float:
            fams = exp.scrape()
            samples = fams[XIDS].samples if XIDS in fams else []
            return sum(s.value for s in samples if (s.labels["gpu"], s.labels["xid"]) == (gpu, xid))

        wait_for(lambda: count("1", "79") == 1, what="Xid 79")
        nvml.events.put((0, 48))  # a later XID on a healthy GPU still arrives
        wait_for(lambda: count("0", "48") == 1, what="an XID after the lost GPU")
        assert errors(exp.scrape())[("nvmlEventSetWait", "")] >= 1
        assert by_gpu(exp.scrape(), c.GPU_UP.name)["1"] == 0  # and the lost GPU is reported down


def test_5_gpus_without_xid_events_end_the_reader_instead_of_retrying() -> None:
    import threading

    nvml = FakeNvml(gpus=2)
    nvml.not_supported = {("nvmlDeviceRegisterEvents", 0), ("nvmlDeviceRegisterEvents", 1)}
    backend = NvmlBackend(nvml)
    backend.init()
    calls: list[str] = []
    done = threading.Event()
    reader = threading.Thread(
        target=lambda: (backend.watch_xids(threading.Event(), lambda g, x: None, calls.append), done.set())
    )
    reader.start()
    assert done.wait(10), "the reader kept retrying GPUs that have no XID events"
    assert calls == [] and nvml.calls.count("nvmlEventSetCreate") == 1


# -- 6. recovery, truthful health, NOT_SUPPORTED that comes back, per-GPU memory v2 ---------------
def test_6_a_driver_reload_is_reported_then_recovered() -> None:
    nvml = FakeNvml(gpus=2)
    source = nvml_source(nvml, recheck_s=0.05, retry_initial_s=0.05, retry_max_s=0.2)
    with serve_in_thread(source, FIELDS) as exp:
        assert set(by_gpu(exp.scrape(), c.DCGM_GPU_UTIL.name)) == {"0", "1"}
        nvml.unload()  # every call fails; nvmlInit answers DRIVER_NOT_LOADED
        fams = exp.scrape()
        assert c.DCGM_GPU_UTIL.name not in fams
        assert [s.value for s in fams[c.GPU_BACKEND_UP.name].samples] == [0]  # not 1 any more
        assert health(exp)["gpus_down"] == [0, 1]
        # the next scrape fails too: now the supervisor restarts NVML, which answers DRIVER_NOT_LOADED
        wait_for(lambda: exp.scrape() and "Driver Not Loaded" in (health(exp)["error"] or ""), what="reload")
        assert health(exp)["backend_up"] is False
        nvml.load()
        wait_for(lambda: health(exp)["backend_up"], what="recovery")
        fams = exp.scrape()
        assert set(by_gpu(fams, c.DCGM_GPU_UTIL.name)) == {"0", "1"}
        assert by_gpu(fams, c.GPU_UP.name) == {"0": 1, "1": 1}
    # NVML was shut down to zero and initialized again, not only counted up on stale handles
    assert nvml.init_count >= 2


def test_6_a_gpu_lost_mid_run_gets_the_backend_reinitialized() -> None:
    nvml = FakeNvml(gpus=2)
    source = nvml_source(nvml, recheck_s=0.05, retry_initial_s=0.05, retry_max_s=0.2)
    with serve_in_thread(source, FIELDS) as exp:
        exp.scrape()
        nvml.lose(1)
        fams = exp.scrape()
        assert by_gpu(fams, c.GPU_UP.name) == {"0": 1, "1": 0}
        assert set(by_gpu(fams, c.DCGM_GPU_UTIL.name)) == {"0"}
        wait_for(lambda: exp.scrape() and health(exp)["gpus"] == 1, what="re-discovery without the lost GPU")
        nvml.lost.clear()  # the GPU is back (reset)
        wait_for(lambda: health(exp)["gpus"] == 2, what="re-discovery of the GPU that came back")
        assert set(by_gpu(exp.scrape(), c.DCGM_GPU_UTIL.name)) == {"0", "1"}


def test_6_a_hung_gpu_is_reported_down_but_nvml_is_not_restarted_under_it() -> None:
    nvml = FakeNvml(gpus=2)
    source = nvml_source(nvml, recheck_s=0.05, retry_initial_s=0.05, retry_max_s=0.2)
    try:
        with serve_in_thread(source, FIELDS, timeout_s=0.2) as exp:
            exp.scrape()
            nvml.hang("nvmlDeviceGetMemoryInfo", 1)  # blocks inside the driver
            for _ in range(4):
                fams = exp.scrape()
            assert by_gpu(fams, c.GPU_UP.name) == {"0": 1, "1": 0}
            assert health(exp)["gpus_down"] == [1]
            time.sleep(0.3)  # several supervisor rounds
            # shutting NVML down under a blocked call is unsafe and would not unblock it
            assert nvml.calls.count("nvmlShutdown") == 0 and nvml.init_count == 1
    finally:
        nvml.release()


def test_6_not_supported_that_comes_back_is_asked_again() -> None:
    nvml = FakeNvml(gpus=1)
    backend = NvmlBackend(nvml)
    backend.init()
    now = [0.0]
    guard = Guard(0, ErrorCounter(), backend.not_supported, recheck_s=60.0, clock=lambda: now[0])
    nvml.not_supported.add(("nvmlDeviceGetPowerUsage", 0))
    assert backend.read(0, guard).power_mw is None
    nvml.not_supported.clear()  # e.g. after a GPU reset
    now[0] = 59.0
    assert backend.read(0, guard).power_mw is None  # not asked again yet
    now[0] = 61.0
    assert backend.read(0, guard).power_mw == 612345


def test_6_memory_info_v2_falls_back_per_gpu() -> None:
    nvml = FakeNvml(gpus=2, memory_v2={0})  # GPU 1 answers NOT_SUPPORTED to v2
    backend = NvmlBackend(nvml)
    backend.init()
    errors_ = ErrorCounter()
    v1 = backend.read(1, Guard(1, errors_, backend.not_supported))
    v2 = backend.read(0, Guard(0, errors_, backend.not_supported))
    assert v1.mem_reserved is None and v1.mem_used == 85520809984 - 40000000000
    assert v2.mem_reserved == 555745280 and v2.mem_used == 85520809984 - 555745280 - 40000000000


# -- 7. per-pod memory goes stale after one hung call ---------------------------------------------
def test_7_a_hung_process_listing_costs_only_its_gpu_is_counted_and_ages_out() -> None:
    nvml = FakeNvml(gpus=2)
    nvml.processes = {0: [(10, 2 * MIB)], 1: [(11, 3 * MIB)]}
    backend = NvmlBackend(nvml)
    backend.init()
    errors_ = ErrorCounter()
    guards = {i: Guard(i, errors_, backend.not_supported) for i in (0, 1)}
    now = [100.0]
    attributor = ProcessAttributor(
        lambda i: guards[i]("nvmlDeviceGetComputeRunningProcesses", lambda: backend.processes(i)),
        lambda: (backend, [0, 1]),
        Path("/nonexistent"),
        None,
        interval=10.0,
        timeout_s=0.1,
        max_age_s=30.0,
        errors=errors_,
        clock=lambda: now[0],
    )
    try:
        attributor.refresh()
        assert {(u.gpu, u.used_bytes) for u in attributor.snapshot} == {(0, 2 * MIB), (1, 3 * MIB)}

        nvml.hang("nvmlDeviceGetComputeRunningProcesses", 1)
        nvml.processes[0] = [(10, 5 * MIB)]
        now[0] = 110.0
        attributor.refresh()  # returns at its deadline, with GPU 0 fresh
        assert {(u.gpu, u.used_bytes) for u in attributor.snapshot} == {(0, 5 * MIB), (1, 3 * MIB)}
        assert errors_.snapshot()[("processes.timeout", "1")] == 1

        now[0] = 140.0  # GPU 1's last listing is now older than max_age: dropped, not served
        attributor.refresh()
        assert {(u.gpu, u.used_bytes) for u in attributor.snapshot} == {(0, 5 * MIB)}
        assert errors_.snapshot()[("processes.stalled", "1")] == 1  # still hung: not called again
        ages = attributor.ages()
        assert ages[0] == 0 and ages[1] == 40.0
    finally:
        nvml.release()
        attributor.stop()


def test_7_the_staleness_is_served() -> None:
    nvml = FakeNvml(gpus=2)
    nvml.processes = {0: [(10, 2 * MIB)], 1: [(11, 3 * MIB)]}
    nvml.hang("nvmlDeviceGetComputeRunningProcesses", 1)
    source = nvml_source(nvml, process_interval_s=0.05, process_timeout_s=0.05)
    try:
        with serve_in_thread(source, FIELDS) as exp:
            wait_for(
                lambda: by_gpu(exp.scrape(), c.GPU_PROCESS_MEMORY.name).get("0") == 2 * MIB, what="GPU 0"
            )
            # GPU 0 is listed on every pass; GPU 1's age only grows
            wait_for(lambda: by_gpu(exp.scrape(), c.GPU_PROCESS_SCAN_AGE.name).get("1", 0) > 0.3, what="age")
            fams = exp.scrape()
            ages = by_gpu(fams, c.GPU_PROCESS_SCAN_AGE.name)
            assert ages["1"] > ages["0"]
            assert "1" not in by_gpu(fams, c.GPU_PROCESS_MEMORY.name)
            assert errors(fams)[("processes.timeout", "1")] == 1
            assert errors(fams)[("processes.stalled", "1")] >= 1
    finally:
        nvml.release()


# -- 9. XID labels as current dcgm-exporter writes them --------------------------------------------
def test_9_the_last_xid_gauge_carries_err_code_and_err_msg() -> None:
    nvml = FakeNvml(gpus=2)
    with serve_in_thread(nvml_source(nvml), FIELDS) as exp:
        before = {s.labels["gpu"]: s.labels for s in exp.scrape()[c.DCGM_XID_ERRORS.name].samples}
        assert (before["0"]["err_code"], before["0"]["err_msg"]) == ("0", "No Error")
        nvml.events.put((0, 48))
        wait_for(lambda: by_gpu(exp.scrape(), c.DCGM_XID_ERRORS.name).get("0") == 48, what="Xid 48")
        (s,) = [s for s in exp.scrape()[c.DCGM_XID_ERRORS.name].samples if s.labels["gpu"] == "0"]
        assert (s.labels["err_code"], s.labels["err_msg"]) == ("48", "Double Bit ECC Error")
