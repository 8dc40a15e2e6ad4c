"""Simulated GPUs for hosts without one: values that move plausibly with a load signal.

Each GPU follows a load in [0, 1]: by default a slow wave (a 10-minute period, each GPU out of
phase), or a value pinned through ``POST /simulate``. Utilization, power and the SM clock follow
the load at once, temperature lags it by about a minute, energy integrates power, and memory use
grows with load unless a framebuffer ratio is forced (the local stack does this to fire the
GPU-memory alert). Readings are in NVML's units, so they pass through the same conversion as real ones.
"""

from __future__ import annotations

import hashlib
import math
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from exporters.model import DeviceInfo, GpuProcess, Guard, RawGpu

MIB = 1024 * 1024
WAVE_PERIOD_S = 600.0
TEMP_TIME_CONSTANT_S = 60.0


class NotSupportedError(Exception):
    """What a simulated GPU raises for a call its real counterpart does not support."""


@dataclass(frozen=True, slots=True)
class GpuModel:
    name: str  # as NVML reports it
    total_mib: int
    reserved_mib: int
    idle_w: float
    max_w: float
    sm_idle_mhz: int
    sm_max_mhz: int
    mem_mhz: int
    hbm: bool  # HBM boards report a memory temperature; GDDR boards do not


# Totals as nvidia-smi shows them; reserved, power and clocks are typical, not exact.
MODELS: dict[str, GpuModel] = {
    "H200": GpuModel("NVIDIA H200", 143771, 582, 75, 700, 345, 1980, 3201, True),
    "H100": GpuModel("NVIDIA H100 80GB HBM3", 81559, 529, 70, 700, 345, 1980, 2619, True),
    "A100": GpuModel("NVIDIA A100-SXM4-80GB", 81920, 563, 55, 400, 210, 1410, 1593, True),
    "A100-40GB": GpuModel("NVIDIA A100-SXM4-40GB", 40960, 511, 50, 400, 210, 1410, 1215, True),
    "L4": GpuModel("NVIDIA L4", 23034, 325, 16, 72, 210, 2040, 6251, False),
    "A10G": GpuModel("NVIDIA A10G", 23028, 366, 18, 300, 210, 1710, 6251, False),
    "T4": GpuModel("Tesla T4", 15360, 265, 10, 70, 300, 1590, 5001, False),
}


def model_names() -> list[str]:
    return list(MODELS)


@dataclass(slots=True)
class _Gpu:
    rng: random.Random
    phase: float
    load: float | None = None  # pinned load, or None for the wave
    fb_used_ratio: float | None = None  # forced used/total, or None to follow the load
    temp: float = 0.0
    energy_mj: float = 0.0
    last_t: float = 0.0
    last_power_w: float = 0.0


class SimulatedBackend:
    name = "simulated"
    may_block = False
    not_supported = (NotSupportedError,)
    driver_version = ""  # no driver: no driver-version label (dcgm-exporter drops blanks)

    def __init__(
        self,
        gpus: int = 1,
        model: str = "H200",
        hostname: str = "",
        clock: Callable[[], float] = time.monotonic,
        seed: int = 0,
    ) -> None:
        if gpus < 1:
            raise ValueError("the simulated backend needs at least one GPU")
        key = next((k for k in MODELS if k.lower() == model.lower()), None)
        if key is None:
            raise ValueError(f"unknown GPU model {model!r} (known: {', '.join(MODELS)})")
        self.model = MODELS[key]
        self._n = gpus
        self._clock = clock
        self._lock = threading.Lock()
        self._seed_text = f"{hostname}:{key}:{seed}"
        self._gpus: list[_Gpu] = []
        self.failed: list = []

    def init(self) -> list[DeviceInfo]:
        now = self._clock()
        m = self.model
        devices = []
        self._gpus = []
        for i in range(self._n):
            digest = hashlib.sha256(f"{self._seed_text}:{i}".encode()).digest()
            rng = random.Random(digest)
            g = _Gpu(rng=rng, phase=2 * math.pi * i / max(self._n, 1), last_t=now)
            g.temp = 30.0 + 45.0 * self._wave_load(g, now)
            g.energy_mj = rng.uniform(1e9, 5e10)  # "since boot"
            g.last_power_w = m.idle_w
            self._gpus.append(g)
            devices.append(
                DeviceInfo(
                    index=i,
                    uuid=f"GPU-{uuid.UUID(bytes=digest[:16])}",
                    name=m.name,
                    minor=i,
                    pci_bus_id=f"00000000:{0x18 + i * 0x10 & 0xFF:02X}:00.0",
                )
            )
        return devices

    @staticmethod
    def _wave_load(g: _Gpu, t: float) -> float:
        return 0.5 + 0.35 * math.sin(2 * math.pi * t / WAVE_PERIOD_S + g.phase)

    def read(self, index: int, guard: Guard) -> RawGpu:
        with self._lock:
            return self._read(index, guard)

    def _read(self, index: int, guard: Guard) -> RawGpu:
        m, g = self.model, self._gpus[index]
        now = self._clock()
        dt = max(0.0, now - g.last_t)
        load = g.load if g.load is not None else self._wave_load(g, now)
        noise = g.rng.uniform
        util = min(100, max(0, round(100 * load + noise(-3, 3)))) if load > 0 else 0
        power_w = m.idle_w + (m.max_w - m.idle_w) * load**0.9 + noise(-2, 2)
        target = 30.0 + 45.0 * load
        g.temp += (target - g.temp) * (1 - math.exp(-dt / TEMP_TIME_CONSTANT_S))
        g.energy_mj += (g.last_power_w + power_w) / 2 * dt * 1000
        g.last_t, g.last_power_w = now, power_w

        total = m.total_mib * MIB
        reserved = m.reserved_mib * MIB
        ratio = g.fb_used_ratio if g.fb_used_ratio is not None else 0.08 + 0.5 * load
        used = min(total - reserved, round(ratio * m.total_mib) * MIB)
        raw = RawGpu()

        def unsupported() -> int:
            raise NotSupportedError("memory temperature")

        mem = guard("nvmlDeviceGetMemoryInfo", lambda: (total, reserved, total - reserved - used, used))
        if mem is not None:
            raw.mem_total, raw.mem_reserved, raw.mem_free, raw.mem_used = mem
        util_pair = guard("nvmlDeviceGetUtilizationRates", lambda: (util, round(util * 0.55)))
        if util_pair is not None:
            raw.util_gpu, raw.util_mem = util_pair
        raw.util_enc = guard("nvmlDeviceGetEncoderUtilization", lambda: 0)
        raw.util_dec = guard("nvmlDeviceGetDecoderUtilization", lambda: 0)
        sm = m.sm_idle_mhz if util == 0 else m.sm_max_mhz - (15 * round(max(0.0, g.temp - 70)))
        raw.sm_clock = guard("nvmlDeviceGetClockInfo(SM)", lambda: sm)
        raw.mem_clock = guard("nvmlDeviceGetClockInfo(MEM)", lambda: m.mem_mhz)
        raw.gpu_temp = guard("nvmlDeviceGetTemperature", lambda: round(g.temp))
        raw.mem_temp = guard(
            "nvmlDeviceGetFieldValues(MEMORY_TEMP)", (lambda: round(g.temp) + 4) if m.hbm else unsupported
        )
        raw.power_mw = guard("nvmlDeviceGetPowerUsage", lambda: round(power_w * 1000))
        raw.energy_mj = guard("nvmlDeviceGetTotalEnergyConsumption", lambda: int(g.energy_mj))
        raw.pcie_replay = guard("nvmlDeviceGetPcieReplayCounter", lambda: 0)
        rows = guard("nvmlDeviceGetRemappedRows", lambda: (0, 0, 0, 0))
        if rows is not None:
            raw.remap_correctable, raw.remap_uncorrectable, _pending, raw.remap_failure = rows
        return raw

    def processes(self, index: int) -> list[GpuProcess]:
        return []  # simulated GPUs run no processes; per-pod memory needs a real GPU

    def shutdown(self) -> None:
        pass

    # -- what POST /simulate changes -----------------------------------------------------
    @property
    def gpu_count(self) -> int:
        return self._n

    def set_load(self, gpus: Sequence[int], load: float | None) -> None:
        with self._lock:
            for i in gpus:
                self._gpus[i].load = load

    def set_fb_used_ratio(self, gpus: Sequence[int], ratio: float | None) -> None:
        with self._lock:
            for i in gpus:
                self._gpus[i].fb_used_ratio = ratio

    def state(self) -> list[dict[str, object]]:
        with self._lock:
            return [
                {"gpu": i, "load": g.load, "fb_used_ratio": g.fb_used_ratio} for i, g in enumerate(self._gpus)
            ]
