"""What a backend gives the collector: static device facts and one reading per GPU, in NVML's units.

Both backends (NVML and simulated) fill the same ``RawGpu`` in the units NVML returns (bytes,
milliwatts, millijoules, MHz, percent), so the conversion to dcgm-exporter's units lives in one
place (``exporters.convert``) and is tested from recorded readings without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """Facts about one GPU that do not change while the exporter runs."""

    index: int
    uuid: str
    name: str  # NVML's product name, e.g. "NVIDIA H100 80GB HBM3" (dcgm-exporter's modelName)
    # /dev/nvidia<minor>: what GKE's device ids ("nvidia0") and the DRA driver's device names
    # ("gpu-0") count. dcgm-exporter's device label is "nvidia<index>", not this.
    minor: int
    pci_bus_id: str = ""


@dataclass(frozen=True, slots=True)
class DeviceFailure:
    """A GPU that NVML counts but that could not be opened at start (e.g. GPU_IS_LOST)."""

    index: int
    call: str
    error: BaseException


@dataclass(slots=True)
class RawGpu:
    """One reading of one GPU; None means "not read" (unsupported, failed or timed out)."""

    mem_total: int | None = None  # bytes, nvmlDeviceGetMemoryInfo v2
    mem_reserved: int | None = None
    mem_free: int | None = None
    mem_used: int | None = None
    util_gpu: int | None = None  # percent, nvmlDeviceGetUtilizationRates
    util_mem: int | None = None
    util_enc: int | None = None  # percent, nvmlDeviceGetEncoderUtilization
    util_dec: int | None = None
    sm_clock: int | None = None  # MHz
    mem_clock: int | None = None
    gpu_temp: int | None = None  # degrees C
    mem_temp: int | None = None
    power_mw: int | None = None  # milliwatts
    energy_mj: int | None = None  # millijoules since the driver loaded
    pcie_replay: int | None = None
    remap_correctable: int | None = None
    remap_uncorrectable: int | None = None
    remap_failure: int | None = None  # 0 or 1


class Guard(Protocol):
    """Runs one backend call for one GPU: returns its value, or None when it is unsupported
    (dropped quietly, asked again after a while) or failed (counted by call and GPU)."""

    def __call__(self, call: str, fn: Callable[[], T]) -> T | None: ...


@dataclass(frozen=True, slots=True)
class GpuProcess:
    pid: int
    used_bytes: int


class Backend(Protocol):
    """A source of GPU readings. ``init`` may raise; every other method is called only after
    ``init`` succeeded. ``read`` must route each device call through ``guard``."""

    name: str  # the value of the backend label: "nvml" or "simulated"
    # True when a call can block for long (NVML on a GPU that fell off the bus): reads then run
    # on worker threads so a scrape can give up on one GPU at its deadline.
    may_block: bool
    # Exceptions meaning "this GPU does not support this call".
    not_supported: tuple[type[BaseException], ...]

    def init(self) -> list[DeviceInfo]: ...

    # After ``init``: GPUs counted but not opened, and the driver's version ("" if unknown).
    failed: list[DeviceFailure]
    driver_version: str

    def read(self, index: int, guard: Guard) -> RawGpu: ...

    def processes(self, index: int) -> list[GpuProcess]: ...

    def shutdown(self) -> None: ...


class XidWatcher(Protocol):
    """Blocks reading XID events until ``stop`` is set; ``record(gpu_index, xid)`` per event,
    ``error(call)`` per failed event call. Backends without events have no watcher."""

    def __call__(
        self, stop: Any, record: Callable[[int, int], None], error: Callable[[str], None]
    ) -> None: ...
