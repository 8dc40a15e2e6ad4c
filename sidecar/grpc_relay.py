"""The gRPC proxy as an HTTP/2 frame relay: the lean engine of the sidecar's gRPC side.

grpc.aio spends about half a millisecond of CPU per proxied call on its own machinery (see
``benchmarks/RESULTS.md``); a relay that forwards HTTP/2 frames as they are, one client
connection to one upstream connection, costs a small fraction of that. It reads only what the
metrics need:

- **SETTINGS** are forwarded with ``SETTINGS_HEADER_TABLE_SIZE = 0`` in both directions, so
  both encoders switch their HPACK dynamic table off after the handshake (RFC 7541 4.2). Every
  header block after that is self-contained: the relay parses it without state, and may drop
  or append a header field without desynchronising the two ends. Until an encoder has switched
  (its first blocks, before it saw our SETTINGS), ``hpack``'s full decoder follows it and the
  relay forwards those blocks untouched.
- **HEADERS** from the client: ``:path`` (the method) and ``grpc-timeout``; the relay adds
  ``grpc-timeout`` when the client set none or a longer one (the per-request timeout), so the
  upstream enforces both deadlines. From the upstream: ``grpc-status`` in the trailers closes
  the observation with that code.
- **DATA**: the first bytes of each gRPC message (model name, version, request id: fields 1-3,
  ``sidecar.grpc_wire``); the rest is forwarded without a look. For ``ModelStreamInfer`` every
  message on both sides is observed, as in ``sidecar.grpc_proxy``.
- **RST_STREAM**: a client's cancel goes upstream as it is, so the upstream stops working.

Flow control, PING, PRIORITY and GOAWAY pass through untouched, so the two ends negotiate
with each other. The relay synthesises frames only where it must answer itself, always with
stateless header representations: the upstream cannot be reached (every call gets
UNAVAILABLE, then GOAWAY so the client reconnects), it dropped the connection (open calls get
UNAVAILABLE trailers), or the in-flight limit or the message-size limit refuses a call
(RESOURCE_EXHAUSTED).

Counting is the same contract as ``sidecar.grpc_proxy``. One difference: the upstream receives
the client's ``traceparent`` unchanged, so with tracing on the sidecar's span and the model
server's are siblings under the client's span (the gRPC relay never re-encodes headers to
replace it).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import struct
import time
from typing import Any

import hpack

from inferwatch.contract import MODEL_NONE, PROTOCOL_GRPC
from sidecar.grpc_proxy import (
    SERVICE,
    STREAM_METHOD,
    UNARY_METHODS,
    span_attributes,
    stream_error_code,
    upstream_target,
)
from sidecar.grpc_wire import read_strings, stream_response_info
from sidecar.telemetry import GRPC_CODES, UPSTREAM_GRPC

log = logging.getLogger("inferwatch.sidecar.grpc")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# Frame types and flags (RFC 9113).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    range(10)
)
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
# Error codes.
NO_ERROR, PROTOCOL_ERROR, CANCEL, REFUSED_STREAM = 0x0, 0x1, 0x8, 0x7
SETTINGS_HEADER_TABLE_SIZE = 1
MAX_STREAM_ID = 0x7FFFFFFF
# Seconds a connection stays open after the relay's own GOAWAY (the client closes it sooner).
LINGER_S = 2.0
# Seconds between TCP probes of the upstream while it is up / down.
PROBE_UP_S, PROBE_DOWN_S = 5.0, 0.5
# Bytes of each gRPC message read for its fields (names and ids come first).
HEAD_BYTES = 512

_CODE_NAMES = {v: k for k, v in GRPC_CODES.items()}
# gRPC over HTTP: a non-200 answer without grpc-status maps to a code (gRPC's http-grpc-status-mapping).
_HTTP_TO_GRPC = {400: "INTERNAL", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "UNIMPLEMENTED"}
_HTTP_UNAVAILABLE = frozenset({429, 502, 503, 504})

_STATIC = hpack.table.HeaderTable.STATIC_TABLE  # RFC 7541 Appendix A, 1-based in the protocol
_PATH, _STATUS = b":path", b":status"
_TIMEOUT, _GRPC_STATUS, _TRACEPARENT = b"grpc-timeout", b"grpc-status", b"traceparent"
_REQUEST_FIELDS = frozenset({_PATH, _TIMEOUT, _TRACEPARENT})
_RESPONSE_FIELDS = frozenset({_STATUS, _GRPC_STATUS})
_TIMEOUT_UNITS = {
    ord("H"): 3600.0,
    ord("M"): 60.0,
    ord("S"): 1.0,
    ord("m"): 1e-3,
    ord("u"): 1e-6,
    ord("n"): 1e-9,
}

# Span name and attributes per method path, built once.
_SPANS: dict[str, tuple[str, dict[str, str]]] = {}

# Method kinds.
_UNARY, _STREAM, _OTHER = 0, 1, 2


class HpackError(ValueError):
    """A header block the stateless reader cannot take (the peer still uses its dynamic table)."""


def _int(buf: bytes, pos: int, prefix: int) -> tuple[int, int]:
    """An HPACK integer with an N-bit prefix starting at ``pos`` (RFC 7541 5.1)."""
    mask = (1 << prefix) - 1
    value = buf[pos] & mask
    pos += 1
    if value < mask:
        return value, pos
    shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value += (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 28:
            raise HpackError("integer too long")


def _string(buf: bytes, pos: int) -> tuple[bytes, int]:
    huffman = buf[pos] & 0x80
    length, pos = _int(buf, pos, 7)
    end = pos + length
    if end > len(buf):
        raise HpackError("string past the end of the block")
    raw = bytes(buf[pos:end])
    return (hpack.huffman_table.decode_huffman(raw) if huffman else raw), end


def parse_block(block: bytes, wanted: frozenset[bytes] | None = None) -> list[tuple[bytes, bytes, int, int]]:
    """(name, value, start, end) of each field of a header block that uses no dynamic table.

    With ``wanted``, only those fields are returned (the others are stepped over without
    decoding their values). Raises HpackError on a reference to the dynamic table or a table
    size above 0.
    """
    out = []
    pos, end = 0, len(block)
    static = _STATIC
    try:
        while pos < end:
            start = pos
            b = block[pos]
            if b & 0x80:  # indexed field
                index = b & 0x7F
                pos += 1
                if not 0 < index <= len(static):
                    raise HpackError(f"dynamic table index {index}")
                name, value = static[index - 1]
                if wanted is None or name in wanted:
                    out.append((name, value, start, pos))
                continue
            if b & 0xE0 == 0x20:  # dynamic table size update
                size, pos = _int(block, pos, 5)
                if size:
                    raise HpackError("dynamic table switched on")
                continue
            # Literal: with incremental indexing (01), without (0000) or never indexed (0001).
            index, pos = _int(block, pos, 6 if b & 0x40 else 4)
            if index:
                if index > len(static):
                    raise HpackError(f"dynamic table index {index}")
                name = static[index - 1][0]
            elif block[pos] < 0x7F:  # short raw name: the common case, read in place
                n = block[pos]
                name = bytes(block[pos + 1 : pos + 1 + n])
                pos += 1 + n
            else:
                name, pos = _string(block, pos)
            if wanted is not None and name not in wanted:
                vlen, pos = _int(block, pos, 7)
                pos += vlen
                if pos > end:
                    raise HpackError("string past the end of the block")
                continue
            value, pos = _string(block, pos)
            out.append((name, value, start, pos))
    except IndexError:
        raise HpackError("truncated header block") from None
    return out


def _hpack_int(value: int, prefix: int, first: int) -> bytes:
    mask = (1 << prefix) - 1
    if value < mask:
        return bytes([first | value])
    out = bytearray([first | mask])
    value -= mask
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """A field as 'literal without indexing, new name', raw strings: it touches no table."""
    return b"\x00" + _hpack_int(len(name), 7, 0) + name + _hpack_int(len(value), 7, 0) + value


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((ftype, flags)) + sid.to_bytes(4, "big") + payload


def grpc_timeout_seconds(value: bytes) -> float | None:
    if len(value) < 2 or value[-1] not in _TIMEOUT_UNITS or not value[:-1].isdigit():
        return None
    return int(value[:-1]) * _TIMEOUT_UNITS[value[-1]]


def grpc_timeout_value(seconds: float) -> bytes:
    ms = max(1, int(seconds * 1000))
    return f"{ms}m".encode() if ms < 100_000_000 else f"{max(1, int(seconds))}S".encode()


def _settings_without_table(payload: bytes) -> bytes:
    """A SETTINGS payload with HEADER_TABLE_SIZE forced to 0."""
    out = bytearray()
    for i in range(0, len(payload) - len(payload) % 6, 6):
        if int.from_bytes(payload[i : i + 2], "big") != SETTINGS_HEADER_TABLE_SIZE:
            out += payload[i : i + 6]
    out += struct.pack(">HI", SETTINGS_HEADER_TABLE_SIZE, 0)
    return bytes(out)


def _block_of(ftype: int, flags: int, payload: bytes) -> bytes:
    """The header block fragment of a HEADERS (padding and priority removed) or CONTINUATION."""
    if ftype == HEADERS:
        if flags & PADDED:
            pad = payload[0]
            payload = payload[1 : len(payload) - pad]
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
    return payload


class HeaderReader:
    """Header blocks of one direction: hpack's decoder until the peer's table is off, then stateless."""

    __slots__ = ("full", "stateless")

    def __init__(self) -> None:
        self.full: hpack.Decoder | None = hpack.Decoder()
        self.stateless = False

    def read(self, block: bytes, wanted: frozenset[bytes]) -> list[tuple[bytes, bytes, int, int]]:
        """The ``wanted`` fields, with their spans when stateless (editable), else spans of -1."""
        if self.stateless:
            return parse_block(block, wanted)
        assert self.full is not None
        fields = [
            (bytes(n), bytes(v), -1, -1) for n, v in self.full.decode(block, raw=True) if bytes(n) in wanted
        ]
        if self.full.header_table.maxsize == 0 and not self.full.header_table.dynamic_entries:
            self.stateless, self.full = True, None
        return fields


def _trailers(code: int, message: str, with_headers: bool) -> bytes:
    """A trailers block the relay writes itself (:status and content-type when no headers went out)."""
    block = b""
    if with_headers:
        block += b"\x88" + literal(b"content-type", b"application/grpc")  # 0x88: static ':status: 200'
    block += literal(b"grpc-status", str(code).encode())
    if message:
        block += literal(b"grpc-message", message.encode("ascii", "replace"))
    return block


class _Scan:
    """Splits one direction of a stream into gRPC messages; reports each message's head."""

    __slots__ = ("head", "head_compressed", "length", "prefix", "remaining", "want")

    def __init__(self) -> None:
        self.prefix = b""
        self.remaining = 0
        self.length = 0
        self.head: bytearray | None = None
        self.head_compressed = 0
        self.want = 0

    def feed(self, data: bytes, out: list) -> None:
        """Append (message length, head bytes, compressed) for each head completed in ``data``."""
        i, n = 0, len(data)
        while i < n:
            if self.remaining == 0 and self.head is None:
                need = 5 - len(self.prefix)
                self.prefix += data[i : i + need]
                i += need
                if len(self.prefix) < 5:
                    return
                compressed = self.prefix[0]
                self.length = self.remaining = int.from_bytes(self.prefix[1:5], "big")
                self.prefix = b""
                self.want = min(self.length, HEAD_BYTES)
                if self.want == 0:
                    out.append((0, b"", compressed))
                    continue
                self.head = bytearray()
                self.head_compressed = compressed
            take = min(n - i, self.remaining)
            if self.head is not None:
                h = min(take, self.want - len(self.head))
                self.head += data[i : i + h]
                if len(self.head) >= self.want:
                    out.append((self.length, bytes(self.head), self.head_compressed))
                    self.head = None
            self.remaining -= take
            i += take


class _Stream:
    """One HTTP/2 stream (one gRPC call) between ``begin`` and its trailers."""

    __slots__ = (
        "answer",
        "counted",
        "deadline",
        "dropped",
        "fields",
        "headers_out",
        "kind",
        "obs",
        "path",
        "pending",
        "req_bytes",
        "resp_bytes",
        "scan_in",
        "scan_out",
        "span",
        "started",
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
        self.obs: Any = None
        self.req_bytes = 0
        self.resp_bytes = 0
        self.scan_in: _Scan | None = _Scan() if kind != _OTHER else None
        self.scan_out: _Scan | None = _Scan() if kind == _STREAM else None
        self.pending: dict[str, collections.deque] | None = {} if kind == _STREAM else None
        self.headers_out = False  # response headers went to the client
        self.dropped = False  # the relay answered this call itself; later frames are dropped
        self.counted = False  # holds a place in the in-flight limit
        self.answer: tuple[int, str] | None = None  # the relay's own answer, sent once the model is known
        self.deadline: float | None = None
        self.started = time.monotonic()


class _ClientSide(asyncio.Protocol):
    def __init__(self, relay: GrpcRelay) -> None:
        self.relay = relay
        self.conn: _Conn | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.conn = _Conn(self.relay, transport)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        assert self.conn is not None
        self.conn.from_client(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.conn is not None:
            self.conn.client_lost()

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
        self.conn.from_upstream(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.upstream_lost(exc)

    def pause_writing(self) -> None:
        self.conn.client.pause_reading()

    def resume_writing(self) -> None:
        self.conn.client.resume_reading()


class _Conn:
    """One client connection and its upstream connection."""

    def __init__(self, relay: GrpcRelay, client: asyncio.Transport) -> None:
        self.relay = relay
        self.tel = relay.tel
        self.client = client
        self.up: asyncio.Transport | None = None
        self.local = False  # the upstream is unreachable: the relay answers every call itself
        self.closing = False
        self.c_buf = bytearray()
        self.u_buf = bytearray()
        self.c_preface = True
        self.c_hdr = HeaderReader()
        self.u_hdr = HeaderReader()
        self.c_block: list | None = None  # [sid, flags, fragments, raw frames] while CONTINUATIONs come
        self.u_block: list | None = None
        self.streams: dict[int, _Stream] = {}
        self.last_sid = 0
        self.waiting: list[bytes] = []  # client bytes for the upstream before it is connected
        self.goaway_sid: int | None = None  # set once we told the client to go away
        self.refused: set[int] = set()  # calls answered by the relay: their later frames are dropped
        self.unacked_settings = 0  # client SETTINGS read before the upstream turned out unreachable
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
        if self.client.is_closing():
            return
        self.client.resume_reading()
        out = [frame(SETTINGS, 0, 0, struct.pack(">HI", SETTINGS_HEADER_TABLE_SIZE, 0))]
        out += [frame(SETTINGS, ACK, 0)] * self.unacked_settings  # the ones that waited for the upstream
        self.unacked_settings = 0
        self.client.write(b"".join(out))
        message = self._unavailable_message()
        for sid, st in list(self.streams.items()):
            self._release(st)
            st.dropped = True
            if st.obs is not None or (st.pending and st.kind == _STREAM):
                self._finish(st, "UNAVAILABLE")
                self._write_answer(sid, 14, message)
                del self.streams[sid]
            else:
                st.answer = (14, message)  # answered when its message (and model) arrives
        self._close_if_local_done()

    def upstream_lost(self, exc: Exception | None) -> None:
        """The upstream closed or reset: every open call fails with UNAVAILABLE, then GOAWAY."""
        self.up = None
        if self.closing:
            return
        self.relay.upstream_state(False, exc)
        out = []
        for sid, st in list(self.streams.items()):
            if not st.dropped:
                self._release(st)
                self._finish(st, "UNAVAILABLE")
                trailers = _trailers(14, "inferwatch sidecar: upstream connection lost", not st.headers_out)
                out.append(frame(HEADERS, END_HEADERS | END_STREAM, sid, trailers))
        self.streams.clear()
        # From here the relay answers this client itself: calls it already sent are answered
        # UNAVAILABLE (counted), later ones are refused by GOAWAY and retried elsewhere.
        self.local = True
        if out:
            self._write_client(b"".join(out))
        self._goaway_and_linger()

    def client_lost(self) -> None:
        for st in self.streams.values():
            if not st.dropped:
                self._release(st)
                self._finish(st, self._gone_code(st))
        self.streams.clear()
        if self.up is not None:
            self.closing = True
            self.up.close()
        self.connect_task.cancel()
        self.relay.conns.discard(self)

    def goaway(self, final: bool) -> None:
        """Graceful shutdown in two steps (RFC 9113 6.8). First a GOAWAY naming the highest
        possible stream: the client opens no new calls here, and a call it sent before reading
        it is still taken and answered. Then (``final``) the real last stream: anything later is
        refused (REFUSED_STREAM: never processed, so the client may retry it elsewhere)."""
        if final:
            self.goaway_sid = self.last_sid
        if not self.client.is_closing():
            last = self.last_sid if final else MAX_STREAM_ID
            self.client.write(frame(GOAWAY, 0, 0, struct.pack(">II", last, NO_ERROR)))

    # ---------------------------------------------------------------- observations
    def _gone_code(self, st: _Stream) -> str:
        return (
            "DEADLINE_EXCEEDED"
            if st.deadline is not None and time.monotonic() >= st.deadline
            else "CANCELLED"
        )

    def _release(self, st: _Stream) -> None:
        if st.counted:
            st.counted = False
            self.relay.active -= 1

    def _begin(self, st: _Stream, model: str, version: str) -> Any:
        name, attrs = st.span
        return self.tel.begin(model, version, PROTOCOL_GRPC, st.traceparent, name, attrs)

    def _finish(self, st: _Stream, code: str) -> None:
        """Close the call's observations with ``code``."""
        outcome = self.relay.outcome(code)
        if st.kind == _STREAM:
            assert st.pending is not None
            for queue in st.pending.values():
                for obs, size in queue:
                    self.tel.end(obs, code, outcome, size, 0)
            st.pending.clear()
            return
        if st.obs is None:
            st.obs = self._begin(st, MODEL_NONE, "")
        self.tel.end(st.obs, code, outcome, st.req_bytes, st.resp_bytes)

    # ---------------------------------------------------------------- client -> upstream
    def from_client(self, data: bytes) -> None:
        buf = self.c_buf
        buf += data
        out: list[bytes] = []
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
                replace = self._client_headers(
                    sid, ftype, flags, bytes(buf[pos + 9 : stop]), bytes(buf[pos:stop])
                )
            elif ftype == SETTINGS:
                if self.local:
                    replace = frame(SETTINGS, ACK, 0) if not flags & ACK else b""
                    self._write_client(replace)
                    replace = b""
                elif not flags & ACK:
                    replace = frame(SETTINGS, 0, 0, _settings_without_table(bytes(buf[pos + 9 : stop])))
                    if self.up is None:
                        self.unacked_settings += 1
            elif ftype == RST_STREAM:
                st = self.streams.pop(sid, None)
                if st is not None and not st.dropped:
                    self._release(st)
                    self._finish(st, self._gone_code(st))
                elif st is not None and st.answer is not None:  # cancelled before our answer
                    name = self._gone_code(st)
                    self.tel.end(self._begin(st, MODEL_NONE, ""), name, self.relay.outcome(name), 0, 0)
                if self.local or (st is not None and st.dropped):
                    replace = b""
            elif self.local:
                if ftype == PING and not flags & ACK:
                    self._write_client(frame(PING, ACK, 0, bytes(buf[pos + 9 : stop])))
                replace = b""
            if replace is not None:
                if run < pos:
                    out.append(bytes(buf[run:pos]))
                if replace:
                    out.append(replace)
                run = stop
            pos = stop
        if run < pos:
            out.append(bytes(buf[run:pos]))
        del buf[:pos]
        if out and not self.local:
            payload = b"".join(out)
            if self.up is not None:
                self.up.write(payload)
            else:
                self.waiting.append(payload)
                if sum(map(len, self.waiting)) > 4 * 1024 * 1024:
                    self.client.pause_reading()  # resumed once connected or closed

    def _write_client(self, data: bytes) -> None:
        if data and not self.client.is_closing():
            self.client.write(data)

    def _client_headers(self, sid: int, ftype: int, flags: int, payload: bytes, raw: bytes) -> bytes | None:
        """Collect a header block; on its end, open the call (or pass trailers). Returns what to forward."""
        if ftype == HEADERS:
            self.c_block = [sid, flags, [_block_of(HEADERS, flags, payload)], [raw]]
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
        try:
            fields = self.c_hdr.read(block, _REQUEST_FIELDS)
        except (HpackError, hpack.HPACKError) as exc:
            log.warning("unreadable header block from a client", extra={"fields": {"error": str(exc)}})
            fields = []
        if sid in self.streams:  # trailers from the client (gRPC sends none): pass them on
            return original
        if sid <= self.last_sid:
            return original
        self.last_sid = sid
        path = timeout = traceparent = None
        timeout_span = None
        for name, value, start, stop in fields:
            if name == _PATH:
                path = value.decode("latin-1")
            elif name == _TIMEOUT:
                timeout, timeout_span = grpc_timeout_seconds(value), (start, stop)
            elif name == _TRACEPARENT:
                traceparent = value.decode("latin-1")
        path = path or ""
        method = path.rsplit("/", 1)[-1] if path.startswith(f"/{SERVICE}/") else ""
        if method in UNARY_METHODS:
            st = _Stream(path, _UNARY, UNARY_METHODS[method], traceparent)
        elif method == STREAM_METHOD:
            st = _Stream(path, _STREAM, (1, 2), traceparent)
        else:
            st = _Stream(path, _OTHER, (0, 0), traceparent)
        relay = self.relay
        if self.goaway_sid is not None and sid > self.goaway_sid and (self.local or self.c_hdr.stateless):
            # After our GOAWAY: never processed, not counted; the client retries it elsewhere.
            self._write_client(frame(RST_STREAM, 0, sid, REFUSED_STREAM.to_bytes(4, "big")))
            return b""
        if self.local or (self.upstream_last is not None and self.c_hdr.stateless):
            self._withhold(sid, st, 14, self._unavailable_message(), first_flags)
            return b""
        if self.c_hdr.stateless and relay.limit and relay.active >= relay.limit:
            # Over the limit; the upstream never sees the call (a stateless block can be withheld).
            message = f"inferwatch sidecar: more than {relay.limit} calls in flight"
            self._withhold(sid, st, 8, message, first_flags)
            return b""
        relay.active += 1
        st.counted = True
        self.streams[sid] = st
        if st.kind == _OTHER:
            st.obs = self._begin(st, MODEL_NONE, "")
        effective = timeout if timeout is not None and timeout <= relay.timeout else relay.timeout
        st.deadline = time.monotonic() + effective
        if effective == timeout or not self.c_hdr.stateless or len(block) > 16000:
            return original  # the client's own deadline, or a block we may not touch
        # Replace (or add) grpc-timeout: stateless representations can be edited freely.
        if timeout_span is not None:
            block = block[: timeout_span[0]] + block[timeout_span[1] :]
        block += literal(_TIMEOUT, grpc_timeout_value(effective))
        return frame(HEADERS, END_HEADERS | (first_flags & END_STREAM), sid, block)

    def _client_data(
        self, st: _Stream, sid: int, flags: int, buf: bytearray, start: int, stop: int, out: list
    ) -> bytes | None:
        """Observe a DATA frame of a call; returns a replacement (b"" drops it) or None to forward."""
        if st.dropped:
            if stop > start:
                # Bytes the upstream never sees: credit the client's connection window ourselves.
                self._write_client(frame(WINDOW_UPDATE, 0, 0, (stop - start).to_bytes(4, "big")))
            if st.answer is not None:
                self._answer_with_head(sid, st, flags, buf, start, stop)
            return b""
        if st.kind != _STREAM:
            st.req_bytes += stop - start  # DATA payload: the message and its 5-byte gRPC prefix
        scan = st.scan_in
        if scan is None:
            return None
        data = bytes(buf[start:stop])
        if flags & PADDED and data:
            data = data[1 : len(data) - data[0]]
        heads: list = []
        scan.feed(data, heads)
        relay = self.relay
        for length, head, compressed in heads:
            model = version = rid = ""
            if not compressed:
                model, version, rid = read_strings(
                    head, *st.fields, 3 if st.kind == _STREAM else 0, partial=True
                )
            if length > relay.max_message:
                # Over the limit: stop the call upstream and answer the client ourselves.
                self._finish_over_limit(sid, st, model, version, out)
                return b""
            if st.kind == _UNARY:
                st.obs = self._begin(st, model, version)
                st.scan_in = None  # one request message: nothing more to read
                break
            obs = self._begin(st, model, version)
            assert st.pending is not None
            queue = st.pending.get(rid)
            if queue is None:
                queue = st.pending[rid] = collections.deque()
            queue.append((obs, length + 5))
        return None

    def _finish_over_limit(self, sid: int, st: _Stream, model: str, version: str, out: list) -> None:
        out.append(frame(RST_STREAM, 0, sid, CANCEL.to_bytes(4, "big")))
        st.dropped = True
        self._release(st)
        if st.kind == _STREAM:
            assert st.pending is not None
            st.pending.setdefault("", collections.deque()).append((self._begin(st, model, version), 0))
        elif st.obs is None:
            st.obs = self._begin(st, model, version)
        self._finish(st, "RESOURCE_EXHAUSTED")
        message = f"inferwatch sidecar: message larger than {self.relay.max_message} bytes"
        self._write_client(
            frame(HEADERS, END_HEADERS | END_STREAM, sid, _trailers(8, message, not st.headers_out))
            + frame(RST_STREAM, 0, sid, NO_ERROR.to_bytes(4, "big"))
        )

    # ---------------------------------------------------------------- the relay's own answers
    def _unavailable_message(self) -> str:
        host, port = self.relay.upstream
        return f"inferwatch sidecar: upstream {host}:{port} unavailable"

    def _withhold(self, sid: int, st: _Stream, code: int, message: str, flags: int) -> None:
        """Keep a call from the upstream and answer it ourselves once its model is known."""
        st.dropped = True
        st.answer = (code, message)
        self.streams[sid] = st
        if flags & END_STREAM or st.scan_in is None:
            self._answer(sid, st, MODEL_NONE, "", bool(flags & END_STREAM))

    def _answer_with_head(
        self, sid: int, st: _Stream, flags: int, buf: bytearray, start: int, stop: int
    ) -> None:
        data = bytes(buf[start:stop])
        if flags & PADDED and data:
            data = data[1 : len(data) - data[0]]
        heads: list = []
        if st.scan_in is not None:
            st.scan_in.feed(data, heads)
        if heads:
            length, head, compressed = heads[0]
            model = version = ""
            if not compressed and st.fields[0]:
                model, version, _ = read_strings(head, *st.fields, partial=True)
            st.req_bytes = length + 5
            self._answer(sid, st, model, version, bool(flags & END_STREAM))
        elif flags & END_STREAM:
            self._answer(sid, st, MODEL_NONE, "", True)

    def _answer(self, sid: int, st: _Stream, model: str, version: str, client_done: bool) -> None:
        """Count and send the relay's own answer to a withheld call."""
        assert st.answer is not None
        code, message = st.answer
        st.answer = None
        name = _CODE_NAMES[code]
        self.tel.end(self._begin(st, model, version), name, self.relay.outcome(name), st.req_bytes, 0)
        self.streams.pop(sid, None)
        if not client_done:
            self.refused.add(sid)
        self._write_answer(sid, code, message)
        self._close_if_local_done()

    def _write_answer(self, sid: int, code: int, message: str) -> None:
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
                            self._close(sid, st, "INTERNAL")
            elif ftype in (HEADERS, CONTINUATION):
                replace = self._upstream_headers(
                    sid, ftype, flags, bytes(buf[pos + 9 : stop]), bytes(buf[pos:stop])
                )
            elif ftype == SETTINGS:
                if not flags & ACK:
                    replace = frame(SETTINGS, 0, 0, _settings_without_table(bytes(buf[pos + 9 : stop])))
            elif ftype == GOAWAY and length >= 8:
                replace = self._upstream_goaway(bytes(buf[pos + 9 : stop]))
            elif ftype == RST_STREAM:
                st = self.streams.pop(sid, None)
                if st is not None:
                    if st.dropped:
                        replace = b""
                    else:
                        err = int.from_bytes(buf[pos + 9 : pos + 13], "big") if length >= 4 else 0
                        code = (
                            "CANCELLED"
                            if err == CANCEL
                            else "UNAVAILABLE"
                            if err == REFUSED_STREAM
                            else "INTERNAL"
                        )
                        self._release(st)
                        self._finish(st, code)
            if replace is not None:
                if run < pos:
                    out.append(bytes(buf[run:pos]))
                if replace:
                    out.append(replace)
                run = stop
            pos = stop
        if run < pos:
            out.append(bytes(buf[run:pos]))
        del buf[:pos]
        if out:
            self._write_client(b"".join(out))

    def _upstream_goaway(self, payload: bytes) -> bytes:
        """The upstream is shutting down. Calls past its last stream will not be processed: they
        are answered UNAVAILABLE here and counted, and the client is told that every call it
        sent may be answered (GOAWAY with the highest id), so what it saw and what was counted
        stay equal (a forwarded last id would make it retry those calls unseen by the metrics)."""
        last = int.from_bytes(payload[:4], "big") & MAX_STREAM_ID
        out = []
        for sid, st in list(self.streams.items()):
            if sid > last and not st.dropped:
                self._release(st)
                self._finish(st, "UNAVAILABLE")
                st.dropped = True  # the upstream's later frames for it are dropped
                trailers = _trailers(14, "inferwatch sidecar: upstream shutting down", not st.headers_out)
                out.append(frame(HEADERS, END_HEADERS | END_STREAM, sid, trailers))
        self.upstream_last = last  # later calls are answered by the relay itself
        out.append(frame(GOAWAY, 0, 0, MAX_STREAM_ID.to_bytes(4, "big") + payload[4:]))
        return b"".join(out)

    def _upstream_data(self, st: _Stream, flags: int, buf: bytearray, start: int, stop: int) -> None:
        if st.scan_out is None:
            st.resp_bytes += stop - start
            return
        data = bytes(buf[start:stop])
        if flags & PADDED and data:
            data = data[1 : len(data) - data[0]]
        heads: list = []
        st.scan_out.feed(data, heads)
        assert st.pending is not None
        for length, head, compressed in heads:
            error = rid = ""
            final = None
            if not compressed:
                error, _model, rid, final = stream_response_info(head, partial=True)
            if final is False:
                continue
            queue = st.pending.get(rid)
            if not queue and error and st.pending:
                queue = next(iter(st.pending.values()))
            if not queue:
                continue
            obs, size = queue.popleft()
            if not queue:
                for key, q in list(st.pending.items()):
                    if not q:
                        del st.pending[key]
            code = stream_error_code(error) if error else "OK"
            self.tel.end(obs, code, self.relay.outcome(code), size, length)

    def _upstream_headers(self, sid: int, ftype: int, flags: int, payload: bytes, raw: bytes) -> bytes | None:
        if ftype == HEADERS:
            self.u_block = [sid, flags, [_block_of(HEADERS, flags, payload)], [raw]]
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
        if status is not None and status.isdigit() and int(status) in _CODE_NAMES:
            code = _CODE_NAMES[int(status)]
        elif http is not None and http != b"200" and http.isdigit():
            code = _HTTP_TO_GRPC.get(
                int(http), "UNAVAILABLE" if int(http) in _HTTP_UNAVAILABLE else "UNKNOWN"
            )
        else:
            code = "UNKNOWN"
        self._close(sid, st, code)
        return original

    def _close(self, sid: int, st: _Stream, code: str) -> None:
        self.streams.pop(sid, None)
        self._release(st)
        self._finish(st, code)


class GrpcRelay:
    """Listens for gRPC clients and relays each connection to the upstream (see module docstring)."""

    def __init__(
        self,
        upstream: str,
        telemetry: Any,
        *,
        timeout_s: float = 60.0,
        max_message_bytes: int = 256 * 1024 * 1024,
        max_concurrent_rpcs: int | None = None,
        connect_timeout_s: float = 2.0,
    ) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream = (host.strip("[]"), int(port))
        self.tel = telemetry
        self.timeout = timeout_s
        self.max_message = max_message_bytes
        self.limit = max_concurrent_rpcs or 0
        self.connect_timeout = connect_timeout_s
        self.active = 0
        self.conns: set[_Conn] = set()
        self._outcomes = {name: telemetry.outcome_for_grpc(name) for name in GRPC_CODES}
        self._server: asyncio.AbstractServer | None = None
        self._probe: asyncio.Task | None = None
        self._up: bool | None = None
        self.port = 0

    def outcome(self, code: str) -> str:
        return self._outcomes.get(code) or self.tel.outcome_for_grpc(code)

    @staticmethod
    def nodelay(sock: Any) -> None:
        import socket

        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ClientSide(self), host, port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        self._probe = loop.create_task(self._probe_upstream())
        log.info(
            "grpc relay listening",
            extra={
                "fields": {"grpc": f"{host}:{self.port}", "upstream_grpc": upstream_target(self.upstream)}
            },
        )
        return self.port

    async def stop(self, grace: float | None = 5.0) -> None:
        """Stop accepting, send GOAWAY, let calls in flight finish for up to ``grace`` seconds."""
        if self._server is not None:
            self._server.close()
        deadline = time.monotonic() + (grace or 0)
        for conn in list(self.conns):
            conn.goaway(final=False)
        # One round trip for calls already on their way, then the real last stream.
        await asyncio.sleep(min(0.2, grace or 0))
        for conn in list(self.conns):
            conn.goaway(final=True)
        while any(c.streams for c in self.conns) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(self.conns):
            conn.client.close()
            if conn.up is not None:
                conn.closing = True
                conn.up.close()
        if self._probe is not None:
            self._probe.cancel()

    def upstream_state(self, up: bool, exc: BaseException | None) -> None:
        if up == self._up:
            return
        self._up = up
        self.tel.set_upstream_up(UPSTREAM_GRPC, up)
        fields = {"upstream_grpc": upstream_target(self.upstream)}
        if up:
            log.info("grpc upstream reachable", extra={"fields": fields})
        else:
            log.warning(
                "grpc upstream unreachable", extra={"fields": {**fields, "error": str(exc or "closed")}}
            )

    async def _probe_upstream(self) -> None:
        """A TCP connect to the upstream, every 0.5 s while it is down and every 5 s while it is
        up, so the gauge follows the upstream without traffic (calls move it sooner)."""
        host, port = self.upstream
        while True:
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), self.connect_timeout)
                writer.close()
                self.upstream_state(True, None)
            except (OSError, TimeoutError) as exc:
                self.upstream_state(False, exc)
            await asyncio.sleep(PROBE_UP_S if self._up else min(PROBE_DOWN_S, self.connect_timeout))
