"""The NVML backend: a thin layer over nvidia-ml-py (module ``pynvml``).

Each device call goes through the collector's guard, one call per guard, so an unsupported or
failing call costs only its own series. Values stay in NVML's units; ``exporters.convert``
turns them into dcgm-exporter's.

This path has not been run on a GPU in this repository's tests (the development machines have
none); ``python -m exporters.gpu_check`` compares it with nvidia-smi on a machine that has one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from exporters.model import DeviceInfo, GpuProcess, Guard, RawGpu

log = logging.getLogger("inferwatch.gpu_exporter")

XID_WAIT_MS = 1000  # how long one event wait blocks; bounds how fast the watcher sees stop


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlBackend:
    name = "nvml"
    may_block = True

    def __init__(self, nvml: Any = None) -> None:
        if nvml is None:
            import pynvml as nvml  # imported here so the simulated backend never loads it

        self.nv = nvml
        self.not_supported = (nvml.NVMLError_NotSupported,)
        self._handles: list[Any] = []
        self._by_handle: dict[int, int] = {}
        self._memory_v2 = True

    def init(self) -> list[DeviceInfo]:
        nv = self.nv
        nv.nvmlInit()
        try:
            devices = []
            self._handles = []
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                self._handles.append(h)
                try:
                    bus = _text(nv.nvmlDeviceGetPciInfo(h).busId)
                except nv.NVMLError:
                    bus = ""
                try:
                    minor = nv.nvmlDeviceGetMinorNumber(h)
                except nv.NVMLError:
                    minor = i
                devices.append(
                    DeviceInfo(i, _text(nv.nvmlDeviceGetUUID(h)), _text(nv.nvmlDeviceGetName(h)), minor, bus)
                )
            self._by_handle = {_handle_key(h): i for i, h in enumerate(self._handles)}
            return devices
        except Exception:
            nv.nvmlShutdown()
            raise

    def read(self, index: int, guard: Guard) -> RawGpu:
        nv = self.nv
        h = self._handles[index]
        raw = RawGpu()
        mem = guard("nvmlDeviceGetMemoryInfo", lambda: self._memory(h))
        if mem is not None:
            raw.mem_total, raw.mem_free, raw.mem_used = mem.total, mem.free, mem.used
            raw.mem_reserved = getattr(mem, "reserved", None)  # absent from the v1 struct
        util = guard("nvmlDeviceGetUtilizationRates", lambda: nv.nvmlDeviceGetUtilizationRates(h))
        if util is not None:
            raw.util_gpu, raw.util_mem = util.gpu, util.memory
        enc = guard("nvmlDeviceGetEncoderUtilization", lambda: nv.nvmlDeviceGetEncoderUtilization(h))
        if enc is not None:
            raw.util_enc = enc[0]  # (utilization, sampling period in us)
        dec = guard("nvmlDeviceGetDecoderUtilization", lambda: nv.nvmlDeviceGetDecoderUtilization(h))
        if dec is not None:
            raw.util_dec = dec[0]
        raw.sm_clock = guard(
            "nvmlDeviceGetClockInfo(SM)", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)
        )
        raw.mem_clock = guard(
            "nvmlDeviceGetClockInfo(MEM)", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)
        )
        raw.gpu_temp = guard(
            "nvmlDeviceGetTemperature", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)
        )
        raw.mem_temp = guard("nvmlDeviceGetFieldValues(MEMORY_TEMP)", lambda: self._memory_temp(h))
        raw.power_mw = guard("nvmlDeviceGetPowerUsage", lambda: nv.nvmlDeviceGetPowerUsage(h))
        raw.energy_mj = guard(
            "nvmlDeviceGetTotalEnergyConsumption", lambda: nv.nvmlDeviceGetTotalEnergyConsumption(h)
        )
        raw.pcie_replay = guard(
            "nvmlDeviceGetPcieReplayCounter", lambda: nv.nvmlDeviceGetPcieReplayCounter(h)
        )
        rows = guard("nvmlDeviceGetRemappedRows", lambda: nv.nvmlDeviceGetRemappedRows(h))
        if rows is not None:
            raw.remap_correctable, raw.remap_uncorrectable, _pending, raw.remap_failure = rows
        return raw

    def _memory(self, h: Any) -> Any:
        """Memory info v2 (total, reserved, free, used); v1 on drivers without v2, where "used"
        includes the reserved memory and no reserved figure exists."""
        nv = self.nv
        if self._memory_v2:
            try:
                return nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)
            except (nv.NVMLError_FunctionNotFound, nv.NVMLError_NotSupported):
                self._memory_v2 = False
                log.info("NVML memory info v2 unavailable; using v1 (no reserved figure)")
        return nv.nvmlDeviceGetMemoryInfo(h)

    def _memory_temp(self, h: Any) -> int:
        nv = self.nv
        (fv,) = nv.nvmlDeviceGetFieldValues(h, [nv.NVML_FI_DEV_MEMORY_TEMP])
        if fv.nvmlReturn != nv.NVML_SUCCESS:
            raise nv.NVMLError(fv.nvmlReturn)  # NotSupported on GDDR boards: dropped quietly
        return int(_field_value(nv, fv))

    def processes(self, index: int) -> list[GpuProcess]:
        procs = self.nv.nvmlDeviceGetComputeRunningProcesses(self._handles[index])
        return [GpuProcess(p.pid, p.usedGpuMemory) for p in procs if p.usedGpuMemory is not None]

    def watch_xids(
        self, stop: threading.Event, record: Callable[[int, int], None], error: Callable[[str], None]
    ) -> None:
        """Reads XID critical-error events until ``stop`` is set."""
        nv = self.nv
        event_set = nv.nvmlEventSetCreate()
        try:
            registered = 0
            for i, h in enumerate(self._handles):
                try:
                    nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, event_set)
                    registered += 1
                except nv.NVMLError_NotSupported:
                    log.info("XID events not supported on this GPU", extra={"fields": {"gpu": i}})
                except nv.NVMLError as exc:
                    error("nvmlDeviceRegisterEvents")
                    log.warning("cannot watch XID events", extra={"fields": {"gpu": i, "error": str(exc)}})
            if not registered:
                return
            while not stop.is_set():
                try:
                    data = nv.nvmlEventSetWait_v2(event_set, XID_WAIT_MS)
                except nv.NVMLError_Timeout:
                    continue
                except nv.NVMLError as exc:
                    error("nvmlEventSetWait")
                    log.warning("XID event wait failed", extra={"fields": {"error": str(exc)}})
                    stop.wait(5.0)
                    continue
                if data.eventType & nv.nvmlEventTypeXidCriticalError:
                    gpu = self._by_handle.get(_handle_key(data.device))
                    if gpu is not None:
                        record(gpu, int(data.eventData))
        finally:
            try:
                nv.nvmlEventSetFree(event_set)
            except nv.NVMLError:
                pass

    def shutdown(self) -> None:
        try:
            self.nv.nvmlShutdown()
        except self.nv.NVMLError:
            pass


def _handle_key(handle: Any) -> int:
    # Handles are ctypes pointers; equal devices have equal addresses.
    import ctypes

    return ctypes.cast(handle, ctypes.c_void_p).value or 0


def _field_value(nv: Any, fv: Any) -> float:
    member = {
        getattr(nv, "NVML_VALUE_TYPE_DOUBLE", 0): "dVal",
        getattr(nv, "NVML_VALUE_TYPE_UNSIGNED_INT", 1): "uiVal",
        getattr(nv, "NVML_VALUE_TYPE_UNSIGNED_LONG", 2): "ulVal",
        getattr(nv, "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", 3): "ullVal",
        getattr(nv, "NVML_VALUE_TYPE_SIGNED_LONG_LONG", 4): "sllVal",
        getattr(nv, "NVML_VALUE_TYPE_SIGNED_INT", 5): "siVal",
        getattr(nv, "NVML_VALUE_TYPE_UNSIGNED_SHORT", 6): "usVal",
    }.get(fv.valueType, "uiVal")
    return getattr(fv.value, member)
