"""Per-call bookkeeping of the gRPC relay (``sidecar.protocols.grpc_relay``): one ``Call`` per HTTP/2
stream, and the calls the upstream refused, each waiting for the client's retry.

Nothing here reads or writes bytes; the relay feeds these objects what it read.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any

from sidecar.protocols.grpc_methods import span_attributes
from sidecar.protocols.grpc_streams import StreamMatcher
from sidecar.protocols.grpc_tokens import StreamTokens
from sidecar.protocols.grpc_wire import MessageScanner

# Method kinds: a unary method of the service (one message each way), ModelStreamInfer (one
# observation per message), anything else (one observation per call, no model).
UNARY, STREAM, OTHER = 0, 1, 2

# Span name and attributes per method path, built once.
_SPANS: dict[str, tuple[str, dict[str, str]]] = {}


class Call:
    """One HTTP/2 stream (one gRPC call) between ``begin`` and its trailers."""

    __slots__ = (
        "admit_later",
        "admitted",
        "answer",
        "block",
        "charge",
        "charged",
        "counted",
        "data_in",
        "deadline",
        "dropped",
        "fields",
        "headers_out",
        "hole",
        "kind",
        "path",
        "pending",
        "prompt",
        "req_bytes",
        "resp_bytes",
        "scan_in",
        "scan_out",
        "span",
        "tel",
        "tokens",
        "traceparent",
    )

    def __init__(self, path: str, kind: int, fields: tuple[int, int], traceparent: str | None) -> None:
        self.path = path
        self.kind = kind
        self.fields = fields
        self.traceparent = traceparent
        span = _SPANS.get(path)
        if span is None:
            span = span_attributes(path)
            if len(_SPANS) < 256:  # bounded: clients choose paths
                _SPANS[path] = span
        self.span = span
        self.tel: Any = None
        self.req_bytes = 0
        self.resp_bytes = 0
        self.scan_in: MessageScanner | None = MessageScanner() if kind != OTHER else None
        self.scan_out: MessageScanner | None = MessageScanner() if kind == STREAM else None
        self.pending: StreamMatcher | None = StreamMatcher() if kind == STREAM else None
        self.tokens: StreamTokens | None = None  # ModelStreamInfer with LLM telemetry: token timing
        self.headers_out = False  # response headers went to the client
        self.dropped = False  # the relay answered this call itself; later frames are dropped
        self.counted = False  # holds a place in the in-flight limit
        # Per-model limits (sidecar.core.admission): the model it was admitted under, and whether its
        # admission waits for its (first) message: a unary call's header block is held meanwhile,
        # as with tracing; a stream's goes up at once.
        self.admitted = ""
        self.admit_later = False
        self.answer: tuple[str, str] | None = None  # the relay's own answer, sent once the model is known
        # A model's tokens bucket: the charge of the (first) message while its bytes go by, the
        # call admitted (under ``admitted``) on the message's last byte; and the DATA bytes seen
        # before the message's head came (where its bytes after the head begin).
        self.charge: Any = None
        self.data_in = 0
        # A stream admitted with a tokens charge: the charge and its prompt estimate, for the
        # refund at its end (the tokens it was sent are what it used of max_tokens).
        self.charged = 0
        self.prompt = 0
        self.deadline: float | None = None
        # With tracing, a unary call's header block waits for its message: its place in the
        # connection's held output (-1: not waiting) and the block, edited, without traceparent.
        self.hole = -1
        self.block = b""


class RefusedCalls:
    """Calls the upstream refused unprocessed (RST_STREAM REFUSED_STREAM), by method path,
    oldest first. A client's retry policy sends such a call again: its observation waits
    ``wait_s`` for that retry, which continues it (``resume``), so the call is counted once,
    with the latency the client saw. Without a retry, ``close`` counts it (UNAVAILABLE, what
    the client got)."""

    __slots__ = ("by_path", "wait_s")

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        # path -> deque of [observation or None, close, timer]
        self.by_path: dict[str, collections.deque] = {}

    def __bool__(self) -> bool:
        return bool(self.by_path)

    def park(self, path: str, tel: Any, close: Callable[[], None]) -> None:
        entry: list = [tel, close, None]
        entry[2] = asyncio.get_running_loop().call_later(self.wait_s, self._expired, path, entry)
        self.by_path.setdefault(path, collections.deque()).append(entry)

    def resume(self, path: str) -> Any:
        """The observation of a refused call that a new call on ``path`` retries, if any."""
        queue = self.by_path.get(path)
        if not queue:
            return None
        tel, _close, timer = queue.popleft()
        if not queue:
            del self.by_path[path]
        timer.cancel()
        return tel

    def expire_all(self) -> None:
        for queue in list(self.by_path.values()):
            for _obs, close, timer in queue:
                timer.cancel()
                close()
        self.by_path.clear()

    def _expired(self, path: str, entry: list) -> None:
        queue = self.by_path.get(path)
        if queue is None or entry not in queue:
            return
        queue.remove(entry)
        if not queue:
            del self.by_path[path]
        entry[1]()
