"""The gRPC relay's connections: one client connection relayed to one upstream connection.

The listener, the upstream probe and the drain are ``sidecar.protocols.grpc_relay``; this module is what
happens on each connection. The relay is the lean engine of the sidecar's gRPC side.

grpc.aio spends about half a millisecond of CPU per proxied call on its own machinery (see
``benchmarks/RESULTS.md``); a relay that forwards HTTP/2 frames as they are, one client
connection to one upstream connection, costs a small fraction of that. It reads only what the
metrics need:

- **SETTINGS** are forwarded with ``SETTINGS_HEADER_TABLE_SIZE = 0`` in both directions, so
  both encoders switch their HPACK dynamic table off after the handshake (RFC 7541 4.2). Every
  header block after that is self-contained: the relay parses it without state, and may drop
  or append a header field without desynchronising the two ends. A client's blocks from before
  it switched (its first calls, sent before the SETTINGS exchange) are decoded by ``hpack``'s
  full decoder and written again without any table, so they are edited like the others. The
  upstream's first blocks are only read.
- **HEADERS** from the client: ``:path`` (the method), ``grpc-timeout`` and ``traceparent``; the
  relay adds ``grpc-timeout`` when the client set none or a longer one (the per-request
  timeout), so the upstream enforces both deadlines. With tracing on, a unary call's headers
  wait for the first bytes of its message (a client writes them together) so the sidecar's span
  is started with its model and its context replaces the client's ``traceparent``: the model
  server's span is the sidecar span's child. From the upstream: ``grpc-status`` in the
  trailers closes the observation with that code.
- **DATA**: the first bytes of each gRPC message (model name, version, request id: fields 1-3,
  ``sidecar.protocols.grpc_wire``); the rest is forwarded without a look. For ``ModelStreamInfer`` every
  message on both sides is observed (``sidecar.protocols.grpc_streams``). A model with a ``tokens``
  bucket is the exception: the whole request message (a stream's first) is read as it goes by
  (``sidecar.protocols.grpc_charge``, never held), and the call admitted on its last byte; a
  stream gets back at its end what it was charged and not sent (``_release``).
- **RST_STREAM**: a client's cancel goes upstream as it is, so the upstream stops working. An
  upstream's REFUSED_STREAM (never processed; a client's retry policy retries it) keeps the
  call's observation for a moment, and the retry continues it, so the call is counted once.

Flow control, PING, PRIORITY and GOAWAY pass through untouched, so the two ends negotiate
with each other. The relay synthesises frames only where it must answer itself, always with
stateless header representations: the upstream cannot be reached (every call gets
UNAVAILABLE, then GOAWAY so the client reconnects), it dropped the connection (open calls get
UNAVAILABLE trailers), the in-flight limit, a per-model limit (a unary call on its message, a
stream on its first message; the stream's upstream half is then reset) or the message-size
limit refuses a call (RESOURCE_EXHAUSTED), or the relay itself failed (INTERNAL, then GOAWAY and
close; logged).

Counting is the same contract as ``sidecar.protocols.grpc_aio``. HTTP/2 framing and HPACK live in
``sidecar.protocols.h2``, the method table in ``sidecar.protocols.grpc_methods``.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from typing import Any

import hpack

from inferwatch.contract import MODEL_NONE, PROTOCOL_GRPC
from sidecar.apis.charge import prompt_estimate
from sidecar.core.telemetry import GRPC_CODES
from sidecar.protocols.grpc_calls import OTHER, STREAM, UNARY, Call
from sidecar.protocols.grpc_charge import RequestCharge
from sidecar.protocols.grpc_methods import (
    CANCELLED,
    CODE_NAMES,
    DEADLINE_EXCEEDED,
    INFER_PATH,
    INTERNAL,
    OK,
    PERMISSION_DENIED,
    RESOURCE_EXHAUSTED,
    STREAM_FIELDS,
    STREAM_PATH,
    UNARY_PATHS,
    UNAUTHENTICATED,
    UNAVAILABLE,
    UNIMPLEMENTED,
    UNKNOWN,
    stream_error_code,
)
from sidecar.protocols.grpc_tokens import StreamTokens
from sidecar.protocols.grpc_wire import (
    grpc_timeout_seconds,
    grpc_timeout_value,
    read_strings,
    stream_response_info,
)
from sidecar.protocols.h2 import (
    ACK,
    CANCEL,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    INTERNAL_ERROR,
    MAX_STREAM_ID,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    SETTINGS_HEADER_TABLE_SIZE,
    WINDOW_UPDATE,
    HeaderReader,
    HpackError,
    block_of,
    encode_stateless,
    frame,
    header_frames,
    literal,
    parse_block,
    settings_without_table,
)

log = logging.getLogger("inferwatch.sidecar.grpc")

# Seconds a connection stays open after the relay's own GOAWAY (the client closes it sooner).
LINGER_S = 2.0
# Client bytes held for the upstream (not yet connected, or behind a header block that waits
# for its message) before the relay stops reading the client.
MAX_HELD_BYTES = 4 * 1024 * 1024

# gRPC over HTTP: a non-200 answer without grpc-status maps to a code (gRPC's http-grpc-status-mapping).
_HTTP_TO_GRPC = {400: INTERNAL, 401: UNAUTHENTICATED, 403: PERMISSION_DENIED, 404: UNIMPLEMENTED}
_HTTP_UNAVAILABLE = frozenset({429, 502, 503, 504})
# An upstream's RST_STREAM error code -> the call's code.
_RESET_CODES = {CANCEL: CANCELLED, REFUSED_STREAM: UNAVAILABLE}

_PATH, _STATUS = b":path", b":status"
_TIMEOUT, _GRPC_STATUS, _TRACEPARENT = b"grpc-timeout", b"grpc-status", b"traceparent"
_REQUEST_FIELDS = frozenset({_PATH, _TIMEOUT, _TRACEPARENT})
_RESPONSE_FIELDS = frozenset({_STATUS, _GRPC_STATUS})


def _trailers(code: str, message: str, with_headers: bool) -> bytes:
    """A trailers block the relay writes itself (:status and content-type when no headers went out)."""
    block = b""
    if with_headers:
        block += b"\x88" + literal(b"content-type", b"application/grpc")  # 0x88: static ':status: 200'
    block += literal(b"grpc-status", str(GRPC_CODES[code]).encode())
    if message:
        block += literal(b"grpc-message", message.encode("ascii", "replace"))
    return block


def _without(block: bytes, spans: list[tuple[int, int]]) -> bytes:
    """``block`` with the byte spans of some fields cut out."""
    if not spans:
        return block
    spans.sort()
    out, pos = [], 0
    for start, stop in spans:
        out.append(block[pos:start])
        pos = stop
    out.append(block[pos:])
    return b"".join(out)


class ClientSide(asyncio.Protocol):
    def __init__(self, relay: Any) -> None:
        self.relay = relay
        self.conn: _Conn | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.conn = _Conn(self.relay, transport)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        assert self.conn is not None
        try:
            self.conn.from_client(data)
        except Exception as exc:  # the error boundary: see _Conn.fail
            self.conn.fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.conn is not None:
            try:
                self.conn.client_lost()
            except Exception as error:
                self.conn.fail(error)

    def pause_writing(self) -> None:
        if self.conn is not None and self.conn.up is not None:
            self.conn.up.pause_reading()

    def resume_writing(self) -> None:
        if self.conn is not None and self.conn.up is not None:
            self.conn.up.resume_reading()


class _UpstreamSide(asyncio.Protocol):
    def __init__(self, conn: _Conn) -> None:
        self.conn = conn

    def data_received(self, data: bytes) -> None:
        try:
            self.conn.from_upstream(data)
        except Exception as exc:  # the error boundary: see _Conn.fail
            self.conn.fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            self.conn.upstream_lost(exc)
        except Exception as error:
            self.conn.fail(error)

    def pause_writing(self) -> None:
        self.conn.client.pause_reading()

    def resume_writing(self) -> None:
        self.conn.client.resume_reading()


def _splice(
    out: list, buf: bytearray, run: int, pos: int, stop: int | None = None, replace: bytes = b""
) -> int:
    """The frame rewrite of both directions: ``buf[run:pos]`` (frames passed on as they came)
    goes to ``out``, then ``replace`` in place of the frame ``buf[pos:stop]`` (b"": dropped);
    returns where the next run of unchanged bytes starts (``stop``, or ``pos`` with no frame)."""
    if run < pos:
        out.append(bytes(buf[run:pos]))
    if replace:
        out.append(replace)
    return pos if stop is None else stop


class _Conn:
    """One client connection and its upstream connection."""

    def __init__(self, relay: Any, client: asyncio.Transport) -> None:
        self.relay = relay
        self.telemetry = relay.telemetry
        self.tracing = relay.telemetry.tracer is not None
        self.client = client
        self.up: asyncio.Transport | None = None
        self.local = False  # the upstream is unreachable: the relay answers every call itself
        self.closing = False
        self.failed = False
        self.c_buf = bytearray()
        self.u_buf = bytearray()
        self.c_preface = True
        self.c_hdr = HeaderReader()
        self.u_hdr = HeaderReader()
        self.c_block: list | None = None  # [sid, flags, fragments, raw frames] while CONTINUATIONs come
        self.u_block: list | None = None
        self.streams: dict[int, Call] = {}
        self.last_sid = 0
        self.waiting: list[bytes] = []  # client bytes for the upstream before it is connected
        # Client bytes held behind header blocks that wait for their message (tracing), and
        # how many of those blocks are still missing from it.
        self.held: list[bytes] | None = None
        self.holes = 0
        self.goaway_sid: int | None = None  # set once we told the client to go away
        self.refused: set[int] = set()  # calls answered by the relay: their later frames are dropped
        self.unacked_settings = 0  # client SETTINGS read before the upstream turned out unreachable
        self.settings_out = False  # the client got a server SETTINGS (its connection preface)
        self.early: list[bytes] = []  # the relay's own frames for the client before that
        self.goaway_wanted: bool | None = None  # a GOAWAY asked for before that: sent right after
        self.lingering = False  # our first GOAWAY went out; the connection closes soon
        self.upstream_last: int | None = None  # the upstream's GOAWAY: it takes no later call
        relay.conns.add(self)
        sock = client.get_extra_info("socket")
        if sock is not None:
            relay.nodelay(sock)
        self.connect_task = asyncio.get_running_loop().create_task(self._connect())

    # ---------------------------------------------------------------- upstream connection
    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        host, port = self.relay.upstream
        try:
            transport, _ = await asyncio.wait_for(
                loop.create_connection(lambda: _UpstreamSide(self), host, port), self.relay.connect_timeout
            )
        except (OSError, TimeoutError) as exc:
            self.relay.upstream_state(False, exc)
            self._go_local()
            return
        if self.client.is_closing():
            transport.close()
            return
        self.up = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self.relay.nodelay(sock)
        self.relay.upstream_state(True, None)
        if self.waiting:
            transport.write(b"".join(self.waiting))
            self.waiting.clear()
        self.client.resume_reading()  # paused if the client sent a lot while we connected

    def _go_local(self) -> None:
        """Answer this client ourselves: a minimal HTTP/2 server that fails every call fast.

        What the client sent so far was already read (its SETTINGS are acknowledged here, its
        calls answered); what it sends next is handled by the local branches of ``from_client``.
        """
        self.local = True
        self.waiting.clear()
        self.held, self.holes = None, 0
        if self.client.is_closing():
            return
        self.client.resume_reading()
        out = [frame(SETTINGS, 0, 0, struct.pack(">HI", SETTINGS_HEADER_TABLE_SIZE, 0))]
        out += [frame(SETTINGS, ACK, 0)] * self.unacked_settings  # the ones that waited for the upstream
        self.unacked_settings = 0
        self.client.write(b"".join(out))
        self._settings_sent()
        message = self._unavailable_message()
        for sid, st in list(self.streams.items()):
            self._release(st)
            st.dropped = True
            if st.tel is not None or (st.pending and st.kind == STREAM):
                self._finish(st, UNAVAILABLE)
                self._write_answer(sid, UNAVAILABLE, message)
                del self.streams[sid]
            else:
                st.answer = (UNAVAILABLE, message)  # answered when its message (and model) arrives
        self._close_if_local_done()

    def upstream_lost(self, exc: Exception | None) -> None:
        """The upstream closed or reset: every open call fails with UNAVAILABLE, then GOAWAY."""
        self.up = None
        if self.closing:
            return
        self.relay.upstream_state(False, exc)
        self.held, self.holes = None, 0
        out = [
            self._end_here(sid, st, UNAVAILABLE, "inferwatch sidecar: upstream connection lost")
            for sid, st in self.streams.items()
            if not st.dropped
        ]
        self.streams.clear()
        # From here the relay answers this client itself: calls it already sent are answered
        # UNAVAILABLE (counted), later ones are refused by GOAWAY and retried elsewhere.
        self.local = True
        if out:
            self._write_client(b"".join(out))
        self._goaway_and_linger()

    def client_lost(self) -> None:
        self.held, self.holes = None, 0
        for st in self.streams.values():
            if not st.dropped:
                self._release(st)
                self._finish(st, self._gone_code(st))
        self.streams.clear()
        self._let_go()

    def _let_go(self) -> None:
        """The client side is closed or lost: close the upstream side and forget the connection."""
        if self.up is not None:
            self.closing = True
            self.up.close()
        self.connect_task.cancel()
        self.relay.conns.discard(self)

    def fail(self, exc: BaseException) -> None:
        """The error boundary of the connection: a fault of the relay itself is the server's.

        Every open call is counted INTERNAL (a server_error, as the aio engine counts the same
        fault) and answered INTERNAL trailers; then GOAWAY and both connections close (the
        relay's state for them can no longer be trusted). Logged once through the JSON logger.
        """
        if self.failed:
            return
        self.failed = True
        log.error(
            "grpc relay failure",
            exc_info=(type(exc), exc, exc.__traceback__),
            extra={"fields": {"calls": len(self.streams)}},
        )
        out = []
        try:
            for sid, st in self.streams.items():
                if not st.dropped:
                    out.append(self._end_here(sid, st, INTERNAL, "inferwatch sidecar: relay failure"))
        except Exception:
            log.exception("grpc relay failure while closing its calls")
        self.streams.clear()
        self.held, self.holes = None, 0
        if self.settings_out:
            out.append(frame(GOAWAY, 0, 0, struct.pack(">II", self.last_sid, INTERNAL_ERROR)))
            self._write_client(b"".join(out))
        self.client.close()
        self._let_go()

    def goaway(self, final: bool) -> None:
        """Graceful shutdown in two steps (RFC 9113 6.8). First a GOAWAY naming the highest
        possible stream: the client opens no new calls here, and a call it sent before reading
        it is still taken and answered. Then (``final``) the real last stream: anything later is
        refused (REFUSED_STREAM: never processed, so the client may retry it elsewhere)."""
        if not self.settings_out:
            # A server's first frame must be its SETTINGS (the upstream's, still on their way):
            # the GOAWAY follows them, else the client would see a broken connection.
            self.goaway_wanted = final or bool(self.goaway_wanted)
            return
        if final:
            self.goaway_sid = self.last_sid
        if not self.client.is_closing():
            last = self.last_sid if final else MAX_STREAM_ID
            self.client.write(frame(GOAWAY, 0, 0, struct.pack(">II", last, NO_ERROR)))

    def _settings_sent(self) -> None:
        self.settings_out = True
        if self.early:
            early, self.early = self.early, []
            self._write_client(b"".join(early))
        if self.goaway_wanted is not None:
            final, self.goaway_wanted = self.goaway_wanted, None
            self.goaway(final=False)
            if final:
                self.goaway(final=True)

    # ---------------------------------------------------------------- observations
    def _gone_code(self, st: Call) -> str:
        return DEADLINE_EXCEEDED if st.deadline is not None and time.monotonic() >= st.deadline else CANCELLED

    def _release(self, st: Call) -> None:
        if st.counted:
            st.counted = False
            if st.charged and st.tokens is not None:
                # A charged stream gets back what it did not use: its prompt estimate and the
                # tokens it was sent, every request, are what it used (a unary call keeps its
                # charge: its answer's tokens are not counted).
                self.relay.admission.refund(st.admitted, st.charged, st.prompt + st.tokens.generated)
            # A unary call's time since its message was read (where per-model limits admit it)
            # steers an adaptive limit; a stream's life is not a latency.
            tel = st.tel if st.kind == UNARY else None
            self.relay.admission.release(st.admitted, time.perf_counter() - tel.start if tel else None)

    def _begin(self, st: Call, model: str, version: str) -> Any:
        if self.relay.retries:
            retried = self.relay.retries.resume(st.path)
            if retried is not None:
                return retried  # the retry of a refused call closes the refused call's observation
        name, attrs = st.span
        return self.telemetry.begin(model, version, PROTOCOL_GRPC, st.traceparent, name, attrs)

    def _finish(self, st: Call, code: str) -> None:
        """Close the call's observations with ``code``."""
        outcome = self.relay.outcome(code)
        if st.kind == STREAM:
            assert st.pending is not None
            tokens = st.tokens
            for tel, size in st.pending.drain():
                if tokens is not None:
                    tokens.closed(tel, code != OK)
                self.telemetry.end(tel, code, outcome, size, 0)
            return
        if st.tel is None:
            st.tel = self._begin(st, MODEL_NONE, "")
        self.telemetry.end(st.tel, code, outcome, st.req_bytes, st.resp_bytes)

    # ---------------------------------------------------------------- client -> upstream
    def from_client(self, data: bytes) -> None:
        buf = self.c_buf
        buf += data
        out: list[bytes] = self.held if self.held is not None else []
        pos = 0
        if self.c_preface:
            if len(buf) < 24:
                return
            if bytes(buf[:24]) != PREFACE:
                self.client.close()  # not HTTP/2 with prior knowledge: not a gRPC client
                return
            self.c_preface = False
            pos = 24
            if not self.local:
                out.append(PREFACE)
        end = len(buf)
        run = pos  # start of bytes forwarded as they are
        while end - pos >= 9:
            length = int.from_bytes(buf[pos : pos + 3], "big")
            stop = pos + 9 + length
            if stop > end:
                break
            ftype, flags = buf[pos + 3], buf[pos + 4]
            sid = int.from_bytes(buf[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
            replace: bytes | None = None
            if sid in self.refused:
                replace = b""  # a call the relay answered: nothing of it goes upstream
                if ftype == DATA and stop > pos + 9:
                    self._write_client(frame(WINDOW_UPDATE, 0, 0, (stop - pos - 9).to_bytes(4, "big")))
                if ftype == RST_STREAM or (ftype == DATA and flags & END_STREAM):
                    self.refused.discard(sid)
            elif ftype == DATA:
                st = self.streams.get(sid)
                if st is not None:
                    replace = self._client_data(st, sid, flags, buf, pos + 9, stop, out)
                elif self.local:
                    replace = b""
            elif ftype in (HEADERS, CONTINUATION):
                run = _splice(out, buf, run, pos)  # a block that waits for its message takes its place
                replace = self._client_headers(
                    sid, ftype, flags, bytes(buf[pos + 9 : stop]), bytes(buf[pos:stop]), out
                )
            elif ftype == SETTINGS:
                if self.local:
                    replace = frame(SETTINGS, ACK, 0) if not flags & ACK else b""
                    self._write_client(replace)
                    replace = b""
                elif not flags & ACK:
                    replace = frame(SETTINGS, 0, 0, settings_without_table(bytes(buf[pos + 9 : stop])))
                    if self.up is None:
                        self.unacked_settings += 1
            elif ftype == RST_STREAM:
                st = self.streams.pop(sid, None)
                if st is not None and not st.dropped:
                    if st.hole >= 0:  # cancelled before its message: its headers go up first
                        self._fill_hole(sid, st, out, MODEL_NONE, "")
                    self._release(st)
                    self._finish(st, self._gone_code(st))
                elif st is not None and st.answer is not None:  # cancelled before our answer
                    name = self._gone_code(st)
                    self.telemetry.end(self._begin(st, MODEL_NONE, ""), name, self.relay.outcome(name), 0, 0)
                if self.local or (st is not None and st.dropped):
                    replace = b""
            elif self.local:
                if ftype == PING and not flags & ACK:
                    self._write_client(frame(PING, ACK, 0, bytes(buf[pos + 9 : stop])))
                replace = b""
            if replace is not None:
                run = _splice(out, buf, run, pos, stop, replace)
            pos = stop
        _splice(out, buf, run, pos)
        del buf[:pos]
        if self.holes:
            self.held = out  # written once every waiting block has its message
            if sum(map(len, out)) > MAX_HELD_BYTES:
                self._fill_holes(out)  # a client that withholds a message: stop waiting for it
            else:
                return
        self.held = None
        if out and not self.local:
            payload = b"".join(out)
            if self.up is not None:
                self.up.write(payload)
            else:
                self.waiting.append(payload)
                if sum(map(len, self.waiting)) > MAX_HELD_BYTES:
                    self.client.pause_reading()  # resumed once connected or closed

    def _write_client(self, data: bytes) -> None:
        if data and not self.client.is_closing():
            if self.settings_out:
                self.client.write(data)
            else:  # the server's first frame must be its SETTINGS, still on their way
                self.early.append(data)

    def _client_headers(
        self, sid: int, ftype: int, flags: int, payload: bytes, raw: bytes, out: list[bytes]
    ) -> bytes | None:
        """Collect a header block; on its end, open the call (or pass trailers). Returns what to forward."""
        if ftype == HEADERS:
            self.c_block = [sid, flags, [block_of(HEADERS, flags, payload)], [raw]]
        elif self.c_block is None or self.c_block[0] != sid:
            self.client.close()  # CONTINUATION out of place: a protocol error
            return b""
        else:
            self.c_block[2].append(payload)
            self.c_block[3].append(raw)
            flags = flags | (self.c_block[1] & END_STREAM)
        if not flags & END_HEADERS:
            return b""  # held until the block is complete
        sid, first_flags, fragments, raws = self.c_block
        self.c_block = None
        block = b"".join(fragments)
        original = b"".join(raws)
        end_stream = first_flags & END_STREAM
        try:
            if self.c_hdr.stateless:
                fields = parse_block(block, _REQUEST_FIELDS)
                rewritten = False
            else:
                # Written with the client's dynamic table: decoded, and written again without
                # one, so the upstream's table stays empty and this block can be edited too.
                block = encode_stateless([(n, v, s) for n, v, _, _, s in self.c_hdr.read_all(block)])
                fields = parse_block(block, _REQUEST_FIELDS)
                rewritten = True
        except (HpackError, hpack.HPACKError) as exc:
            log.warning("unreadable header block from a client", extra={"fields": {"error": str(exc)}})
            return original  # the upstream judges it
        if sid in self.streams or sid <= self.last_sid:
            # Trailers from the client (gRPC sends none): pass them on.
            return header_frames(sid, end_stream, block) if rewritten else original
        self.last_sid = sid
        path = timeout = traceparent = None
        timeout_span = trace_span = None
        for name, value, start, stop in fields:
            if name == _PATH:
                path = value.decode("latin-1")
            elif name == _TIMEOUT:
                timeout, timeout_span = grpc_timeout_seconds(value), (start, stop)
            elif name == _TRACEPARENT:
                traceparent, trace_span = value.decode("latin-1"), (start, stop)
        path = path or ""
        fields = UNARY_PATHS.get(path)
        if fields is not None:
            st = Call(path, UNARY, fields, traceparent)
        elif path == STREAM_PATH:
            st = Call(path, STREAM, STREAM_FIELDS[:2], traceparent)
            if self.relay.streams is not None:
                st.tokens = StreamTokens(self.relay.streams)
        else:
            st = Call(path, OTHER, (0, 0), traceparent)
        relay = self.relay
        if self.goaway_sid is not None and sid > self.goaway_sid:
            # After our GOAWAY: never processed, not counted; the client retries it elsewhere.
            self._write_client(frame(RST_STREAM, 0, sid, REFUSED_STREAM.to_bytes(4, "big")))
            return b""
        if self.local or self.upstream_last is not None:
            self._withhold(sid, st, UNAVAILABLE, self._unavailable_message(), first_flags)
            return b""
        # Admitted on the header block, before the message names the model; with per-model
        # limits a unary call's block waits for its message (as with tracing), admitted then,
        # and a stream is admitted on its first message (its block goes up now: a stream's
        # first message may come much later, and nothing else on the connection may wait).
        later = st.kind != OTHER and not end_stream and relay.admission.per_model
        if later:
            st.admit_later = True
        else:
            refusal = relay.admission.acquire(MODEL_NONE)
            if refusal is not None:
                # The fixed overload answer; the upstream never sees the call.
                self._withhold(sid, st, RESOURCE_EXHAUSTED, refusal.message, first_flags)
                return b""
            st.counted = True
        self.streams[sid] = st
        effective = timeout if timeout is not None and timeout <= relay.timeout else relay.timeout
        st.deadline = time.monotonic() + effective
        trace = self.tracing and st.kind != STREAM  # a stream's header goes before any message
        hold = trace or (later and st.kind == UNARY)
        if effective == timeout and not hold:
            # The client's own deadline and no span context to pass: the block goes as it came.
            if st.kind == OTHER:
                st.tel = self._begin(st, MODEL_NONE, "")
            return header_frames(sid, end_stream, block) if rewritten else original
        cut = []
        if effective != timeout and timeout_span is not None:
            cut.append(timeout_span)
        if trace and trace_span is not None:
            cut.append(trace_span)
        block = _without(block, cut)
        if effective != timeout:
            block += literal(_TIMEOUT, grpc_timeout_value(effective))
        if st.kind == OTHER:
            st.tel = self._begin(st, MODEL_NONE, "")
        if not hold:
            return header_frames(sid, end_stream, block)
        if st.kind == OTHER or end_stream:
            # No message to wait for: the span starts now.
            if st.tel is None:
                st.tel = self._begin(st, MODEL_NONE, "")
            return header_frames(sid, end_stream, self._traced(st, block))
        # A unary call: its block waits for the first bytes of its message (normally in the
        # same read), so the span can be started with the model and its context sent up.
        st.block = block
        st.hole = len(out)
        out.append(b"")
        self.holes += 1
        return b""

    def _traced(self, st: Call, block: bytes) -> bytes:
        """``block`` (without the client's traceparent) with the sidecar span's context."""
        if not self.tracing:  # held for admission only: the block goes as it came
            return block
        tp = st.tel.traceparent if st.tel is not None else None
        tp = tp or st.traceparent
        return block + literal(_TRACEPARENT, tp.encode("latin-1")) if tp else block

    def _fill_hole(self, sid: int, st: Call, out: list[bytes], model: str, version: str) -> None:
        """Start the call's observation and put its header block in its place in ``out``."""
        if st.tel is None:
            st.tel = self._begin(st, model, version)
        out[st.hole] = header_frames(sid, 0, self._traced(st, st.block))
        st.hole = -1
        st.block = b""
        self.holes -= 1

    def _fill_holes(self, out: list[bytes]) -> None:
        """Send every waiting block now with the client's own traceparent (the observation
        starts when the message comes, as without tracing)."""
        for sid, st in self.streams.items():
            if st.hole >= 0:
                if st.admit_later and not self._admit_held(st, MODEL_NONE, out):
                    continue  # shed: answered by the relay when its message head comes
                out[st.hole] = header_frames(sid, 0, self._traced(st, st.block))
                st.hole = -1
                st.block = b""
        self.holes = 0

    def _client_data(
        self, st: Call, sid: int, flags: int, buf: bytearray, start: int, stop: int, out: list
    ) -> bytes | None:
        """Observe a DATA frame of a call; returns a replacement (b"" drops it) or None to forward."""
        if st.dropped:
            if stop > start:
                # Bytes the upstream never sees: credit the client's connection window ourselves.
                self._write_client(frame(WINDOW_UPDATE, 0, 0, (stop - start).to_bytes(4, "big")))
            if st.answer is not None:
                self._answer_with_head(sid, st, flags, buf, start, stop)
            return b""
        if st.kind != STREAM:
            st.req_bytes += stop - start  # DATA payload: the message and its 5-byte gRPC prefix
        scan = st.scan_in
        if scan is None and st.charge is None:
            return None
        data = bytes(buf[start:stop])
        if flags & PADDED and data:
            data = data[1 : len(data) - data[0]]
        if st.charge is not None:
            # A charged message going by: admitted on its last byte (or the client's end),
            # before that frame goes up.
            client_done = bool(flags & END_STREAM)
            if (st.charge.feed(data) or client_done) and not self._admit_charged(sid, st, client_done, out):
                if stop > start:  # bytes the upstream never sees: credit the client's window
                    self._write_client(frame(WINDOW_UPDATE, 0, 0, (stop - start).to_bytes(4, "big")))
                return b""
            if scan is None:
                return None
        heads: list = []
        scan.feed(data, heads)
        offset = st.data_in  # the call's DATA bytes before this frame
        st.data_in += len(data)
        relay = self.relay
        for length, head, compressed in heads:
            model = version = rid = ""
            if not compressed:
                model, version, rid = read_strings(
                    head, *st.fields, STREAM_FIELDS[2] if st.kind == STREAM else 0, partial=True
                )
            tokens = 0
            if st.admit_later and self._charged(st, model, length):
                # A tokens bucket: the charge is read from the whole message (its head, then the
                # rest of this frame). Complete here: admitted now, as usual. Else the call's
                # header block goes up and it is admitted on the message's last byte
                # (``_admit_charged``): the upstream has not the whole message before that.
                charge = RequestCharge(length, bool(compressed))
                charge.feed(head)
                rest = 5 + len(head) - offset  # the first message begins at the call's byte 5
                if rest < len(data):
                    charge.feed(data[rest:])
                if charge.done or flags & END_STREAM:
                    tokens = charge.tokens()
                else:
                    st.admit_later = False
                    st.charge = charge
                    st.admitted = model
            if st.hole >= 0:
                if st.admit_later and not self._admit_held(st, model, out, tokens):
                    # Shed by a per-model limit: its block never went up, nor will its message.
                    if stop > start:
                        self._write_client(frame(WINDOW_UPDATE, 0, 0, (stop - start).to_bytes(4, "big")))
                    st.req_bytes = length + 5
                    self._answer(sid, st, model, version, bool(flags & END_STREAM))
                    return b""
                self._fill_hole(sid, st, out, model, version)
            elif st.admit_later and not self._admit_stream(
                sid, st, model, version, length, bool(flags & END_STREAM), out, tokens
            ):
                if stop > start:  # bytes the upstream never sees: credit the client's window
                    self._write_client(frame(WINDOW_UPDATE, 0, 0, (stop - start).to_bytes(4, "big")))
                return b""
            if length > relay.max_message:
                # Over the limit: stop the call upstream and answer the client ourselves.
                self._finish_over_limit(sid, st, model, version, out)
                return b""
            if st.kind == UNARY:
                if st.tel is None:
                    st.tel = self._begin(st, model, version)
                st.scan_in = None  # one request message: nothing more to read
                break
            assert st.pending is not None
            st.pending.add(rid, self._begin(st, model, version), length + 5)
        if st.hole >= 0 and flags & END_STREAM:  # the call ended without a whole message head
            if st.admit_later and not self._admit_held(st, MODEL_NONE, out):
                self._answer(sid, st, MODEL_NONE, "", True)
                return b""
            self._fill_hole(sid, st, out, MODEL_NONE, "")
        return None

    def _charged(self, st: Call, model: str, length: int) -> bool:
        """Whether the call's message pays ``model``'s tokens bucket (a ModelInferRequest of a
        model with one; a message over the size limit is refused anyway)."""
        return (
            bool(model)
            and (st.kind == STREAM or st.path == INFER_PATH)
            and length <= self.relay.max_message
            and self.relay.admission.charges_tokens(model)
        )

    def _admit_held(self, st: Call, model: str, out: list, tokens: int = 0) -> bool:
        """Admit a call held for its model (per-model limits). Refused: its held block is
        dropped and the call marked as answered by the relay (``st.answer``); False."""
        st.admit_later = False
        refusal = self.relay.admission.acquire(model, tokens)  # no queue here: a full model sheds at once
        if refusal is None:
            st.counted = True
            st.admitted = model
            return True
        out[st.hole] = b""
        st.hole = -1
        st.block = b""
        self.holes -= 1
        st.dropped = True
        st.answer = (RESOURCE_EXHAUSTED, refusal.message)
        return False

    def _admit_stream(
        self,
        sid: int,
        st: Call,
        model: str,
        version: str,
        length: int,
        client_done: bool,
        out: list,
        tokens: int = 0,
    ) -> bool:
        """Admit a stream on its first message (per-model limits). Refused (False): it is
        counted once, as that message (the model's request, RESOURCE_EXHAUSTED) and answered
        here; its upstream half, which saw only the header block, is reset; the client's later
        frames are dropped."""
        st.admit_later = False
        refusal = self.relay.admission.acquire(model, tokens)  # no queue here, as for unary calls
        if refusal is None:
            st.counted = True
            st.admitted = model
            if tokens:
                st.charged, st.prompt = tokens, prompt_estimate(length)
            return True
        assert st.pending is not None
        st.pending.add("", self._begin(st, model, version), length + 5)
        self._shed_here(sid, st, client_done, out, refusal.message)
        return False

    def _admit_charged(self, sid: int, st: Call, client_done: bool, out: list) -> bool:
        """Admit a call whose message's charge is known now, on the frame with the message's
        last byte (or the client's end), before it goes up. Refused (False): answered here and
        counted (its observation is open), its upstream half, which saw the header block and
        the message's first bytes, reset: the upstream never had the whole message, so it ran
        nothing; the client's later frames are dropped."""
        charge, st.charge = st.charge, None
        tokens = charge.tokens()
        refusal = self.relay.admission.acquire(st.admitted, tokens)
        if refusal is None:
            st.counted = True
            if st.kind == STREAM:
                st.charged, st.prompt = tokens, prompt_estimate(charge.length)
            return True
        self._shed_here(sid, st, client_done, out, refusal.message)
        return False

    def _shed_here(self, sid: int, st: Call, client_done: bool, out: list, message: str) -> None:
        """Shed a call whose header block already went up: its upstream half reset (CANCEL,
        before the frame in hand), the client answered RESOURCE_EXHAUSTED here, its later
        frames dropped."""
        out.append(frame(RST_STREAM, 0, sid, CANCEL.to_bytes(4, "big")))
        st.dropped = True
        self.streams.pop(sid, None)
        if not client_done:
            self.refused.add(sid)
        self._write_client(
            self._end_here(sid, st, RESOURCE_EXHAUSTED, message)
            + frame(RST_STREAM, 0, sid, NO_ERROR.to_bytes(4, "big"))
        )

    def _finish_over_limit(self, sid: int, st: Call, model: str, version: str, out: list) -> None:
        out.append(frame(RST_STREAM, 0, sid, CANCEL.to_bytes(4, "big")))
        st.dropped = True
        if st.kind == STREAM:
            assert st.pending is not None
            st.pending.add("", self._begin(st, model, version), 0)
        elif st.tel is None:
            st.tel = self._begin(st, model, version)
        message = f"inferwatch sidecar: message larger than {self.relay.max_message} bytes"
        self._write_client(
            self._end_here(sid, st, RESOURCE_EXHAUSTED, message)
            + frame(RST_STREAM, 0, sid, NO_ERROR.to_bytes(4, "big"))
        )

    # ---------------------------------------------------------------- the relay's own answers
    def _end_here(self, sid: int, st: Call, code: str, message: str) -> bytes:
        """End a call in flight with the relay's own ``code``: its admission released, its
        observations closed, and the trailers for the client returned (trailers-only when no
        response headers went out)."""
        self._release(st)
        self._finish(st, code)
        return frame(HEADERS, END_HEADERS | END_STREAM, sid, _trailers(code, message, not st.headers_out))

    def _unavailable_message(self) -> str:
        host, port = self.relay.upstream
        return f"inferwatch sidecar: upstream {host}:{port} unavailable"

    def _withhold(self, sid: int, st: Call, code: str, message: str, flags: int) -> None:
        """Keep a call from the upstream and answer it ourselves once its model is known."""
        st.dropped = True
        st.answer = (code, message)
        self.streams[sid] = st
        if flags & END_STREAM or st.scan_in is None:
            self._answer(sid, st, MODEL_NONE, "", bool(flags & END_STREAM))

    def _answer_with_head(
        self, sid: int, st: Call, flags: int, buf: bytearray, start: int, stop: int
    ) -> None:
        data = bytes(buf[start:stop])
        if flags & PADDED and data:
            data = data[1 : len(data) - data[0]]
        heads: list = []
        if st.scan_in is not None:
            st.scan_in.feed(data, heads)
        if heads:
            length, head, compressed = heads[0]
            model, version = MODEL_NONE, ""
            if not compressed and st.fields[0]:
                model, version, _ = read_strings(head, *st.fields, partial=True)
            st.req_bytes = length + 5
            self._answer(sid, st, model, version, bool(flags & END_STREAM))
        elif flags & END_STREAM:
            self._answer(sid, st, MODEL_NONE, "", True)

    def _answer(self, sid: int, st: Call, model: str, version: str, client_done: bool) -> None:
        """Count and send the relay's own answer to a withheld call."""
        assert st.answer is not None
        code, message = st.answer
        st.answer = None
        self.telemetry.end(self._begin(st, model, version), code, self.relay.outcome(code), st.req_bytes, 0)
        self.streams.pop(sid, None)
        if not client_done:
            self.refused.add(sid)
        self._write_answer(sid, code, message)
        self._close_if_local_done()

    def _write_answer(self, sid: int, code: str, message: str) -> None:
        self._write_client(
            frame(HEADERS, END_HEADERS | END_STREAM, sid, _trailers(code, message, True))
            + frame(RST_STREAM, 0, sid, NO_ERROR.to_bytes(4, "big"))
        )

    def _close_if_local_done(self) -> None:
        """Without an upstream, a connection lives until its calls are answered: then GOAWAY and
        close, so the client's next call reconnects and tries the upstream again."""
        if self.local and not self.streams and self.last_sid:
            self._goaway_and_linger()  # answered everything: let the next call reconnect

    def _goaway_and_linger(self) -> None:
        """The two-step GOAWAY, keeping the connection a moment: calls the client sent before it
        read the first GOAWAY are still answered (and counted) rather than lost to a closed
        connection; the client's next calls open a new connection."""
        if self.lingering or self.client.is_closing():
            return
        self.lingering = True
        self.goaway(final=False)

        def finish() -> None:
            self.goaway(final=True)
            self.client.close()

        asyncio.get_running_loop().call_later(LINGER_S, finish)

    # ---------------------------------------------------------------- upstream -> client
    def from_upstream(self, data: bytes) -> None:
        buf = self.u_buf
        buf += data
        out: list[bytes] = []
        pos, end = 0, len(buf)
        run = 0
        while end - pos >= 9:
            length = int.from_bytes(buf[pos : pos + 3], "big")
            stop = pos + 9 + length
            if stop > end:
                break
            ftype, flags = buf[pos + 3], buf[pos + 4]
            sid = int.from_bytes(buf[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
            replace: bytes | None = None
            if ftype == DATA:
                st = self.streams.get(sid)
                if st is not None:
                    if st.dropped:
                        replace = b""
                        if stop > pos + 9 and self.up is not None:
                            self.up.write(frame(WINDOW_UPDATE, 0, 0, (stop - pos - 9).to_bytes(4, "big")))
                    else:
                        self._upstream_data(st, flags, buf, pos + 9, stop)
                        if flags & END_STREAM:  # a body that ends without trailers: gRPC says INTERNAL
                            self._close(sid, st, INTERNAL)
            elif ftype in (HEADERS, CONTINUATION):
                replace = self._upstream_headers(
                    sid, ftype, flags, bytes(buf[pos + 9 : stop]), bytes(buf[pos:stop])
                )
            elif ftype == SETTINGS:
                if not flags & ACK:
                    replace = frame(SETTINGS, 0, 0, settings_without_table(bytes(buf[pos + 9 : stop])))
                    if not self.settings_out:
                        # The client's server preface: what the relay wrote meanwhile follows it.
                        _splice(out, buf, run, pos, pos, replace)
                        if not self.client.is_closing():
                            self.client.write(b"".join(out))
                        out.clear()
                        run = pos
                        replace = b""
                        self._settings_sent()
            elif ftype == GOAWAY and length >= 8:
                replace = self._upstream_goaway(bytes(buf[pos + 9 : stop]))
            elif ftype == RST_STREAM:
                st = self.streams.pop(sid, None)
                if st is not None:
                    if st.dropped:
                        replace = b""
                    else:
                        err = int.from_bytes(buf[pos + 9 : pos + 13], "big") if length >= 4 else 0
                        self._release(st)
                        if err == REFUSED_STREAM and st.kind != STREAM:
                            self.relay.retries.park(
                                st.path, st.tel, lambda st=st: self._finish(st, UNAVAILABLE)
                            )
                        else:
                            self._finish(st, _RESET_CODES.get(err, INTERNAL))
            if replace is not None:
                run = _splice(out, buf, run, pos, stop, replace)
            pos = stop
        _splice(out, buf, run, pos)
        del buf[:pos]
        if out:
            self._write_client(b"".join(out))

    def _upstream_goaway(self, payload: bytes) -> bytes:
        """The upstream is shutting down. Calls past its last stream will not be processed: they
        are answered UNAVAILABLE here and counted, and the client is told that every call it
        sent may be answered (GOAWAY with the highest id), so what it saw and what was counted
        stay equal (a forwarded last id would make it retry those calls unseen by the metrics)."""
        last = int.from_bytes(payload[:4], "big") & MAX_STREAM_ID
        if self.holes and self.held is not None:
            # Blocks still waiting for their message go up now: the upstream refuses them below.
            self._fill_holes(self.held)
            held, self.held = self.held, None
            if self.up is not None:
                self.up.write(b"".join(held))
        out = []
        for sid, st in list(self.streams.items()):
            if sid > last and not st.dropped:
                out.append(self._end_here(sid, st, UNAVAILABLE, "inferwatch sidecar: upstream shutting down"))
                st.dropped = True  # the upstream's later frames for it are dropped
        self.upstream_last = last  # later calls are answered by the relay itself
        out.append(frame(GOAWAY, 0, 0, MAX_STREAM_ID.to_bytes(4, "big") + payload[4:]))
        return b"".join(out)

    def _upstream_data(self, st: Call, flags: int, buf: bytearray, start: int, stop: int) -> None:
        if st.scan_out is None:
            st.resp_bytes += stop - start
            return
        data = bytes(buf[start:stop])
        if flags & PADDED and data:
            data = data[1 : len(data) - data[0]]
        heads: list = []
        st.scan_out.feed(data, heads)
        assert st.pending is not None
        tokens = st.tokens
        for length, head, compressed in heads:
            error = rid = ""
            final = None
            if not compressed:
                error, _model, rid, final = stream_response_info(head, partial=True)
                if tokens is not None:
                    tokens.response(st.pending, head, rid, error)
            entry = st.pending.take(rid, bool(error), final)
            if entry is not None:
                tel, size = entry
                if tokens is not None:
                    tokens.closed(tel)
                code = stream_error_code(error) if error else OK
                self.telemetry.end(tel, code, self.relay.outcome(code), size, length)

    def _upstream_headers(self, sid: int, ftype: int, flags: int, payload: bytes, raw: bytes) -> bytes | None:
        if ftype == HEADERS:
            self.u_block = [sid, flags, [block_of(HEADERS, flags, payload)], [raw]]
        elif self.u_block is None or self.u_block[0] != sid:
            return None
        else:
            self.u_block[2].append(payload)
            self.u_block[3].append(raw)
        if not flags & END_HEADERS:
            return b""
        sid, first_flags, fragments, raws = self.u_block
        self.u_block = None
        original = b"".join(raws)
        try:
            if self.u_hdr.stateless and not first_flags & END_STREAM:
                fields = []  # response headers: nothing needed, and no table to follow
            else:
                fields = self.u_hdr.read(b"".join(fragments), _RESPONSE_FIELDS)
        except (HpackError, hpack.HPACKError) as exc:
            log.warning("unreadable header block from the upstream", extra={"fields": {"error": str(exc)}})
            fields = []
        st = self.streams.get(sid)
        if st is None:
            return original
        if st.dropped:
            if first_flags & END_STREAM:
                self.streams.pop(sid, None)
            return b""
        if not first_flags & END_STREAM:
            st.headers_out = True
            return original
        status = http = None
        for name, value, _s, _e in fields:
            if name == _GRPC_STATUS:
                status = value
            elif name == _STATUS:
                http = value
        if status is not None and status.isdigit() and int(status) in CODE_NAMES:
            code = CODE_NAMES[int(status)]
        elif http is not None and http != b"200" and http.isdigit():
            code = _HTTP_TO_GRPC.get(int(http), UNAVAILABLE if int(http) in _HTTP_UNAVAILABLE else UNKNOWN)
        else:
            code = UNKNOWN
        self._close(sid, st, code)
        return original

    def _close(self, sid: int, st: Call, code: str) -> None:
        self.streams.pop(sid, None)
        self._release(st)
        self._finish(st, code)
