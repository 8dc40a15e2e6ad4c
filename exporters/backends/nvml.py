"""The NVML backend: a thin layer over nvidia-ml-py (module ``pynvml``).

Each device call goes through the collector's guard, one call per guard, so an unsupported or
failing call costs only its own series. Values stay in NVML's units; ``exporters.convert``
turns them into dcgm-exporter's.

Start-up opens each GPU in its own guard: a GPU whose handle, UUID or name call fails (NVML
answers GPU_IS_LOST for a GPU that fell off the bus) is listed in ``failed`` and the others are
served. Only ``nvmlInit`` and ``nvmlDeviceGetCount`` failing fails the start.

This path has not been run on a GPU in this repository's tests (the development machines have
none); ``python -m exporters.gpu_check`` compares it with nvidia-smi on a machine that has one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from exporters.model import DeviceFailure, DeviceInfo, GpuProcess, Guard, RawGpu

log = logging.getLogger("inferwatch.gpu_exporter")

XID_WAIT_MS = 1000  # how long one event wait blocks; bounds how fast the watcher sees stop
XID_REBUILD_S = 1.0  # pause before rebuilding the event set after a failed wait
XID_NONE_REGISTERED_S = 30.0  # pause before trying again when no GPU accepted registration
# Memory temperature above this is garbage, not a reading (DCGM drops such values too).
MEMORY_TEMP_MAX_C = 200


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
        self._handles: dict[int, Any] = {}
        self._by_handle: dict[int, int] = {}
        self._memory_v1: set[int] = set()  # GPUs without memory info v2 (per GPU, not per process)
        self.failed: list[DeviceFailure] = []
        self.driver_version = ""
        self._old_temperature = False  # the driver lacks nvmlDeviceGetTemperatureV

    def init(self) -> list[DeviceInfo]:
        nv = self.nv
        nv.nvmlInit()
        try:
            count = nv.nvmlDeviceGetCount()
        except Exception:
            nv.nvmlShutdown()
            raise
        try:
            self.driver_version = _text(nv.nvmlSystemGetDriverVersion())
        except nv.NVMLError:
            self.driver_version = ""
        devices: list[DeviceInfo] = []
        self._handles, self.failed, self._memory_v1 = {}, [], set()
        for i in range(count):
            call = "nvmlDeviceGetHandleByIndex"
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                call = "nvmlDeviceGetUUID"
                uuid = _text(nv.nvmlDeviceGetUUID(h))
                call = "nvmlDeviceGetName"
                name = _text(nv.nvmlDeviceGetName(h))
            except nv.NVMLError as exc:
                self.failed.append(DeviceFailure(i, call, exc))
                log.warning(
                    "GPU could not be opened; serving the others",
                    extra={"fields": {"gpu": i, "call": call, "error": str(exc)}},
                )
                continue
            try:
                bus = _text(nv.nvmlDeviceGetPciInfo(h).busId)
            except nv.NVMLError:
                bus = ""
            try:
                minor = nv.nvmlDeviceGetMinorNumber(h)
            except nv.NVMLError:
                minor = -1  # unknown: matches no GKE or DRA device id
            self._handles[i] = h
            devices.append(DeviceInfo(i, uuid, name, minor, bus))
        self._by_handle = {_handle_key(h): i for i, h in self._handles.items()}
        return devices

    def read(self, index: int, guard: Guard) -> RawGpu:
        nv = self.nv
        h = self._handles[index]
        raw = RawGpu()
        mem = guard("nvmlDeviceGetMemoryInfo", lambda: self._memory(index, h))
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
        raw.gpu_temp = guard("nvmlDeviceGetTemperature", lambda: self._gpu_temp(h))
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

    def _memory(self, index: int, h: Any) -> Any:
        """Memory info v2 (total, reserved, free, used); v1 on a GPU or driver without v2, where
        "used" includes the reserved memory and no reserved figure exists. Decided per GPU."""
        nv = self.nv
        if index not in self._memory_v1:
            try:
                return nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)
            except (nv.NVMLError_FunctionNotFound, nv.NVMLError_NotSupported):
                self._memory_v1.add(index)
                log.info(
                    "NVML memory info v2 unavailable on this GPU; using v1 (no reserved figure)",
                    extra={"fields": {"gpu": index}},
                )
        return nv.nvmlDeviceGetMemoryInfo(h)

    def _gpu_temp(self, h: Any) -> int:
        # nvmlDeviceGetTemperature is marked for removal (CUDA 14); V is the versioned call that
        # replaces it. Drivers older than V do not export it (FunctionNotFound) or may not know
        # its struct version: then, and only then, the old call.
        nv = self.nv
        versioned = getattr(nv, "nvmlDeviceGetTemperatureV", None)
        if versioned is not None and not self._old_temperature:
            try:
                return int(versioned(h, nv.NVML_TEMPERATURE_GPU))
            except (nv.NVMLError_FunctionNotFound, nv.NVMLError_ArgumentVersionMismatch):
                self._old_temperature = True
        return nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)

    def _memory_temp(self, h: Any) -> int | None:
        nv = self.nv
        (fv,) = nv.nvmlDeviceGetFieldValues(h, [nv.NVML_FI_DEV_MEMORY_TEMP])
        if fv.nvmlReturn != nv.NVML_SUCCESS:
            raise nv.NVMLError(fv.nvmlReturn)  # NotSupported on GDDR boards: dropped quietly
        return memory_temp(nv, fv)

    def processes(self, index: int) -> list[GpuProcess]:
        procs = self.nv.nvmlDeviceGetComputeRunningProcesses(self._handles[index])
        return [GpuProcess(p.pid, p.usedGpuMemory) for p in procs if p.usedGpuMemory is not None]

    def watch_xids(
        self, stop: threading.Event, record: Callable[[int, int], None], error: Callable[[str], None]
    ) -> None:
        """Reads XID critical-error events until ``stop`` is set.

        Every GPU shares one event set, and after an Xid 79 the wait answers GPU_IS_LOST at once
        and forever. So a failed wait frees the set and builds a new one from the GPUs that
        still accept registration: the lost GPU drops out and the others are watched again."""
        nv = self.nv
        while not stop.is_set():
            event_set = nv.nvmlEventSetCreate()
            try:
                registered, failed = self._register(event_set, error)
                if not registered and not failed:
                    return  # no GPU here has XID events: nothing to watch, nothing to retry
                if not registered:
                    stop.wait(XID_NONE_REGISTERED_S)
                    continue
                self._wait_events(event_set, stop, record, error)
            finally:
                try:
                    nv.nvmlEventSetFree(event_set)
                except nv.NVMLError:
                    pass
            stop.wait(XID_REBUILD_S)

    def _register(self, event_set: Any, error: Callable[[str], None]) -> tuple[int, int]:
        """(GPUs registered, GPUs whose registration failed); unsupported ones count in neither."""
        nv = self.nv
        registered = failed = 0
        for i, h in self._handles.items():
            try:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, event_set)
                registered += 1
            except nv.NVMLError_NotSupported:
                log.info("XID events not supported on this GPU", extra={"fields": {"gpu": i}})
            except nv.NVMLError as exc:
                failed += 1
                error("nvmlDeviceRegisterEvents")
                log.warning("cannot watch XID events", extra={"fields": {"gpu": i, "error": str(exc)}})
        return registered, failed

    def _wait_events(
        self,
        event_set: Any,
        stop: threading.Event,
        record: Callable[[int, int], None],
        error: Callable[[str], None],
    ) -> None:
        """Waits on one event set until stop, or until a wait fails (then the set is rebuilt)."""
        nv = self.nv
        while not stop.is_set():
            try:
                data = nv.nvmlEventSetWait_v2(event_set, XID_WAIT_MS)
            except nv.NVMLError_Timeout:
                continue
            except nv.NVMLError as exc:
                error("nvmlEventSetWait")
                log.warning(
                    "XID event wait failed; rebuilding the event set", extra={"fields": {"error": str(exc)}}
                )
                return
            if data.eventType & nv.nvmlEventTypeXidCriticalError:
                gpu = self._by_handle.get(_handle_key(data.device))
                if gpu is not None:
                    record(gpu, int(data.eventData))

    def shutdown(self) -> None:
        try:
            self.nv.nvmlShutdown()
        except self.nv.NVMLError:
            pass


def _handle_key(handle: Any) -> int:
    # Handles are ctypes pointers; equal devices have equal addresses.
    import ctypes

    return ctypes.cast(handle, ctypes.c_void_p).value or 0


def memory_temp(nv: Any, fv: Any) -> int | None:
    """Memory temperature from a field value, read as DCGM reads it: the unsigned integer, not
    the member ``valueType`` names. A driver bug (r545) tags this integer field as a double, and
    reading ``dVal`` then gives a denormal that truncates to 0 °C. Only a tag of double with a
    plausible ``dVal`` (1 to 200) is taken as a double the driver really wrote. A value over 200
    is not a temperature and is dropped (None), as DCGM drops it."""
    if fv.valueType == getattr(nv, "NVML_VALUE_TYPE_DOUBLE", 0) and 1.0 <= fv.value.dVal <= MEMORY_TEMP_MAX_C:
        return round(fv.value.dVal)
    value = int(fv.value.uiVal)  # the 32 bits the driver writes; the rest of the union is not its
    return value if value <= MEMORY_TEMP_MAX_C else None
