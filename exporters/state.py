"""Counters the exporter keeps between scrapes: backend errors by call and GPU, XID events by GPU and code.

Both are written by worker threads and read by the scrape; each holds a lock only for a dict
update or a copy.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("inferwatch.gpu_exporter")

NO_GPU = ""  # the gpu label of a call that concerns no single GPU (nvmlInit, event wait)


class ErrorCounter:
    """Failed backend calls, by (call, gpu). Logs the first failure of each pair at warning."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}

    def add(self, call: str, gpu: str, exc: BaseException | None = None) -> None:
        key = (call, gpu)
        with self._lock:
            n = self._counts.get(key, 0) + 1
            self._counts[key] = n
        if n == 1:
            log.warning(
                "backend call failed (counted in the errors metric from now on)",
                extra={"fields": {"call": call, "gpu": gpu, "error": repr(exc) if exc else ""}},
            )
        elif log.isEnabledFor(logging.DEBUG):
            log.debug("backend call failed", extra={"fields": {"call": call, "gpu": gpu, "error": repr(exc)}})

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)


class XidLog:
    """XID events seen since start: a count per (GPU index, XID code) and the last code per GPU."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[int, int], int] = {}
        self._last: dict[int, int] = {}

    def record(self, gpu: int, xid: int) -> None:
        with self._lock:
            self._counts[(gpu, xid)] = self._counts.get((gpu, xid), 0) + 1
            self._last[gpu] = xid
        log.warning("XID error", extra={"fields": {"gpu": gpu, "xid": xid}})

    def snapshot(self) -> tuple[dict[tuple[int, int], int], dict[int, int]]:
        with self._lock:
            return dict(self._counts), dict(self._last)
