"""The HTTP/2 relay's own edge cases, against the real Triton: header blocks a client writes before
the SETTINGS exchange, a stream the upstream refuses (REFUSED_STREAM) and the client retries, and
a fault inside the relay itself (its error boundary).

The relay runs in-process (``tests.test_sidecar_grpc.InProcessProxy``) so counts are exact.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import socket
import struct
import time
from collections.abc import Iterator

import grpc
import hpack
import pytest

from inferwatch.logs import JsonFormatter
from sidecar.protocols import grpc_relay_conn
from sidecar.protocols.h2 import (
    ACK,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    MAX_STREAM_ID,
    PING,
    PREFACE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    frame,
)
from tests.test_sidecar_grpc import (
    SERVICE,
    InProcessProxy,
    LoopThread,
    fault,
    raw_infer_request,
    served_models,
    wait_for,
)

pytestmark = pytest.mark.integration

INFER = SERVICE + "ModelInfer"


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    thread = LoopThread()
    try:
        yield thread.loop
    finally:
        thread.stop()


@pytest.fixture(scope="module")
def served(triton) -> dict[str, list[str]]:
    return served_models(triton.grpc_url)


def grpc_message(body: bytes) -> bytes:
    return b"\x00" + len(body).to_bytes(4, "big") + body


class H2Client:
    """A raw HTTP/2 client on one socket: acknowledges SETTINGS and PING as a client must, and
    records each stream's last header block (decoded), which streams ended, and GOAWAYs."""

    def __init__(self, url: str) -> None:
        host, port = url.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.decoder = hpack.Decoder()
        self.buf = b""
        self.blocks: dict[int, bytes] = {}
        self.trailers: dict[int, dict[str, str]] = {}
        self.ended: set[int] = set()
        self.goaways: list[int] = []  # last-stream ids, in order
        self.types: list[int] = []  # every frame's type, in order

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def close(self) -> None:
        self.sock.close()

    def until(self, done, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"{what} not reached after {timeout}s: {self.trailers} {self.goaways}")
            self.sock.settimeout(remaining)
            chunk = self.sock.recv(65536)
            if not chunk:
                raise AssertionError(f"connection closed before {what}: {self.trailers} {self.goaways}")
            self.buf += chunk
            self._frames()

    def _frames(self) -> None:
        while len(self.buf) >= 9:
            length = int.from_bytes(self.buf[:3], "big")
            if len(self.buf) < 9 + length:
                return
            ftype, flags = self.buf[3], self.buf[4]
            sid = int.from_bytes(self.buf[5:9], "big") & 0x7FFFFFFF
            payload, self.buf = self.buf[9 : 9 + length], self.buf[9 + length :]
            self.types.append(ftype)
            if ftype == SETTINGS and not flags & ACK:
                self.sock.sendall(frame(SETTINGS, ACK, 0))
            elif ftype == PING and not flags & ACK:
                self.sock.sendall(frame(PING, ACK, 0, payload))
            elif ftype in (HEADERS, CONTINUATION):
                self.blocks[sid] = self.blocks.get(sid, b"") + payload
                if flags & END_HEADERS:
                    block = self.blocks.pop(sid)
                    self.trailers[sid] = {
                        k.decode(): v.decode() for k, v in self.decoder.decode(block, raw=True)
                    }
                if flags & END_STREAM:
                    self.ended.add(sid)
            elif ftype == DATA and flags & END_STREAM:
                self.ended.add(sid)
            elif ftype == RST_STREAM:
                self.ended.add(sid)
                self.trailers.setdefault(sid, {})["rst"] = str(int.from_bytes(payload[:4], "big"))
            elif ftype == GOAWAY:
                self.goaways.append(int.from_bytes(payload[:4], "big") & MAX_STREAM_ID)


def call_headers(url: str) -> list[tuple[str, str]]:
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", INFER),
        (":authority", url),
        ("te", "trailers"),
        ("content-type", "application/grpc"),
        ("x-team", "search"),
    ]


def test_blocks_sent_before_the_settings_exchange_are_edited_and_limited(loop, triton, served) -> None:
    """A client that writes its first calls with its HPACK dynamic table on, before it has read
    the server's SETTINGS: the relay still adds its grpc-timeout (Triton ends the slow call at the
    sidecar's timeout) and still applies the in-flight limit (the second call is refused)."""
    fault(triton.state_dir, "set", "--model", "ranker", "--version", "1", "--extra-latency-ms", "3000")
    p = InProcessProxy(loop, "relay", triton.grpc_url, request_timeout=0.8, max_in_flight=1)
    try:
        p.serve_models(served)
        encoder = hpack.Encoder()  # dynamic table on (4096 bytes), as every client starts
        first = encoder.encode(call_headers(p.url))
        second = encoder.encode(call_headers(p.url))  # refers to the first block's table entries
        assert len(second) < len(first) / 2
        body = grpc_message(raw_infer_request("ranker", "1"))
        client = H2Client(p.url)
        try:
            client.send(
                PREFACE
                + frame(SETTINGS, 0, 0)
                + frame(HEADERS, END_HEADERS, 1, first)
                + frame(DATA, END_STREAM, 1, body)
                + frame(HEADERS, END_HEADERS, 3, second)
                + frame(DATA, END_STREAM, 3, body)
            )
            started = time.monotonic()
            client.until(lambda: {1, 3} <= client.ended, 20, "both calls answered")
            elapsed = time.monotonic() - started
        finally:
            client.close()
        trailers = client.trailers
        assert trailers[3]["grpc-status"] == "8", trailers  # RESOURCE_EXHAUSTED: over the limit
        assert trailers[1]["grpc-status"] == "4", trailers  # DEADLINE_EXCEEDED by Triton
        assert elapsed < 2.5  # the sidecar's 0.8 s, not the model's 3 s
        wait_for(lambda: p.in_flight() == 0, what="nothing in flight")
        assert p.count("ranker", "DEADLINE_EXCEEDED", "server_error", "1") == 1
        assert p.count("ranker", "RESOURCE_EXHAUSTED", "server_error", "1") == 1
    finally:
        fault(triton.state_dir, "clear", "--model", "ranker")
        p.close()


def test_drain_serves_calls_opened_before_goaway_and_names_the_last(loop, triton, served) -> None:
    """stop(): a GOAWAY naming the highest possible stream, then one naming the last stream the
    relay took; that call is served to the end, a later one is refused unprocessed (not counted)."""
    fault(triton.state_dir, "set", "--model", "ranker", "--version", "1", "--extra-latency-ms", "1500")
    p = InProcessProxy(loop, "relay", triton.grpc_url)
    encoder = hpack.Encoder()
    body = grpc_message(raw_infer_request("ranker", "1"))
    client = H2Client(p.url)
    try:
        p.serve_models(served)
        client.send(
            PREFACE
            + frame(SETTINGS, 0, 0)
            + frame(HEADERS, END_HEADERS, 1, encoder.encode(call_headers(p.url)))
            + frame(DATA, END_STREAM, 1, body)
        )
        wait_for(lambda: p.in_flight() == 1, what="the call in flight")
        stopping = asyncio.run_coroutine_threadsafe(p.proxy.stop(20), loop)
        client.until(lambda: len(client.goaways) == 2, 10, "two GOAWAYs")
        assert client.goaways == [MAX_STREAM_ID, 1]
        client.send(
            frame(HEADERS, END_HEADERS, 3, encoder.encode(call_headers(p.url)))
            + frame(DATA, END_STREAM, 3, body)
        )
        client.until(lambda: {1, 3} <= client.ended, 20, "both calls ended")
        assert client.trailers[3] == {"rst": str(REFUSED_STREAM)}
        assert client.trailers[1]["grpc-status"] == "0"
        stopping.result(20)
        assert p.counts() == {("ranker", "1", "OK", "success"): 1}
    finally:
        client.close()
        fault(triton.state_dir, "clear", "--model", "ranker")
        p.close()


def test_a_goaway_never_precedes_the_servers_settings(loop, served) -> None:
    """SIGTERM while a fresh connection still waits for the upstream's SETTINGS (an upstream slow
    to greet): the client's first frame is still the server's SETTINGS, the GOAWAYs follow it (a
    GOAWAY first is a broken connection to a gRPC client)."""

    async def slow_greeting(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.5)
        writer.write(frame(SETTINGS, 0, 0))
        while await reader.read(65536):
            pass
        writer.close()

    upstream = asyncio.run_coroutine_threadsafe(
        asyncio.start_server(slow_greeting, "127.0.0.1", 0), loop
    ).result(10)
    p = InProcessProxy(loop, "relay", f"127.0.0.1:{upstream.sockets[0].getsockname()[1]}")
    p.serve_models(served)
    client = H2Client(p.url)
    try:
        client.send(
            PREFACE
            + frame(SETTINGS, 0, 0)
            + frame(HEADERS, END_HEADERS, 1, hpack.Encoder().encode(call_headers(p.url)))
            + frame(DATA, END_STREAM, 1, grpc_message(raw_infer_request("ranker", "1")))
        )
        wait_for(lambda: p.in_flight() == 1, what="the call taken")
        # The drain waits up to 3 s for the call (this upstream never answers it).
        stopping = asyncio.run_coroutine_threadsafe(p.proxy.stop(3), loop)
        client.until(lambda: len(client.goaways) == 2, 10, "two GOAWAYs")
        assert client.types[0] == SETTINGS, client.types
        assert client.goaways == [MAX_STREAM_ID, 1]
        stopping.result(10)
    finally:
        client.close()
        p.close()
        loop.call_soon_threadsafe(upstream.close)


class RefusingFront:
    """A TCP front for the upstream that refuses the first stream of each connection with
    RST_STREAM REFUSED_STREAM (as a server at its stream limit does) and passes everything else.

    The relay writes only self-contained header blocks upstream, so a block can be dropped here
    without desynchronising the upstream's HPACK decoder."""

    def __init__(self, loop: asyncio.AbstractEventLoop, upstream: str) -> None:
        self.loop = loop
        self.host, port = upstream.rsplit(":", 1)
        self.upstream_port = int(port)
        self.refused = 0
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), loop
        ).result(10)
        self.url = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection(self.host, self.upstream_port)
        settings_relayed = asyncio.Event()

        async def upstream_to_client() -> None:
            try:
                while data := await up_r.read(65536):
                    down_w.write(data)
                    settings_relayed.set()  # the server's first bytes are its SETTINGS
            except ConnectionError:
                pass
            down_w.close()

        async def client_to_upstream() -> None:
            refused = None
            try:
                up_w.write(await down_r.readexactly(len(PREFACE)))
                while True:
                    head = await down_r.readexactly(9)
                    payload = await down_r.readexactly(int.from_bytes(head[:3], "big"))
                    sid = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
                    if refused is None and head[3] == HEADERS:
                        refused = sid
                        self.refused += 1
                        await settings_relayed.wait()
                        down_w.write(frame(RST_STREAM, 0, sid, struct.pack(">I", REFUSED_STREAM)))
                    if sid != refused or sid == 0:
                        up_w.write(head + payload)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            up_w.close()

        await asyncio.gather(upstream_to_client(), client_to_upstream(), return_exceptions=True)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)


# A client whose retry policy retries UNAVAILABLE (what a refused stream reports): grpc 1.85 does
# not retry a REFUSED_STREAM without one (seen here), so the retry is the policy's.
RETRYING = [
    ("grpc.enable_retries", 1),
    (
        "grpc.service_config",
        json.dumps(
            {
                "methodConfig": [
                    {
                        "name": [{}],
                        "retryPolicy": {
                            "maxAttempts": 3,
                            "initialBackoff": "0.05s",
                            "maxBackoff": "0.5s",
                            "backoffMultiplier": 2,
                            "retryableStatusCodes": ["UNAVAILABLE"],
                        },
                    }
                ]
            }
        ),
    ),
]


def test_a_refused_and_retried_call_is_counted_once(loop, triton, served) -> None:
    front = RefusingFront(loop, triton.grpc_url)
    p = InProcessProxy(loop, "relay", front.url)
    try:
        p.serve_models(served)
        with grpc.insecure_channel(p.url, options=RETRYING) as channel:
            assert channel.unary_unary(INFER)(raw_infer_request("ranker", "1"), timeout=20)
        assert front.refused == 1
        wait_for(lambda: p.in_flight() == 0, what="nothing in flight")
        assert p.counts() == {("ranker", "1", "OK", "success"): 1}
    finally:
        p.close()
        front.close()


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    """The relay's logger through the JSON formatter every component uses."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("inferwatch.sidecar.grpc")
    logger.addHandler(handler)
    try:
        yield out
    finally:
        logger.removeHandler(handler)


def test_a_fault_inside_the_relay_is_internal_counted_and_logged(
    loop, triton, served, monkeypatch, json_log, caplog
) -> None:
    p = InProcessProxy(loop, "relay", triton.grpc_url)
    original = grpc_relay_conn._Conn._client_data

    def broken(self, *args, **kwargs):
        raise RuntimeError("injected relay fault")

    try:
        p.serve_models(served)
        monkeypatch.setattr(grpc_relay_conn._Conn, "_client_data", broken)
        with caplog.at_level(logging.ERROR, logger="asyncio"), grpc.insecure_channel(p.url) as channel:
            with pytest.raises(grpc.RpcError) as info:
                channel.unary_unary(INFER)(raw_infer_request("ranker", "1"), timeout=20)
            assert info.value.code() == grpc.StatusCode.INTERNAL
        wait_for(lambda: p.in_flight() == 0, what="nothing in flight")
        assert sum(n for (_, _, code, outcome), n in p.counts().items() if code == "INTERNAL") == 1
        assert p.count("", "INTERNAL", "server_error") == 1
        lines = [json.loads(line) for line in json_log.getvalue().splitlines()]
        failure = next(x for x in lines if x["msg"] == "grpc relay failure")
        assert failure["level"] == "error" and "injected relay fault" in failure["exc"]
        assert not [r for r in caplog.records if r.name == "asyncio"], "asyncio's own error print"

        # The relay is unharmed: the next call (a new connection) passes.
        monkeypatch.setattr(grpc_relay_conn._Conn, "_client_data", original)
        with grpc.insecure_channel(p.url) as channel:
            assert channel.unary_unary(INFER)(raw_infer_request("ranker", "1"), timeout=20)
        assert p.count("ranker", "OK", "success", "1") == 1
    finally:
        p.close()
