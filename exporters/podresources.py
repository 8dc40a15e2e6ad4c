"""Which container each GPU is allocated to, from the kubelet's pod-resources API (as dcgm-exporter does).

The kubelet serves ``v1.PodResourcesLister/List`` on a unix socket
(``/var/lib/kubelet/pod-resources/kubelet.sock``). Its answer names every pod's containers and
the devices they were given: device-plugin ids for ``nvidia.com/*`` resources (a UUID, with a
``::<n>`` suffix under time-slicing; an index; GKE's ``nvidia<minor>[/vgpu<n>]``) and DRA devices
of NVIDIA's DRA driver (``gpu-<minor>``). A GPU allocated to exactly one container gets that
container's ``pod``, ``namespace`` and ``container`` labels on its dcgm series; a GPU shared by
several, or by none, gets none (per-pod figures for shared GPUs are in the per-process metric).

The response is decoded by hand (a few nested length-delimited fields) so the exporter carries no
generated protobuf code; grpc is imported only when the socket exists.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from exporters.model import DeviceInfo

log = logging.getLogger("inferwatch.gpu_exporter")

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
LIST_METHOD = "/v1.PodResourcesLister/List"
GPU_RESOURCE_PREFIX = "nvidia.com/"

Owner = tuple[str, str, str]  # (namespace, pod, container)


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(buf):
            raise ValueError("truncated varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _fields(buf: bytes) -> Iterator[tuple[int, bytes | int]]:
    """(field number, value) of a protobuf message; unknown wire types raise ValueError."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
            yield number, value
        elif wire == 2:
            n, i = _varint(buf, i)
            if i + n > len(buf):
                raise ValueError("truncated field")
            yield number, buf[i : i + n]
            i += n
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")


def _strings(buf: bytes, number: int) -> list[str]:
    return [v.decode() for n, v in _fields(buf) if n == number and isinstance(v, bytes)]


def _messages(buf: bytes, number: int) -> list[bytes]:
    return [v for n, v in _fields(buf) if n == number and isinstance(v, bytes)]


DRA_GPU_DRIVER = "gpu.nvidia.com"  # NVIDIA's DRA driver, as dcgm-exporter filters it


@dataclass(frozen=True, slots=True)
class Allocation:
    """One device given to one container: a device-plugin id or a DRA device name."""

    device_id: str  # e.g. "GPU-<uuid>", "GPU-<uuid>::2", "nvidia0", "nvidia0/vgpu1", "0", "gpu-0"
    owner: Owner
    dra: bool = False  # device_id is a DRA device name (from dynamic_resources)


def parse_list_response(buf: bytes) -> list[Allocation]:
    """Every NVIDIA device allocation in a ListPodResourcesResponse: device-plugin devices of
    ``nvidia.com/*`` resources and DRA devices of NVIDIA's DRA driver."""
    out: list[Allocation] = []
    for pod in _messages(buf, 1):  # repeated PodResources pod_resources = 1
        name = next(iter(_strings(pod, 1)), "")
        namespace = next(iter(_strings(pod, 2)), "")
        for container in _messages(pod, 3):  # repeated ContainerResources containers = 3
            owner = (namespace, name, next(iter(_strings(container, 1)), ""))
            for devices in _messages(container, 2):  # repeated ContainerDevices devices = 2
                resource = next(iter(_strings(devices, 1)), "")
                if resource.startswith(GPU_RESOURCE_PREFIX):
                    out.extend(Allocation(d, owner) for d in _strings(devices, 2))
            for dynamic in _messages(container, 5):  # repeated DynamicResource dynamic_resources = 5
                for claim in _messages(dynamic, 4):  # repeated ClaimResource claim_resources = 4
                    # ClaimResource: driver_name = 2, pool_name = 3, device_name = 4
                    if next(iter(_strings(claim, 2)), "") == DRA_GPU_DRIVER:
                        out.extend(Allocation(d, owner, dra=True) for d in _strings(claim, 4))
    return out


_GKE = re.compile(r"nvidia(\d+)(?:/vgpu\d+)?")  # GKE's plugin: /dev/nvidia<minor>, shared as /vgpuN
_DRA_GPU = re.compile(r"gpu-(\d+)")  # NVIDIA's DRA driver: gpu-<minor> (gpu-<minor>-mig-... for MIG)
_INDEX = re.compile(r"\d+")  # NVIDIA's device plugin with --device-id-strategy=index


def resolve(alloc: Allocation, devices: Sequence[DeviceInfo]) -> DeviceInfo | None:
    """The GPU an allocation names, or None (MIG devices, GKE MIG partitions, unknown ids).

    Each id type is what its allocator means by it: a UUID (NVIDIA's device plugin, default),
    an NVML index (its index strategy), /dev/nvidia<minor> (GKE), or the DRA driver's
    ``gpu-<minor>``. Sharing suffixes (``::<n>`` time-slicing replicas, ``/vgpu<n>``) name the
    same GPU."""
    device_id = alloc.device_id
    if alloc.dra:
        m = _DRA_GPU.fullmatch(device_id)
        return next((d for d in devices if d.minor == int(m.group(1))), None) if m else None
    base = device_id.split("::", 1)[0]
    if base.startswith("GPU-"):
        return next((d for d in devices if d.uuid == base), None)
    m = _GKE.fullmatch(base)
    if m:
        return next((d for d in devices if d.minor == int(m.group(1))), None)
    if _INDEX.fullmatch(base):
        return next((d for d in devices if d.index == int(base)), None)
    return None


def owners_by_gpu(allocations: Sequence[Allocation], devices: Sequence[DeviceInfo]) -> dict[int, list[Owner]]:
    """GPU index -> the distinct containers it is allocated to."""
    owners: dict[int, list[Owner]] = {}
    for alloc in allocations:
        dev = resolve(alloc, devices)
        if dev is not None:
            found = owners.setdefault(dev.index, [])
            if alloc.owner not in found:
                found.append(alloc.owner)
    return owners


def list_pod_resources(socket_path: str, timeout_s: float = 5.0) -> bytes:
    import grpc  # about 20 MiB resident: only on nodes that have the kubelet socket

    with grpc.insecure_channel(f"unix://{socket_path}") as channel:
        call = channel.unary_unary(LIST_METHOD, request_serializer=None, response_deserializer=None)
        return call(b"", timeout=timeout_s)


class PodResourcesWatcher:
    """Refreshes the NVIDIA device allocations in a background thread; ``on_change`` gets the
    whole list when it changes."""

    def __init__(
        self,
        socket_path: str,
        interval_s: float,
        on_change: Callable[[list[Allocation]], None],
        on_error: Callable[[BaseException], None],
        fetch: Callable[[str], bytes] = list_pod_resources,
    ) -> None:
        self._socket = socket_path
        self._interval = interval_s
        self._on_change = on_change
        self._on_error = on_error
        self._fetch = fetch
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: list[Allocation] | None = None

    @staticmethod
    def available(socket_path: str) -> bool:
        return bool(socket_path) and Path(socket_path).exists() and os.access(socket_path, os.R_OK | os.W_OK)

    def refresh(self) -> None:
        allocations = parse_list_response(self._fetch(self._socket))
        if allocations != self._last:
            self._last = allocations
            self._on_change(allocations)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception as exc:  # the kubelet restarting must not stop the exporter
                self._on_error(exc)
            self._stop.wait(self._interval)

    def start(self) -> None:
        log.info("reading GPU allocations from the kubelet", extra={"fields": {"socket": self._socket}})
        self._thread = threading.Thread(target=self._run, name="gpu-pod-resources", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
