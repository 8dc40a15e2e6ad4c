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
from sidecar import grpc_relay_conn
from sidecar.h2 import (
    ACK,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
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


def read_frames(sock: socket.socket, want_streams: set[int], timeout: float) -> dict[int, dict[str, str]]:
    """Read until each stream in ``want_streams`` has ended; return its last header block,
    decoded (the trailers). Acknowledges SETTINGS and PING as a client must."""
    decoder = hpack.Decoder()
    buf = b""
    blocks: dict[int, bytes] = {}
    done: dict[int, dict[str, str]] = {}
    ended: set[int] = set()
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    while not want_streams <= ended:
        if time.monotonic() > deadline:
            raise AssertionError(f"streams {want_streams - ended} not ended after {timeout}s")
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"connection closed; ended {ended}, trailers {done}")
        buf += chunk
        while len(buf) >= 9:
            length = int.from_bytes(buf[:3], "big")
            if len(buf) < 9 + length:
                break
            ftype, flags = buf[3], buf[4]
            sid = int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
            payload, buf = buf[9 : 9 + length], buf[9 + length :]
            if ftype == SETTINGS and not flags & ACK:
                sock.sendall(frame(SETTINGS, ACK, 0))
            elif ftype == PING and not flags & ACK:
                sock.sendall(frame(PING, ACK, 0, payload))
            elif ftype in (HEADERS, CONTINUATION):
                blocks[sid] = blocks.get(sid, b"") + payload
                if flags & END_HEADERS:
                    fields = {k.decode(): v.decode() for k, v in decoder.decode(blocks.pop(sid), raw=True)}
                    done[sid] = fields
                if flags & END_STREAM:
                    ended.add(sid)
            elif ftype == DATA and flags & END_STREAM:
                ended.add(sid)
            elif ftype == RST_STREAM:
                ended.add(sid)
                done.setdefault(sid, {})["rst"] = str(int.from_bytes(payload[:4], "big"))
    return done


def test_blocks_sent_before_the_settings_exchange_are_edited_and_limited(loop, triton, served) -> None:
    """A client that writes its first calls with its HPACK dynamic table on, before it has read
    the server's SETTINGS: the relay still adds its grpc-timeout (Triton ends the slow call at the
    sidecar's timeout) and still applies the in-flight limit (the second call is refused)."""
    fault(triton.state_dir, "set", "--model", "ranker", "--version", "1", "--extra-latency-ms", "3000")
    p = InProcessProxy(loop, "relay", triton.grpc_url, timeout_s=0.8, max_concurrent_rpcs=1)
    try:
        p.serve_models(served)
        encoder = hpack.Encoder()  # dynamic table on (4096 bytes), as every client starts
        host, port = p.url.rsplit(":", 1)

        def call_headers() -> list[tuple[str, str]]:
            return [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", INFER),
                (":authority", p.url),
                ("te", "trailers"),
                ("content-type", "application/grpc"),
                ("x-team", "search"),
            ]

        first = encoder.encode(call_headers())
        second = encoder.encode(call_headers())  # refers to the first block's table entries
        assert len(second) < len(first) / 2
        body = grpc_message(raw_infer_request("ranker", "1"))
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(
                PREFACE
                + frame(SETTINGS, 0, 0)
                + frame(HEADERS, END_HEADERS, 1, first)
                + frame(DATA, END_STREAM, 1, body)
                + frame(HEADERS, END_HEADERS, 3, second)
                + frame(DATA, END_STREAM, 3, body)
            )
            started = time.monotonic()
            trailers = read_frames(sock, {1, 3}, timeout=20)
            elapsed = time.monotonic() - started
        assert trailers[3]["grpc-status"] == "8", trailers  # RESOURCE_EXHAUSTED: over the limit
        assert trailers[1]["grpc-status"] == "4", trailers  # DEADLINE_EXCEEDED by Triton
        assert elapsed < 2.5  # the sidecar's 0.8 s, not the model's 3 s
        wait_for(lambda: p.in_flight() == 0, what="nothing in flight")
        assert p.count("ranker", "DEADLINE_EXCEEDED", "server_error", "1") == 1
        assert p.count("ranker", "RESOURCE_EXHAUSTED", "server_error", "1") == 1
    finally:
        fault(triton.state_dir, "clear", "--model", "ranker")
        p.close()


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
