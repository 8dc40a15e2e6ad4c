"""The NVML backend's plumbing, with NVML's functions answered by the fake NVML
(``tests/fixtures/fake_nvml.py``) without faults.

These machines have no GPU or driver, so the functions of ``pynvml`` are replaced; the
structs, constants and error classes are nvidia-ml-py's own, so a wrong field or constant name
fails here. Whether NVML returns these values on real hardware is what
``python -m exporters.gpu_check`` checks on a GPU machine. The faults of real nodes are in
``tests/test_exporter_realnode.py``.
"""

from __future__ import annotations

import time
import types

import pynvml
import pytest

from exporters.backends.nvml import NvmlBackend
from exporters.collector import GpuSource, Guard
from exporters.fields import load_fields
from exporters.state import ErrorCounter
from inferwatch import contract as c
from tests.fixtures.fake_nvml import UUIDS, FakeNvml
from tests.fixtures.gpu_exporter import serve_in_thread

MIB = 2**20


def test_init_reads_the_device_facts() -> None:
    backend = NvmlBackend(FakeNvml())
    devices = backend.init()
    assert [(d.index, d.uuid, d.name, d.minor, d.pci_bus_id) for d in devices] == [
        (0, UUIDS[0], "NVIDIA H100 80GB HBM3", 4, "00000000:9A:00.0"),
        (1, UUIDS[1], "NVIDIA L4", 5, "00000000:1B:00.0"),
    ]


def test_read_maps_every_nvml_struct_field_and_drops_unsupported_quietly() -> None:
    backend = NvmlBackend(FakeNvml())
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
    assert set(guard.unsupported) == {"nvmlDeviceGetFieldValues(MEMORY_TEMP)"}
    assert errors.snapshot() == {}
    assert [(p.pid, p.used_bytes) for p in backend.processes(0)] == [(1, 2 * MIB)]  # unknown usage skipped


def test_drivers_without_memory_info_v2_fall_back_to_v1() -> None:
    backend = NvmlBackend(FakeNvml(memory_v2=False))
    backend.init()
    errors = ErrorCounter()
    raw = backend.read(0, Guard(0, errors, backend.not_supported))
    assert raw.mem_reserved is None
    assert raw.mem_used == 85520809984 - 40000000000
    assert errors.snapshot() == {}


@pytest.mark.parametrize("error", [pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_UNKNOWN])
def test_nvml_errors_are_counted_by_call_and_gpu(error: int) -> None:
    nvml = FakeNvml()

    def lost(h) -> int:
        raise pynvml.NVMLError(error)

    nvml.nvmlDeviceGetPowerUsage = lost  # type: ignore[method-assign]
    backend = NvmlBackend(nvml)
    backend.init()
    errors = ErrorCounter()
    raw = backend.read(1, Guard(1, errors, backend.not_supported))
    assert raw.power_mw is None and raw.util_gpu == 87
    assert errors.snapshot() == {("nvmlDeviceGetPowerUsage", "1"): 1}


def test_xid_events_become_a_counter_by_code_over_http() -> None:
    nvml = FakeNvml()
    source = GpuSource([lambda: NvmlBackend(nvml)], label="nvml", hostname="node-a", process_interval_s=0.05)
    with serve_in_thread(source, load_fields()) as exp:
        nvml.events.put((1, 13))
        nvml.events.put((1, 13))
        nvml.events.put((0, 48))
        deadline = time.monotonic() + 10
        key = c.GPU_XID_ERRORS_TOTAL.name[: -len("_total")]
        while len((fams := exp.scrape()).get(key, types.SimpleNamespace(samples=[])).samples) < 2:
            assert time.monotonic() < deadline, "XID events never reached the metrics"
            time.sleep(0.05)
        counts = {(s.labels["gpu"], s.labels["xid"]): s.value for s in fams[key].samples}
        assert counts == {("0", "48"): 1, ("1", "13"): 2}
        last = {s.labels["gpu"]: s.value for s in fams[c.DCGM_XID_ERRORS.name].samples}
        assert last == {"0": 48, "1": 13}
        fb = {s.labels["gpu"]: s.value for s in fams[c.DCGM_FB_USED.name].samples}
        assert fb["0"] == (85520809984 - 555745280 - 40000000000) // MIB
    assert nvml.calls[-2:] == ["nvmlEventSetFree", "nvmlShutdown"]


def test_the_fake_answers_only_functions_nvidia_ml_py_has_with_its_parameters() -> None:
    """The fake stands in for nvidia-ml-py's functions, so each must exist there and take the
    same leading parameters: a backend call that works against the fake then names a real
    function the real way."""
    import inspect

    for name, fn in vars(FakeNvml).items():
        if not name.startswith("nvml") or not callable(fn):
            continue
        assert hasattr(pynvml, name), f"{name} is not in nvidia-ml-py"
        fake = [p for p in inspect.signature(fn).parameters if p != "self"]
        real = inspect.signature(getattr(pynvml, name)).parameters.values()
        required = [p.name for p in real if p.default is inspect.Parameter.empty]
        assert len(required) <= len(fake) <= len(real), (name, fake, [p.name for p in real])


def test_gpu_temperature_uses_the_versioned_call_and_falls_back_on_older_drivers() -> None:
    nvml = FakeNvml(gpus=1)
    backend = NvmlBackend(nvml)
    backend.init()
    guard = Guard(0, ErrorCounter(), backend.not_supported)
    assert backend.read(0, guard).gpu_temp == 61
    assert "nvmlDeviceGetTemperatureV" in nvml.calls and "nvmlDeviceGetTemperature" not in nvml.calls

    def missing(h, sensor, version=None):  # a driver without the symbol
        nvml.calls.append("nvmlDeviceGetTemperatureV")
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    nvml.nvmlDeviceGetTemperatureV = missing  # type: ignore[method-assign]
    nvml.calls.clear()
    errors = ErrorCounter()
    for _ in range(3):
        assert backend.read(0, Guard(0, errors, backend.not_supported)).gpu_temp == 61
    assert nvml.calls.count("nvmlDeviceGetTemperatureV") == 1  # asked once, then the old call
    assert errors.snapshot() == {}
