"""The HTTP proxy: a lean asyncio protocol-level reverse proxy in front of one model server.

Per client connection one ``ClientConn`` (httptools request parser); per request one
``Exchange`` (the request's only state object); per upstream connection one
``UpstreamConn`` (httptools response parser) kept alive in a LIFO pool. Bodies stream
through chunk by chunk, never buffered whole: each read from one side becomes one write
to the other (head and first body bytes joined). One exception, only with per-model limits: an
LLM request (an OpenAI route, or Triton's generate of a model with a ``tokens`` bucket) is held
under the global limit until its body gives its model and token cost (``sidecar.apis.charge``,
at most ``charge.WINDOW`` bytes), then admitted for its model (``ClientConn.decide``); at its
end (``HttpProxy.end``) the tokens bucket gets back what it was charged and did not use.
Chunked bodies are re-framed chunk for chunk, so the bytes of a body (JSON or Triton's binary
tensor extension) arrive unchanged.

Hop-by-hop headers (RFC 9110 7.6.1: Connection and what it names, Keep-Alive,
Proxy-Connection, TE, Transfer-Encoding, Upgrade, Trailer, Proxy-Authorization,
Proxy-Authenticate) are dropped; ``Expect: 100-continue`` is answered here; ``Via`` is
added. The model and version come from ``/v2/models/{name}[/versions/{v}]/...`` or a
``--route`` pattern.

The sidecar's own answers, each counted like a proxied one:
400 malformed HTTP (then close), 408 a client too slow to send its head or body,
413 body over ``--max-body-bytes``, 431 head over ``--max-header-bytes``,
502 the upstream broke the exchange, 503 the upstream refused or did not accept the
connection (and ``upstream_up`` 0 until a connection succeeds again), 504 no complete
answer within ``--request-timeout``, and one fixed 503 overload answer past
``--max-in-flight`` / ``--max-connections``. A client that goes away cancels its upstream
request (counted as 499, client_error). Once an answer has started, a failure can only
close the connection.

Replays: a request goes again on a fresh upstream connection only when none of it reached
the server (its write to a pooled connection failed at once); safe methods (GET, HEAD,
OPTIONS) also when a pooled connection closed before any answer byte.

Drain (``begin_drain`` at SIGTERM, ``stop`` when the listener closes): every answer says
``Connection: close``; connections accepted meanwhile are served like any other; one whose
answer began before (without "close") waits for its client's next request; idle ones close
after ``DRAIN_IDLE_GRACE``.

Backpressure: a client's reading pauses while the upstream connection's write buffer is
above the high-water mark (or while it connects, or while a pipelined request waits), and
an upstream's reading pauses while the client is not draining its answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from http import HTTPStatus
from typing import TYPE_CHECKING
from urllib.parse import unquote

import httptools

from inferwatch import contract
from sidecar.apis.charge import WINDOW, prompt_estimate, used
from sidecar.core.admission import Admission, Refusal, Waiting
from sidecar.core.health import UpstreamHealth
from sidecar.core.overload import http_answer

if TYPE_CHECKING:
    from collections.abc import Callable

    from sidecar.apis.charge import Charge
    from sidecar.apis.routes import Api
    from sidecar.config import SidecarConfig
    from sidecar.core.streams import StreamExchange, StreamTelemetry
    from sidecar.core.telemetry import Request, Telemetry

log = logging.getLogger("inferwatch.sidecar.http")

PROTOCOL = contract.PROTOCOL_HTTP
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"transfer-encoding",
        b"upgrade",
        b"trailer",
        b"proxy-authorization",
        b"proxy-authenticate",
        b"expect",
    }
)
VIA = b"via: 1.1 inferwatch\r\n"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
HIGH_WATER = 256 * 1024  # bytes buffered towards a connecting upstream before the client pauses
REPLAY_LIMIT = 64 * 1024  # a request up to this size may be retried once on a stale pooled connection
# Methods that change nothing on the server (RFC 9110 9.2.1): replayed after a pooled connection
# closed without an answer even when the request may have reached the server (as Go's client
# does); any other request only when none of its bytes went out.
SAFE_METHODS = frozenset({b"GET", b"HEAD", b"OPTIONS"})
# During a drain, a connection idle this long (no request started) is closed.
DRAIN_IDLE_GRACE = 1.0
# A pooled upstream connection idle this long is not used again: well before the 5 s
# keep-alive timeout of uvicorn (vLLM's, SGLang's server) and Node, so such an upstream does not
# close a connection at the moment a request is written to it (a POST then could not be
# replayed: a 502). Well before, because the upstream's clock starts when it sent the answer's
# end and ours when we read it: on loaded cores a busy server's timer fires late and ours
# starts late. At 4 s, 32 vLLM streams on two loaded cores still met 3 to 14 such 502s in some
# runs (benchmarks/llm_streams.py); a new loopback connection costs far less than that.
POOL_IDLE_SECONDS = 2.0
SWEEP_INTERVAL = 0.25
MAX_CACHED_ROUTES = 4096  # paths whose labels are cached: a flood of distinct URLs only costs re-parsing

# Built once at import: status lines and status strings for every code.
_PHRASES = {s.value: s.phrase for s in HTTPStatus}
STATUS_LINE = {
    v: {code: f"HTTP/{v} {code} {_PHRASES.get(code, 'Status')}\r\n".encode() for code in range(100, 1000)}
    for v in ("1.1", "1.0")
}
STATUS_STR = tuple(str(i) for i in range(1000))

_ERRORS = {
    400: "malformed HTTP request",
    408: "request timeout: the client sent too slowly",
    413: "request body too large",
    431: "request header fields too large",
    499: "client closed the request",
    502: "bad gateway: the model server broke the exchange",
    503: "service unavailable: the model server cannot be reached",
    504: "gateway timeout: the model server did not answer in time",
}


def _error_bytes(status: int, message: str, close: bool) -> bytes:
    body = b'{"error":"' + message.encode() + b'"}'
    head = STATUS_LINE["1.1"][status] + b"content-type: application/json\r\ncontent-length: %d\r\n" % len(
        body
    )
    return head + (b"connection: close\r\n" if close else b"") + VIA + b"\r\n" + body


ERROR_RESPONSES = {(s, c): _error_bytes(s, m, c) for s, m in _ERRORS.items() for c in (True, False)}
OVERLOAD_RESPONSE = _error_bytes(503, "overloaded: the sidecar is at its request limit", True)
OVERLOAD_BODY_LEN = len(b'{"error":"overloaded: the sidecar is at its request limit"}')

_IDLE, _HEAD, _BODY, _WAIT, _LINGER = 0, 1, 2, 3, 4  # what a client connection's deadline guards
LINGER_SECONDS = 2.0  # after an early answer, unread input is drained this long so it is not lost to a reset


class _Reject(Exception):
    """Raised inside a parser callback to answer ``status`` and close."""

    def __init__(self, status: int) -> None:
        self.status = status


class Held:
    """An LLM request held before admission: its body's charge (``sidecar.apis.charge``), the
    model its path names ("" on an OpenAI route: the body names it) and its Content-Length."""

    __slots__ = ("charge", "length", "model")

    def __init__(self, charge: Charge, model: str, length: int) -> None:
        self.charge = charge
        self.model = model
        self.length = length


class _Halt(Exception):
    """Raised inside a parser callback once the connection was answered and closed: parse no
    further (a pipelined request behind it must not start)."""


# ------------------------------------------------------------------------------------------
# Labels from the URL
# ------------------------------------------------------------------------------------------
_V2 = b"/v2/models/"


def _text(raw: bytes) -> str:
    text = raw.decode("utf-8", "replace")
    return unquote(text) if "%" in text else text


def labels_from_path(path: bytes, routes: tuple = ()) -> tuple[str, str, str]:
    """(model, version, route template) for a request path (query removed).

    KServe v2: ``/v2/models/{name}[/versions/{v}]/...``; otherwise the first ``--route``
    regex that matches; otherwise no model ("").
    """
    if path.startswith(_V2):
        parts = path[len(_V2) :].split(b"/", 3)
        name = parts[0]
        if not name or (name == b"stats" and len(parts) == 1):
            return "", "", "/v2/models/" + _text(name)
        if len(parts) >= 3 and parts[1] == b"versions":
            rest = "/" + _text(parts[3]) if len(parts) > 3 else ""
            return _text(name), _text(parts[2]), "/v2/models/{model}/versions/{version}" + rest
        rest = "/" + "/".join(_text(p) for p in parts[1:]) if len(parts) > 1 else ""
        return _text(name), "", "/v2/models/{model}" + rest
    if routes:
        text = _text(path)
        for route in routes:
            m = route.pattern.search(text)
            if m:
                groups = m.groupdict()
                return groups.get("model") or "", groups.get("version") or "", route.pattern.pattern
    return "", "", ""


# ------------------------------------------------------------------------------------------
# One request
# ------------------------------------------------------------------------------------------
class Exchange:
    """One request and its answer: the only per-request state."""

    __slots__ = (
        "admitted",
        "charged",
        "chunked_req",
        "client",
        "close_after",
        "deadline",
        "done",
        "feed",
        "head_only",
        "hold",
        "llm",
        "out",
        "pending",
        "pending_size",
        "prompt",
        "reached",
        "replay",
        "req_bytes",
        "req_complete",
        "resp_bytes",
        "resp_chunked",
        "resp_done",
        "resp_eof",
        "resp_started",
        "retried",
        "safe",
        "status",
        "tel",
        "upstream",
        "version10",
        "waiting",
    )

    def __init__(self, client: ClientConn, tel: Request, head: bytes, chunked: bool, method: bytes) -> None:
        self.client = client
        self.tel = tel
        self.pending: list[bytes] = [head]
        self.pending_size = len(head)
        # What was written to a reused upstream connection while a replay is still allowed.
        self.replay: list[bytes] | None = []
        self.chunked_req = chunked
        self.head_only = method == b"HEAD"
        self.safe = method in SAFE_METHODS
        self.version10 = False
        self.upstream: UpstreamConn | None = None
        self.llm: StreamExchange | None = None  # a generative route's observer (sidecar.core.streams)
        self.feed: Callable[[bytes, float], None] | None = None  # its answer's reader, once it has one
        self.hold: Held | None = None  # an LLM request held for its token cost before admission
        self.out: list[bytes] = []
        self.req_bytes = 0
        self.resp_bytes = 0
        self.status = 0
        self.req_complete = False
        self.resp_started = False
        self.resp_done = False
        self.resp_chunked = False
        self.resp_eof = False
        self.retried = False
        self.close_after = False
        self.done = False
        self.deadline = 0.0
        self.admitted: str | None = None  # the model it holds an admission slot for
        self.waiting: Waiting | None = None  # queued by a per-model limit (sidecar.core.admission)
        self.charged = 0  # the tokens bucket's charge (decide), partly refunded at the end
        self.prompt = 0  # its prompt estimate
        self.reached = False  # given an upstream connection: the server may have seen it

    def woken(self, refusal: Refusal | None) -> None:
        """The admission queue's answer: a slot (start, if first in line) or shed."""
        self.waiting = None
        if refusal is None:
            if self.done:
                self.client.proxy.admission.release(self.admitted or "")
            elif self.client.exchanges and self.client.exchanges[0] is self:
                self.start()
                self.flush()
                self.client.update_reading()
            return
        self.shed(refusal)

    def shed(self, refusal: Refusal) -> None:
        """Refused by admission after its head was read: 429 (a per-model limit) or the
        overload 503 (the global one), then close; nothing went upstream."""
        self.admitted = None
        if self.done:
            return
        client = self.client
        self.close_after = True
        self.status = 429 if refusal.retry_after else 503
        if client.exchanges and client.exchanges[0] is self:
            client.transport.write(http_answer(refusal) if refusal.retry_after else OVERLOAD_RESPONSE)
        else:  # behind a pipelined answer: it cannot be answered before that one, so close
            client.transport.abort()
        self._close(STATUS_STR[self.status], None if refusal.retry_after else contract.OUTCOME_SERVER_ERROR)

    # -- towards the upstream
    def start(self) -> None:
        proxy = self.client.proxy
        self.deadline = proxy.loop.time() + proxy.config.request_timeout
        conn = proxy.pool_get()
        if conn is not None:
            self.attach(conn)
        else:
            proxy.loop.create_task(self.connect())

    async def connect(self) -> None:
        proxy = self.client.proxy
        try:
            conn = await proxy.connect()
        except (OSError, TimeoutError) as exc:
            proxy.upstream_failed(exc)
            self.fail(503)
            return
        if self.done:  # the client went away meanwhile
            proxy.pool_put(conn)
            return
        if conn.closed:  # accepted, then closed before a byte was sent (a server still starting)
            self.fail(503)
            return
        self.attach(conn)
        self.flush()
        self.client.update_reading()

    def attach(self, conn: UpstreamConn) -> None:
        self.upstream = conn
        self.reached = True
        conn.ex = self
        if self.client.write_paused:
            conn.transport.pause_reading()

    def flush(self) -> None:
        """Send what the client sent since the last flush, in one write."""
        up = self.upstream
        if up is None or not self.pending:
            return
        data = self.pending[0] if len(self.pending) == 1 else b"".join(self.pending)
        self.pending.clear()
        self.pending_size = 0
        transport = up.transport
        transport.write(data)
        replay = self.replay
        if replay is not None:
            # A request that is not safe may be replayed only while none of it went out: the
            # transport closes at once when its write fails (or was already closing).
            if (
                not up.reused
                or not (self.safe or transport.is_closing())
                or sum(map(len, replay)) + len(data) > REPLAY_LIMIT
            ):
                self.replay = None
            else:
                replay.append(data)

    def retry(self) -> None:
        """A pooled connection died before answering, and the request provably did not reach
        the server (or is safe to repeat): resend it once on a new connection."""
        assert self.replay is not None
        self.retried = True
        self.pending[:0] = self.replay
        self.replay = None
        self.upstream = None
        self.client.proxy.loop.create_task(self.connect())

    # -- towards the client
    def response_head(self, status: int, headers: list[tuple[bytes, bytes]], up_keepalive: bool) -> None:
        self.status = status
        self.resp_started = True
        client = self.client
        parts = [STATUS_LINE["1.0" if self.version10 else "1.1"][status]]
        length = False
        chunked = False
        drop: set[bytes] | None = None
        for name, value in headers:
            ln = name.lower()
            if ln in HOP_BY_HOP:
                if ln == b"transfer-encoding":
                    chunked = True
                elif ln == b"connection":
                    drop = {t.strip() for t in value.lower().split(b",")}
                continue
            if ln == b"content-length":
                length = True
            parts.append(name + b": " + value + b"\r\n")
        if drop:
            parts = [p for p in parts if p.split(b":", 1)[0].lower() not in drop]
        bodiless = self.head_only or status in (204, 304) or status < 200
        if not length and not bodiless and (chunked or not up_keepalive):
            if self.version10:
                self.close_after = True  # an HTTP/1.0 client reads to close
            else:
                parts.append(b"transfer-encoding: chunked\r\n")
                self.resp_chunked = True
            self.resp_eof = not chunked
        if self.close_after or not client.keep_alive or (client.eof and len(client.exchanges) == 1):
            self.close_after = True
            parts.append(b"connection: close\r\n")
        elif self.version10:
            parts.append(b"connection: keep-alive\r\n")
        parts.append(VIA)
        parts.append(b"\r\n")
        self.out.append(b"".join(parts))
        if self.llm is not None:
            self.feed = self.llm.response_head(status, headers)

    def response_end(self) -> None:
        if self.resp_chunked:
            self.out.append(b"0\r\n\r\n")
        self.resp_done = True

    def flush_out(self) -> None:
        out = self.out
        if out:
            self.client.transport.write(out[0] if len(out) == 1 else b"".join(out))
            out.clear()

    # -- endings: each calls _close exactly once
    def finish(self, reuse_upstream: bool) -> None:
        """The answer is complete and written."""
        up = self.upstream
        self.upstream = None
        if up is not None:
            up.ex = None
            if reuse_upstream and self.req_complete:
                self.client.proxy.pool_put(up)
            else:
                up.transport.close()
        if not self.req_complete:
            self.close_after = True  # the rest of the body would be unread: close
        outcome = contract.OUTCOME_SUCCESS if self.status < 400 else None
        if self.llm is not None:  # an error event in a 200 stream, a stream cut short
            outcome = self.llm.close(True) or outcome
        self._close(STATUS_STR[self.status], outcome)

    def fail(self, status: int) -> None:
        """The sidecar answers ``status`` itself (or, with an answer under way, cuts it)."""
        if self.done:
            return
        up = self.upstream
        self.upstream = None
        if up is not None:
            up.ex = None
            up.transport.abort()
        client = self.client
        if self.llm is not None:
            self.llm.close(False)
        if self.resp_started:
            self.close_after = True
            self.out.clear()
            if self.llm is not None:
                # A token stream cut by the upstream: close after the tokens already sent (a reset
                # could destroy those the client has not read yet).
                client.transport.close()
            else:
                client.transport.abort()
        else:
            if not self.req_complete or status in (400, 408, 413, 431):
                self.close_after = True
            close = self.close_after = self.close_after or not client.keep_alive
            client.transport.write(ERROR_RESPONSES[(status, close)])
        self.status = status
        self._close(STATUS_STR[status], None)

    def cancel(self) -> None:
        """The client went away: drop the upstream request."""
        if self.done:
            return
        up = self.upstream
        self.upstream = None
        if up is not None:
            up.ex = None
            up.transport.abort()
        self.done = True
        code, outcome = "499", contract.OUTCOME_CLIENT_ERROR
        if self.llm is not None:
            if self.llm.answered():  # left after `data: [DONE]`, before the body's last chunk
                code = STATUS_STR[self.status]
                outcome = self.llm.close(True) or self.client.proxy.telemetry.outcome_for_http(self.status)
            else:  # the tokens the client received are counted
                self.llm.close(False, client_left=True)
        self.client.proxy.end(self, code, outcome)

    def _close(self, code: str, outcome: str | None) -> None:
        self.done = True
        client = self.client
        client.proxy.end(self, code, outcome or client.proxy.telemetry.outcome_for_http(int(code)))
        client.exchange_done(self)


# ------------------------------------------------------------------------------------------
# Upstream connections
# ------------------------------------------------------------------------------------------
class UpstreamConn(asyncio.Protocol):
    __slots__ = (
        "closed",
        "ex",
        "got_bytes",
        "headers",
        "keepalive",
        "parser",
        "pooled_at",
        "proxy",
        "reused",
        "transport",
    )

    def __init__(self, proxy: HttpProxy) -> None:
        self.proxy = proxy
        self.pooled_at = 0.0  # loop time when it last went into the pool
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.parser = httptools.HttpResponseParser(self)
        self.ex: Exchange | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.reused = False
        self.closed = False
        self.got_bytes = False
        self.keepalive = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        ex = self.ex
        self.ex = None
        if ex is None or ex.done:
            return
        ex.upstream = None
        if not self.got_bytes and self.reused and ex.replay is not None and not ex.retried:
            ex.retry()
        elif ex.resp_started and ex.resp_eof:
            ex.response_end()  # an answer delimited by the connection's end
            ex.flush_out()
            ex.finish(False)
        else:
            ex.fail(502)

    def data_received(self, data: bytes) -> None:
        ex = self.ex
        if ex is None:  # bytes nobody asked for: this connection cannot be trusted
            self.transport.abort()
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            ex.fail(502)
            return
        out = ex.out  # flush_out, inline: each streamed token passes here
        if out:
            ex.client.transport.write(out[0] if len(out) == 1 else b"".join(out))
            out.clear()
        if ex.resp_done and not ex.done:
            ex.finish(self.keepalive and not ex.head_only)

    def eof_received(self) -> bool:
        return False

    def pause_writing(self) -> None:
        ex = self.ex
        if ex is not None:
            ex.client.upstream_blocked = True
            ex.client.update_reading()

    def resume_writing(self) -> None:
        ex = self.ex
        if ex is not None:
            ex.client.upstream_blocked = False
            ex.client.update_reading()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        ex = self.ex
        status = self.parser.get_status_code()
        if ex is None or status < 200:  # 1xx interim answers are not forwarded
            return
        # Read here: llhttp forgets the message's keep-alive once the message completes.
        self.keepalive = self.parser.should_keep_alive()
        ex.response_head(status, self.headers, self.keepalive)
        if ex.head_only:
            ex.response_end()

    def on_body(self, body: bytes) -> None:
        """A piece of the answer's body: to the client as it came (re-framed when chunked), and
        to a generative route's observer with the time it passed. Each streamed token passes
        here, so it is one function (a stream wakes the process per token, with cold caches)."""
        ex = self.ex
        if ex is None or ex.head_only:
            return
        ex.resp_bytes += len(body)
        feed = ex.feed
        if feed is not None:
            feed(body, time.perf_counter())
        ex.out.append(b"%x\r\n%b\r\n" % (len(body), body) if ex.resp_chunked else body)

    def on_message_complete(self) -> None:
        ex = self.ex
        if ex is not None and ex.resp_started and not ex.resp_done:
            ex.response_end()


# ------------------------------------------------------------------------------------------
# Client connections
# ------------------------------------------------------------------------------------------
class ClientConn(asyncio.Protocol):
    def __init__(self, proxy: HttpProxy) -> None:
        self.proxy = proxy
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.parser = httptools.HttpRequestParser(self)
        self.exchanges: deque[Exchange] = deque()
        self.parsing: Exchange | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.url = b""
        self.head_size = 0
        self.raw_head = 0
        self.in_head = False
        self.keep_alive = True  # False once draining: each answer then closes its connection
        self.eof = False
        self.msg_start = 0.0
        self.deadline = 0.0
        self.dl_kind = _IDLE
        self.reading_paused = False
        self.write_paused = False
        self.upstream_blocked = False
        self.closed = False

    # -- asyncio
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        proxy = self.proxy
        if len(proxy.conns) >= proxy.config.max_connections:
            transport.write(OVERLOAD_RESPONSE)  # type: ignore[attr-defined]
            transport.close()
            self.closed = True
            return
        # Accepted while draining (the listener may have closed since): served like any other,
        # its answer closes it.
        self.keep_alive = not proxy.draining
        proxy.conns.add(self)
        self.deadline = proxy.loop.time() + proxy.config.header_timeout
        if proxy.idle_until and self.deadline > proxy.idle_until:
            self.deadline = proxy.idle_until
        self.dl_kind = _IDLE

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.proxy.conns.discard(self)
        while self.exchanges:
            self.exchanges.popleft().cancel()
        self.parsing = None

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if self.dl_kind == _IDLE:
            self.dl_kind = _HEAD
            self.deadline = self.proxy.loop.time() + self.proxy.config.header_timeout
        was_in_head = self.in_head
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, _Reject):
                self.reject(cause.status)
                return
            if isinstance(cause, _Halt):
                return
            log.exception("internal error in the HTTP proxy", exc_info=cause)
            self.reject(502)
            return
        except httptools.HttpParserUpgrade:
            self.keep_alive = False  # upgrades are not proxied: answer this request, then close
        except httptools.HttpParserError:
            self.reject(400)
            return
        if self.in_head and was_in_head:
            # A head still incomplete after this read: httptools holds it, so bound it here.
            self.raw_head += len(data)
            if self.raw_head > self.proxy.config.max_header_bytes:
                self.reject(431)
                return
        if self.exchanges:
            ex = self.exchanges[0]
            if ex.upstream is not None:
                ex.flush()
            self.update_reading()

    def eof_received(self) -> bool | None:
        # As nginx does: a client's end of input means it went away (a half-close cannot be
        # told from a close), so the transport closes and connection_lost cancels the upstream.
        self.eof = True
        return None

    def pause_writing(self) -> None:
        self.write_paused = True
        for ex in self.exchanges:
            if ex.upstream is not None:
                ex.upstream.transport.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        for ex in self.exchanges:
            if ex.upstream is not None:
                ex.upstream.transport.resume_reading()

    def update_reading(self) -> None:
        """Pause reading while the upstream is not draining what this client sends."""
        ex = self.exchanges[0] if self.exchanges else None
        pause = self.upstream_blocked or len(self.exchanges) > 1
        if ex is not None and ex.upstream is None and ex.pending_size > HIGH_WATER and ex.hold is None:
            pause = True  # (a held body is read up to charge.WINDOW, then decided)
        if pause != self.reading_paused and not self.closed:
            self.reading_paused = pause
            if pause:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        self.in_head = True
        self.headers = []
        self.url = b""
        self.head_size = 0
        self.raw_head = 0
        self.msg_start = time.perf_counter()
        if self.dl_kind == _IDLE:
            self.dl_kind = _HEAD
            self.deadline = self.proxy.loop.time() + self.proxy.config.header_timeout

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > self.proxy.config.max_header_bytes:
            raise _Reject(431)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        self.head_size += len(name) + len(value) + 4
        if self.head_size > self.proxy.config.max_header_bytes:
            raise _Reject(431)

    def on_headers_complete(self) -> None:
        self.in_head = False
        proxy = self.proxy
        config = proxy.config
        parser = self.parser
        method = parser.get_method()
        url = self.url
        path = url.split(b"?", 1)[0] if b"?" in url else url
        if not path.startswith(b"/"):  # absolute-form target
            try:
                path = httptools.parse_url(url).path or b"/"
            except httptools.HttpParserInvalidURLError:
                raise _Reject(400) from None
        model, version, route, api = proxy.route(path)

        tp = None
        chunked = False
        expect = False
        has_host = False
        length = 0
        drop: set[bytes] | None = None
        tracing = proxy.telemetry.tracer is not None
        lines = [method, b" ", url, b" HTTP/1.1\r\n"]
        for name, value in self.headers:
            ln = name.lower()
            if ln in HOP_BY_HOP:
                if ln == b"transfer-encoding":
                    chunked = True
                elif ln == b"expect":
                    expect = value.lower() == b"100-continue"
                elif ln == b"connection":
                    drop = {t.strip() for t in value.lower().split(b",")}
                continue
            if ln == b"content-length":
                length = int(value)
            elif ln == b"traceparent":
                tp = value
                if tracing:
                    continue
            elif ln == b"host":
                has_host = True
            lines.append(name + b": " + value + b"\r\n")
        if drop:
            lines[4:] = [p for p in lines[4:] if p.split(b":", 1)[0].lower() not in drop]

        if tracing:
            tel = proxy.telemetry.begin(
                model,
                version,
                PROTOCOL,
                tp.decode("latin-1") if tp else None,
                f"{method.decode()} {route}" if route else method.decode(),
                {
                    "http.request.method": method.decode(),
                    "url.path": path.decode("utf-8", "replace"),
                    "url.scheme": "http",
                    "http.route": route,
                    "network.protocol.version": parser.get_http_version(),
                },
            )
            if tel.traceparent:
                lines.append(b"traceparent: " + tel.traceparent.encode() + b"\r\n")
        else:
            tel = proxy.telemetry.begin(model, version, PROTOCOL)
        tel.start = self.msg_start
        if chunked:
            lines.append(b"transfer-encoding: chunked\r\n")
        if not has_host:
            lines.append(b"host: %s\r\n" % proxy.host_header)
        lines.append(VIA)
        lines.append(b"\r\n")
        ex = Exchange(self, tel, b"".join(lines), chunked, method)
        if api is not None:
            ex.llm = proxy.streams.begin(api, tel)  # type: ignore[union-attr]
        ex.version10 = parser.get_http_version() == "1.0"
        ex.close_after = not parser.should_keep_alive()
        self.parsing = ex
        self.exchanges.append(ex)
        proxy.requests += 1

        admission = proxy.admission  # sidecar.core.admission: the limits, one for all protocols
        hold = None
        if api is not None and admission.per_model and (api.scans_body or admission.charges_tokens(model)):
            # An LLM request: its token cost (and for OpenAI its model) is in the body. Hold the
            # body until it is read, under the global limit only; then admit it for its model.
            charge = api.charge()
            if charge is not None:
                hold = ex.hold = Held(charge, model, length)
        if hold is not None:
            got = admission.acquire(contract.MODEL_NONE)
            model = contract.MODEL_NONE
        else:
            got = admission.acquire(model, 0, ex.woken if admission.per_model else None)
        if type(got) is Refusal and got.retry_after:  # a per-model limit shed it: 429, nothing upstream
            self.exchanges.pop()
            self.parsing = None
            ex.done = True
            proxy.telemetry.end(ex.tel, "429", proxy.telemetry.outcome_for_http(429), 0, 0)
            self.keep_alive = False
            self.transport.write(http_answer(got))
            self.shutdown(linger=True)
            return
        ex.admitted = model
        if type(got) is Waiting:
            ex.waiting = got
        elif got is not None:
            ex.admitted = None
            self.exchanges.pop()
            self.parsing = None
            ex.done = True
            proxy.telemetry.end(ex.tel, "503", contract.OUTCOME_SERVER_ERROR, ex.req_bytes, ex.resp_bytes)
            self.keep_alive = False
            self.transport.write(OVERLOAD_RESPONSE)
            self.transport.close()
            self.closed = True
            return
        if length > config.max_body_bytes:
            raise _Reject(413)
        if chunked or length:
            self.dl_kind = _BODY
            self.deadline = proxy.loop.time() + config.body_timeout
        else:
            self.dl_kind = _WAIT
        if expect:
            self.transport.write(CONTINUE)
        if hold is not None:
            # A body trickled in under --body-timeout per pause is still bounded, as when it
            # streams upstream: --request-timeout from its head (start() sets it again).
            ex.deadline = proxy.loop.time() + config.request_timeout
            if not (chunked or length):  # no body: decided now (else on_body / on_message_complete)
                self.decide(ex)
                if self.closed:
                    raise _Halt
            return
        if len(self.exchanges) == 1 and ex.waiting is None:
            ex.start()

    def on_body(self, body: bytes) -> None:
        ex = self.parsing
        if ex is None:
            return
        n = len(body)
        ex.req_bytes += n
        if ex.req_bytes > self.proxy.config.max_body_bytes:
            raise _Reject(413)
        if ex.chunked_req:
            ex.pending.append(b"%x\r\n%b\r\n" % (n, body))
        else:
            ex.pending.append(body)
        if ex.llm is not None:  # the model from the body, read as the body goes upstream
            ex.llm.request_body(body)
        ex.pending_size += n
        self.deadline = self.proxy.loop.time() + self.proxy.config.body_timeout
        hold = ex.hold
        if hold is not None and (hold.charge.feed(body) or ex.req_bytes >= WINDOW):
            self.decide(ex)
            if self.closed:
                raise _Halt

    def on_message_complete(self) -> None:
        ex = self.parsing
        self.parsing = None
        if ex is None:
            return
        if ex.chunked_req:
            ex.pending.append(b"0\r\n\r\n")
        if ex.llm is not None:
            ex.llm.request_end()
        ex.req_complete = True
        if self.dl_kind == _BODY:
            self.dl_kind = _WAIT
        if ex.hold is not None:
            self.decide(ex)
            if self.closed:
                raise _Halt

    def decide(self, ex: Exchange) -> None:
        """A held LLM request's body named its model and cost (or ended, or filled the window):
        trade its global slot for the model's admission, charged the tokens (429 when shed)."""
        hold = ex.hold
        assert hold is not None
        ex.hold = None
        charge = hold.charge
        charge.finish()
        proxy = self.proxy
        model = hold.model
        name = charge.model
        if name is not None and not model:  # an OpenAI body's model; a served name maps to its model
            model = proxy.streams.served_name(name)[0]  # type: ignore[union-attr]
        size = max(ex.req_bytes, hold.length)
        cost = charge.tokens(size)
        got = proxy.admission.transfer(model, cost, ex.woken)
        if got is None or type(got) is Waiting:
            ex.admitted = model
            ex.charged = cost
            ex.prompt = prompt_estimate(size)
            if got is not None:
                ex.waiting = got  # type: ignore[assignment]
            elif self.exchanges and self.exchanges[0] is ex:
                ex.start()  # the rest goes as data_received flushes
            return
        ex.admitted = None
        if self.parsing is ex:
            self.parsing = None
        self.keep_alive = False
        ex.shed(got)  # type: ignore[arg-type]

    # -- endings
    def exchange_done(self, ex: Exchange) -> None:
        """``ex`` has answered (or failed): close or move on to the next request."""
        if self.exchanges and self.exchanges[0] is ex:
            self.exchanges.popleft()
        else:
            try:
                self.exchanges.remove(ex)
            except ValueError:
                pass
        if self.closed:
            return
        # An answer begun before the drain did not say "close": the client may be sending its
        # next request already, so serve that one (it will say "close") rather than cut it.
        unannounced = not ex.close_after and not self.keep_alive and self.proxy.draining
        if ex.close_after or (not self.keep_alive and not unannounced) or (self.eof and not self.exchanges):
            while self.exchanges:
                self.exchanges.popleft().cancel()
            self.shutdown(linger=not ex.req_complete)
            return
        if self.exchanges:
            nxt = self.exchanges[0]
            if nxt.waiting is None and nxt.hold is None:  # a queued or held one starts when admitted
                nxt.start()
                nxt.flush()
        elif self.dl_kind == _WAIT:
            self.dl_kind = _IDLE
            wait = DRAIN_IDLE_GRACE if unannounced else self.proxy.config.keepalive_timeout
            self.deadline = self.proxy.loop.time() + wait
        self.update_reading()

    def reject(self, status: int) -> None:
        """Answer ``status`` (400, 408, 413, 431, 502) and close the connection."""
        if self.closed:
            return
        self.keep_alive = False
        ex = self.parsing if self.parsing is not None else (self.exchanges[0] if self.exchanges else None)
        if ex is not None and not ex.done:
            if ex is not self.exchanges[0]:  # a pipelined request behind another: just close
                self.transport.abort()
                return
            ex.fail(status)
            return
        # No request object yet (bad or oversized head): count it without a model.
        if status != 408 or self.head_size or self.url or self.headers:
            tel = self.proxy.telemetry.begin("", "", PROTOCOL)
            self.proxy.telemetry.end(tel, STATUS_STR[status], self.proxy.telemetry.outcome_for_http(status))
            self.transport.write(ERROR_RESPONSES[(status, True)])
        self.shutdown(linger=status in (413, 431))

    def shutdown(self, linger: bool) -> None:
        """Close after what is written; with ``linger``, first half-close and discard what the
        client is still sending, so the answer is not destroyed by a reset (as nginx does)."""
        self.closed = True
        if linger and self.transport.can_write_eof() and not self.transport.is_closing():
            self.transport.write_eof()
            if self.reading_paused:
                self.reading_paused = False
                self.transport.resume_reading()
            self.dl_kind = _LINGER
            self.deadline = self.proxy.loop.time() + LINGER_SECONDS
            return
        self.proxy.conns.discard(self)
        self.transport.close()

    def sweep(self, now: float) -> None:
        """Enforce the slow-client and keep-alive deadlines and the request timeout."""
        if self.exchanges and not self.closed:
            ex = self.exchanges[0]
            if now > ex.deadline and ex.deadline:
                ex.fail(504)
                return
        if self.dl_kind == _WAIT or now <= self.deadline:
            return
        if self.reading_paused and self.dl_kind == _BODY:
            self.deadline = now + self.proxy.config.body_timeout  # our backpressure, not a slow client
            return
        if self.dl_kind in (_IDLE, _LINGER):
            self.closed = True
            self.proxy.conns.discard(self)
            self.transport.close()
        else:
            self.reject(408)


# ------------------------------------------------------------------------------------------
# The server
# ------------------------------------------------------------------------------------------
class HttpProxy:
    def __init__(
        self,
        config: SidecarConfig,
        telemetry: Telemetry,
        admission: Admission | None = None,
        streams: StreamTelemetry | None = None,
        health: UpstreamHealth | None = None,
    ) -> None:
        from sidecar.core.telemetry import UPSTREAM_HTTP

        self.config = config
        self.telemetry = telemetry
        # Generative routes (sidecar.core.streams): which API a path speaks, and its token telemetry.
        self.streams = streams
        # Shared with the gRPC side (sidecar.main), so --max-in-flight is the process's total.
        self.admission = admission if admission is not None else Admission(config.max_in_flight)
        self.loop = asyncio.get_running_loop()
        self.upstream_host, self.upstream_port = config.upstream_http
        self.host_header = f"{self.upstream_host}:{self.upstream_port}".encode()
        self.upstream_name = UPSTREAM_HTTP
        # The one writer of upstream_up (sidecar.main shares it and runs its probe).
        self.health = health or UpstreamHealth(telemetry, {UPSTREAM_HTTP: config.upstream_http})
        self.pool: list[UpstreamConn] = []
        self.conns: set[ClientConn] = set()
        self.requests = 0  # requests read (each answered or counted as abandoned)
        self.draining = False  # answers close their connections (SIGTERM arrived)
        self.stopped = False  # the drain is over: nothing goes back to the pool
        self.idle_until = 0.0  # once the listener closed: when idle connections close
        self.server: asyncio.AbstractServer | None = None
        self._routes: dict[bytes, tuple[str, str, str, Api | None]] = {}
        self._sweeper: asyncio.Task | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await self.loop.create_server(
            lambda: ClientConn(self),
            self.config.host,
            self.config.http_port,
            backlog=1024,
            reuse_address=True,
        )
        self.port = self.server.sockets[0].getsockname()[1]
        self._sweeper = self.loop.create_task(self._sweep())

    def route(self, path: bytes) -> tuple[str, str, str, Api | None]:
        """(model, version, route template, generative API or None), cached per path."""
        hit = self._routes.get(path)
        if hit is None:
            model, version, route = labels_from_path(path, self.config.routes)
            api = self.streams.classify(path) if self.streams is not None else None
            hit = (model, version, route or (api.route if api is not None else ""), api)
            if len(self._routes) >= MAX_CACHED_ROUTES:
                self._routes.clear()
            self._routes[path] = hit
        return hit

    def end(self, ex: Exchange, code: str, outcome: str) -> None:
        if ex.waiting is not None:  # left while queued: it held no slot
            ex.waiting.cancel()
            ex.waiting = None
        elif ex.admitted is not None:
            # The adaptive limit learns from the time in the server: from going upstream
            # (start() set the deadline then) to the end. Not for a generative route, whose
            # time is the answer's length (as gRPC streams pass none).
            latency = None
            if ex.deadline and ex.llm is None:
                latency = self.loop.time() - (ex.deadline - self.config.request_timeout)
            if ex.charged:  # the tokens bucket gets back what was charged and not used
                spent = 0  # never reached the server: it cost it nothing
                if ex.reached:
                    spent = used(ex.charged, ex.prompt, ex.llm.end if ex.llm is not None else None)
                self.admission.refund(ex.admitted, ex.charged, spent)
            self.admission.release(ex.admitted, latency)
            ex.admitted = None
        self.telemetry.end(ex.tel, code, outcome, ex.req_bytes, ex.resp_bytes)

    # -- upstream pool
    def pool_get(self) -> UpstreamConn | None:
        pool = self.pool
        if pool and self.loop.time() - pool[-1].pooled_at >= POOL_IDLE_SECONDS:
            # The sweeper ran late (a busy loop): the newest is stale, so is every older one.
            # Taken anyway, the upstream may close it as the request is written (a 502).
            for conn in pool:
                conn.transport.close()
            pool.clear()
        while pool:
            conn = pool.pop()
            if not conn.closed and not conn.transport.is_closing():
                conn.reused = True
                conn.got_bytes = False
                return conn
        return None

    def pool_put(self, conn: UpstreamConn) -> None:
        if conn.closed or self.stopped or len(self.pool) >= self.config.upstream_pool_size:
            conn.transport.close()
            return
        conn.transport.resume_reading()
        conn.pooled_at = self.loop.time()
        self.pool.append(conn)

    async def connect(self) -> UpstreamConn:
        _, conn = await asyncio.wait_for(
            self.loop.create_connection(lambda: UpstreamConn(self), self.upstream_host, self.upstream_port),
            self.config.connect_timeout,
        )
        self.health.report(self.upstream_name, True)
        return conn  # type: ignore[return-value]

    def upstream_failed(self, exc: BaseException) -> None:
        self.health.report(self.upstream_name, False, str(exc) or type(exc).__name__)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL)
            now = self.loop.time()
            pool = self.pool  # LIFO: the longest idle are at the bottom
            while pool and now - pool[0].pooled_at >= POOL_IDLE_SECONDS:
                pool.pop(0).transport.close()
            for conn in list(self.conns):
                try:
                    conn.sweep(now)
                except Exception:  # one connection's trouble must not stop the sweeper
                    log.exception("sweep failed")

    def begin_drain(self) -> None:
        """From now on every answer closes its connection (a kept-alive client's next request
        is served, then its connection closes); the listener still accepts, and a connection
        accepted now is served the same way. Only the real limits get the overload answer."""
        self.draining = True
        for conn in self.conns:
            conn.keep_alive = False

    async def stop(self, grace: float) -> None:
        """Stop accepting, let in-flight requests finish (at most ``grace`` s): connections with
        a request under way are answered and closed; idle ones close after
        ``DRAIN_IDLE_GRACE`` (a request already on its way is still served)."""
        if not self.draining:
            self.begin_drain()
        if self.server is not None:
            self.server.close()
        deadline = self.loop.time() + grace
        self.idle_until = idle_until = self.loop.time() + DRAIN_IDLE_GRACE
        for conn in self.conns:
            if conn.dl_kind == _IDLE and conn.deadline > idle_until:
                conn.deadline = idle_until
        while self.conns and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(self.conns):
            conn.transport.abort()
        self.stopped = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        for up in self.pool:
            up.transport.close()
        self.pool.clear()


async def serve(
    config: SidecarConfig,
    telemetry: Telemetry,
    admission: Admission | None = None,
    streams: StreamTelemetry | None = None,
    health: UpstreamHealth | None = None,
) -> HttpProxy:
    """Start the HTTP proxy on ``config.host:config.http_port``; returns it listening."""
    proxy = HttpProxy(config, telemetry, admission, streams, health)
    await proxy.start()
    return proxy
