"""One daemon thread per GPU for calls that can hang inside the driver, and a bounded wait on them.

Both the scrape's reads and the per-pod process listings use it: a call hung on one GPU holds
only that GPU's worker, the caller waits no longer than its deadline, and a GPU whose previous
call is still hung is not called again until it returns (so hung threads do not pile up).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any, TypeVar

T = TypeVar("T")

# Outcome of one bounded call
DONE, TIMEOUT, STALLED = "done", "timeout", "stalled"


class Worker:
    """A daemon thread running one GPU's calls in turn. Daemon, unlike a ThreadPoolExecutor's
    workers, so a call hung inside NVML cannot hold the process open after SIGTERM."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()
        self._jobs.put((fn, fut))
        return fut

    def close(self) -> None:
        """Ends the thread once its current call (if any) returns."""
        self._jobs.put(None)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, fut = job
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:
                    fut.set_exception(exc)


class PerGpuCalls:
    """Workers keyed by GPU index, with at most one call in flight on each."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._workers: dict[int, Worker] = {}
        self._inflight: dict[int, Future[Any]] = {}

    def run(self, calls: Mapping[int, Callable[[], T]], timeout_s: float) -> dict[int, tuple[str, T | None]]:
        """Runs each GPU's call on its worker and waits up to ``timeout_s`` for all of them.
        Per GPU: (DONE, value), (TIMEOUT, None) or (STALLED, None) when the previous call is
        still running. A call that raised is DONE with the exception re-raised by ``result``:
        callers pass functions that do not raise."""
        futures: dict[int, Future[Any]] = {}
        out: dict[int, tuple[str, T | None]] = {}
        for index, fn in calls.items():
            prev = self._inflight.get(index)
            if prev is not None and not prev.done():
                out[index] = (STALLED, None)
                continue
            worker = self._workers.get(index)
            if worker is None:
                worker = self._workers[index] = Worker(f"{self._prefix}-{index}")
            futures[index] = self._inflight[index] = worker.submit(fn)
        wait_futures(list(futures.values()), timeout=max(0.0, timeout_s))
        for index, fut in futures.items():
            out[index] = (DONE, fut.result()) if fut.done() else (TIMEOUT, None)
        return out

    def close(self) -> None:
        for w in self._workers.values():
            w.close()
        self._workers.clear()
        self._inflight.clear()
