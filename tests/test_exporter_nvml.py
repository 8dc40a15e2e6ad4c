"""The NVML backend's plumbing, with NVML's functions answered from a recorded reading.

These machines have no GPU or driver, so the functions of ``pynvml`` are replaced here; the
structs, constants and error classes are nvidia-ml-py's own, so a wrong field or constant name
fails here. Whether NVML returns these values on real hardware is what
``python -m exporters.gpu_check`` checks on a GPU machine.
"""

from __future__ import annotations

import ctypes
import queue
import time
import types

import pynvml
import pytest

from exporters.backends.nvml import NvmlBackend
from exporters.collector import GpuSource, Guard
from exporters.fields import load_fields
from exporters.state import ErrorCounter
from inferwatch import contract as c
from tests.fixtures.gpu_exporter import serve_in_thread

MIB = 2**20
UUIDS = ["GPU-0f5c8a71-2d4e-4b7a-9c1d-8e6f5a4b3c2d", "GPU-1a2b3c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d"]


class RecordedNvml(types.ModuleType):
    """nvidia-ml-py with its functions answering as an H100 (GPU 0) and an L4 (GPU 1) would."""

    def __init__(self, memory_v2: bool = True) -> None:
        super().__init__("pynvml")
        self.__dict__.update({k: v for k, v in vars(pynvml).items() if not k.startswith("nvml")})
        for k in ("nvmlMemory_v2", "nvmlEventTypeXidCriticalError"):
            setattr(self, k, getattr(pynvml, k))
        self.memory_v2 = memory_v2
        self.events: queue.Queue[tuple[int, int]] = queue.Queue()
        self.handles = [
            ctypes.cast(ctypes.c_void_p(0x1000 * (i + 1)), pynvml.c_nvmlDevice_t) for i in range(2)
        ]
        self.calls: list[str] = []

    def _index(self, h) -> int:
        return [ctypes.cast(x, ctypes.c_void_p).value for x in self.handles].index(
            ctypes.cast(h, ctypes.c_void_p).value
        )

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")

    def nvmlShutdown(self) -> None:
        self.calls.append("nvmlShutdown")

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int):
        return self.handles[i]

    def nvmlDeviceGetUUID(self, h) -> str:
        return UUIDS[self._index(h)]

    def nvmlDeviceGetName(self, h) -> str:
        return ["NVIDIA H100 80GB HBM3", "NVIDIA L4"][self._index(h)]

    def nvmlDeviceGetMinorNumber(self, h) -> int:
        return [4, 5][self._index(h)]

    def nvmlDeviceGetPciInfo(self, h):
        return types.SimpleNamespace(busId=[b"00000000:9A:00.0", b"00000000:1B:00.0"][self._index(h)])

    def nvmlDeviceGetMemoryInfo(self, h, version=None):
        if version is not None:
            if not self.memory_v2:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            assert version == pynvml.nvmlMemory_v2
            m = pynvml.c_nvmlMemory_v2_t()
            m.total, m.reserved, m.free = 85520809984, 555745280, 40000000000
            m.used = m.total - m.reserved - m.free
            return m
        m = pynvml.c_nvmlMemory_t()
        m.total, m.free = 85520809984, 40000000000
        m.used = m.total - m.free  # v1: used includes the reserved memory
        return m

    def nvmlDeviceGetUtilizationRates(self, h):
        u = pynvml.c_nvmlUtilization_t()
        u.gpu, u.memory = 87, 41
        return u

    def nvmlDeviceGetEncoderUtilization(self, h):
        return [3, 167000]

    def nvmlDeviceGetDecoderUtilization(self, h):
        return [5, 167000]

    def nvmlDeviceGetClockInfo(self, h, kind: int) -> int:
        return {pynvml.NVML_CLOCK_SM: 1980, pynvml.NVML_CLOCK_MEM: 2619}[kind]

    def nvmlDeviceGetTemperature(self, h, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return 61

    def nvmlDeviceGetFieldValues(self, h, ids):
        assert list(ids) == [pynvml.NVML_FI_DEV_MEMORY_TEMP]
        values = (pynvml.c_nvmlFieldValue_t * 1)()
        values[0].fieldId = ids[0]
        if self._index(h) == 1:  # the L4 is GDDR6: no memory temperature
            values[0].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        else:
            values[0].nvmlReturn = pynvml.NVML_SUCCESS
            values[0].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
            values[0].value.uiVal = 70
        return values

    def nvmlDeviceGetPowerUsage(self, h) -> int:
        return 612345

    def nvmlDeviceGetTotalEnergyConsumption(self, h) -> int:
        return 123456789012

    def nvmlDeviceGetPcieReplayCounter(self, h) -> int:
        return 2

    def nvmlDeviceGetRemappedRows(self, h):
        return (1, 0, 0, 0)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [
            types.SimpleNamespace(pid=1, usedGpuMemory=2 * MIB),
            types.SimpleNamespace(pid=2, usedGpuMemory=None),
        ]

    def nvmlEventSetCreate(self):
        return "event-set"

    def nvmlDeviceRegisterEvents(self, h, types_: int, event_set) -> None:
        assert types_ == pynvml.nvmlEventTypeXidCriticalError and event_set == "event-set"

    def nvmlEventSetWait_v2(self, event_set, timeout_ms: int):
        try:
            gpu, xid = self.events.get(timeout=min(timeout_ms, 50) / 1000)
        except queue.Empty:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT) from None
        data = pynvml.c_nvmlEventData_t()
        data.device = self.handles[gpu]
        data.eventType = pynvml.nvmlEventTypeXidCriticalError
        data.eventData = xid
        return data

    def nvmlEventSetFree(self, event_set) -> None:
        self.calls.append("nvmlEventSetFree")


def test_init_reads_the_device_facts() -> None:
    backend = NvmlBackend(RecordedNvml())
    devices = backend.init()
    assert [(d.index, d.uuid, d.name, d.minor, d.pci_bus_id) for d in devices] == [
        (0, UUIDS[0], "NVIDIA H100 80GB HBM3", 4, "00000000:9A:00.0"),
        (1, UUIDS[1], "NVIDIA L4", 5, "00000000:1B:00.0"),
    ]


def test_read_maps_every_nvml_struct_field_and_drops_unsupported_quietly() -> None:
    backend = NvmlBackend(RecordedNvml())
    backend.init()
    errors = ErrorCounter()
    raw = backend.read(0, Guard(0, errors, backend.not_supported))
    assert (raw.mem_total, raw.mem_reserved, raw.mem_free) == (85520809984, 555745280, 40000000000)
    assert raw.mem_used == 85520809984 - 555745280 - 40000000000
    assert (raw.util_gpu, raw.util_mem, raw.util_enc, raw.util_dec) == (87, 41, 3, 5)
    assert (raw.sm_clock, raw.mem_clock, raw.gpu_temp, raw.mem_temp) == (1980, 2619, 61, 70)
    assert (raw.power_mw, raw.energy_mj, raw.pcie_replay) == (612345, 123456789012, 2)
    assert (raw.remap_correctable, raw.remap_uncorrectable, raw.remap_failure) == (1, 0, 0)
    guard = Guard(1, errors, backend.not_supported)
    raw = backend.read(1, guard)
    assert raw.mem_temp is None and raw.gpu_temp == 61
    assert guard.unsupported == {"nvmlDeviceGetFieldValues(MEMORY_TEMP)"}
    assert errors.snapshot() == {}
    assert [(p.pid, p.used_bytes) for p in backend.processes(0)] == [(1, 2 * MIB)]  # unknown usage skipped


def test_drivers_without_memory_info_v2_fall_back_to_v1() -> None:
    backend = NvmlBackend(RecordedNvml(memory_v2=False))
    backend.init()
    errors = ErrorCounter()
    raw = backend.read(0, Guard(0, errors, backend.not_supported))
    assert raw.mem_reserved is None
    assert raw.mem_used == 85520809984 - 40000000000
    assert errors.snapshot() == {}


@pytest.mark.parametrize("error", [pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_UNKNOWN])
def test_nvml_errors_are_counted_by_call_and_gpu(error: int) -> None:
    nvml = RecordedNvml()

    def lost(h) -> int:
        raise pynvml.NVMLError(error)

    nvml.nvmlDeviceGetPowerUsage = lost
    backend = NvmlBackend(nvml)
    backend.init()
    errors = ErrorCounter()
    raw = backend.read(1, Guard(1, errors, backend.not_supported))
    assert raw.power_mw is None and raw.util_gpu == 87
    assert errors.snapshot() == {("nvmlDeviceGetPowerUsage", "1"): 1}


def test_xid_events_become_a_counter_by_code_over_http() -> None:
    nvml = RecordedNvml()
    source = GpuSource([lambda: NvmlBackend(nvml)], label="nvml", hostname="node-a", process_interval_s=0.05)
    with serve_in_thread(source, load_fields()) as exp:
        nvml.events.put((1, 79))
        nvml.events.put((1, 79))
        nvml.events.put((0, 48))
        deadline = time.monotonic() + 10
        key = c.GPU_XID_ERRORS_TOTAL.name[: -len("_total")]
        while len((fams := exp.scrape()).get(key, types.SimpleNamespace(samples=[])).samples) < 2:
            assert time.monotonic() < deadline, "XID events never reached the metrics"
            time.sleep(0.05)
        counts = {(s.labels["gpu"], s.labels["xid"]): s.value for s in fams[key].samples}
        assert counts == {("0", "48"): 1, ("1", "79"): 2}
        last = {s.labels["gpu"]: s.value for s in fams[c.DCGM_XID_ERRORS.name].samples}
        assert last == {"0": 48, "1": 79}
        fb = {s.labels["gpu"]: s.value for s in fams[c.DCGM_FB_USED.name].samples}
        assert fb["0"] + 38146 + 530 == 81559
        assert {s.labels["device"] for s in fams[c.DCGM_GPU_UTIL.name].samples} == {"nvidia4", "nvidia5"}
    assert nvml.calls[-2:] == ["nvmlEventSetFree", "nvmlShutdown"]
