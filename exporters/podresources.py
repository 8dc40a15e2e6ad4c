"""Which container each GPU is allocated to, from the kubelet's pod-resources API (as dcgm-exporter does).

The kubelet serves ``v1.PodResourcesLister/List`` on a unix socket
(``/var/lib/kubelet/pod-resources/kubelet.sock``). Its answer names every pod's containers and
the device ids they were given; for ``nvidia.com/*`` resources those are GPU UUIDs (with a
``::<n>`` suffix under time-slicing). A GPU allocated to exactly one container gets that
container's ``pod``, ``namespace`` and ``container`` labels on its dcgm series; a GPU shared by
several, or by none, gets none (per-pod figures for shared GPUs are in the per-process metric).

The response is decoded by hand (a few nested length-delimited fields) so the exporter carries no
generated protobuf code; grpc is imported only when the socket exists.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

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


def parse_list_response(buf: bytes) -> dict[str, list[Owner]]:
    """GPU UUID -> the containers it is allocated to, from a ListPodResourcesResponse."""
    owners: dict[str, list[Owner]] = {}
    for pod in _messages(buf, 1):  # repeated PodResources pod_resources = 1
        name = next(iter(_strings(pod, 1)), "")
        namespace = next(iter(_strings(pod, 2)), "")
        for container in _messages(pod, 3):  # repeated ContainerResources containers = 3
            cname = next(iter(_strings(container, 1)), "")
            for devices in _messages(container, 2):  # repeated ContainerDevices devices = 2
                resource = next(iter(_strings(devices, 1)), "")
                if not resource.startswith(GPU_RESOURCE_PREFIX):
                    continue
                for device_id in _strings(devices, 2):
                    uuid = device_id.split("::", 1)[0]  # time-slicing replicas: GPU-<uuid>::<n>
                    owner = (namespace, name, cname)
                    if owner not in owners.setdefault(uuid, []):
                        owners[uuid].append(owner)
    return owners


def list_pod_resources(socket_path: str, timeout_s: float = 5.0) -> bytes:
    import grpc  # about 20 MiB resident: only on nodes that have the kubelet socket

    with grpc.insecure_channel(f"unix://{socket_path}") as channel:
        call = channel.unary_unary(LIST_METHOD, request_serializer=None, response_deserializer=None)
        return call(b"", timeout=timeout_s)


class PodResourcesWatcher:
    """Refreshes GPU UUID -> owner in a background thread; ``owner(uuid)`` is a dict lookup."""

    def __init__(
        self,
        socket_path: str,
        interval_s: float,
        on_change: Callable[[dict[str, Owner]], None],
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
        self._last: dict[str, Owner] | None = None

    @staticmethod
    def available(socket_path: str) -> bool:
        return bool(socket_path) and Path(socket_path).exists() and os.access(socket_path, os.R_OK | os.W_OK)

    def refresh(self) -> None:
        owners = parse_list_response(self._fetch(self._socket))
        single = {uuid: found[0] for uuid, found in owners.items() if len(found) == 1}
        if single != self._last:
            self._last = single
            self._on_change(single)

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
