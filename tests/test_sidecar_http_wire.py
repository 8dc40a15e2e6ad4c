"""The exact bytes the HTTP proxy forwards, in-process: a recording TCP peer stands upstream
(Triton cannot show the headers it received) and the client speaks raw bytes. Hop-by-hop
headers stop at the proxy in both directions (RFC 9110 7.6.1), Via is added, the client's
traceparent is forwarded unchanged when tracing is off, a chunked answer is re-framed with its
body intact, and a side that stops reading stalls the other (backpressure both ways)."""

from __future__ import annotations

import asyncio

import uvloop
from prometheus_client import CollectorRegistry

from inferwatch import contract
from sidecar.config import SidecarConfig
from sidecar.core.telemetry import Telemetry
from sidecar.protocols.http1 import serve

ANSWER = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nConnection: keep-alive, X-Up-Secret\r\n"
    b"X-Up-Secret: 1\r\nKeep-Alive: timeout=5\r\nTransfer-Encoding: chunked\r\nX-Model-Header: kept\r\n\r\n"
    b"5\r\nhello\r\n7\r\n, \x00\xffbin\r\n0\r\n\r\n"
)


async def scenario() -> tuple[bytes, bytes, CollectorRegistry]:
    received = bytearray()
    got_request = asyncio.Event()

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(v)
            for k, _, v in (ln.partition(b": ") for ln in head.split(b"\r\n"))
            if k.lower() == b"content-length"
        )
        received.extend(head + await reader.readexactly(length))
        got_request.set()
        writer.write(ANSWER)
        await writer.drain()
        await reader.read()  # keep the connection until the proxy closes it

    up = await asyncio.start_server(upstream, "127.0.0.1", 0)
    up_port = up.sockets[0].getsockname()[1]
    registry = CollectorRegistry()
    config = SidecarConfig(upstream_http=("127.0.0.1", up_port), host="127.0.0.1", http_port=0)
    proxy = await serve(config, Telemetry(registry, config))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(
            b"POST /v2/models/m1/versions/3/infer?x=1 HTTP/1.1\r\nHost: example\r\n"
            b"Connection: keep-alive, X-Secret\r\nX-Secret: do-not-forward\r\n"
            b"Keep-Alive: 300\r\nTE: trailers\r\n"
            b"Proxy-Authorization: Basic eA==\r\nProxy-Connection: keep-alive\r\n"
            b"traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n"
            b"Inference-Header-Content-Length: 2\r\nContent-Length: 6\r\n\r\n{}\x00\x01\x02\x03"
        )
        await asyncio.wait_for(got_request.wait(), 10)
        answer = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 10)
        writer.close()
    finally:
        await proxy.stop(1)
        up.close()
    return bytes(received), answer, registry


def test_forwarded_bytes_and_hop_by_hop_headers() -> None:
    received, answer, registry = uvloop.run(scenario())
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v2/models/m1/versions/3/infer?x=1 HTTP/1.1"
    names = {line.split(b":", 1)[0].lower() for line in lines[1:]}
    for hop in (
        b"connection",
        b"x-secret",
        b"keep-alive",
        b"te",
        b"proxy-authorization",
        b"proxy-connection",
    ):
        assert hop not in names, hop
    assert b"Host: example" in lines
    assert b"traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01" in lines
    assert b"Inference-Header-Content-Length: 2" in lines and b"Content-Length: 6" in lines
    assert b"via: 1.1 inferwatch" in lines
    assert body == b"{}\x00\x01\x02\x03"

    a_head, _, a_body = answer.partition(b"\r\n\r\n")
    a_lines = a_head.lower().split(b"\r\n")
    assert a_lines[0] == b"http/1.1 200 ok"
    a_names = {line.split(b":", 1)[0] for line in a_lines[1:]}
    assert b"keep-alive" not in a_names and b"x-up-secret" not in a_names and b"connection" not in a_names
    assert b"x-model-header: kept" in a_lines and b"transfer-encoding: chunked" in a_lines
    chunks, rest = [], a_body
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        chunks.append(rest[:size])
        rest = rest[size + 2 :]
    assert b"".join(chunks) == b"hello, \x00\xffbin"

    # No index here, but the upstream's 200 proves the model exists: counted under its name.
    labels = {"model": "m1", "protocol": "http"}
    assert registry.get_sample_value(contract.REQUEST_BYTES.name, labels) == 6
    assert registry.get_sample_value(contract.RESPONSE_BYTES.name, labels) == len(b"hello, \x00\xffbin")


BIG = 96 * 1024 * 1024


async def backpressure() -> tuple[int, int, int, int]:
    """(bytes the upstream could send while the client read nothing, bytes the client got,
    bytes the client could send while the upstream read nothing, bytes the upstream got)."""
    sent_down = 0
    up_reading = asyncio.Event()
    got_up = 0

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent_down, got_up
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"GET"):
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % BIG)
            block = b"x" * (1 << 20)
            for _ in range(BIG // len(block)):
                writer.write(block)
                await writer.drain()
                sent_down += len(block)
        else:
            await up_reading.wait()  # not reading the body yet
            while got_up < BIG:
                got_up += len(await reader.read(1 << 20))
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            await writer.drain()
        await reader.read()

    up = await asyncio.start_server(upstream, "127.0.0.1", 0)
    config = SidecarConfig(
        upstream_http=("127.0.0.1", up.sockets[0].getsockname()[1]), host="127.0.0.1", http_port=0
    )
    proxy = await serve(config, Telemetry(CollectorRegistry(), config))
    try:
        # Download: the client reads nothing for a while.
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port, limit=1 << 20)
        writer.write(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(1.0)
        stalled_down = sent_down
        got = 0
        await reader.readuntil(b"\r\n\r\n")
        while got < BIG:
            got += len(await reader.read(1 << 20))
        writer.close()

        # Upload: the upstream reads nothing for a while.
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % BIG)
        block = b"y" * (1 << 20)
        sent_up = 0

        async def push() -> None:
            nonlocal sent_up
            for _ in range(BIG // len(block)):
                writer.write(block)
                await writer.drain()
                sent_up += len(block)

        pusher = asyncio.create_task(push())
        await asyncio.sleep(1.0)
        stalled_up = sent_up
        up_reading.set()
        await pusher
        status = await reader.readuntil(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 204")
        writer.close()
    finally:
        await proxy.stop(1)
        up.close()
    return stalled_down, got, stalled_up, got_up


def test_backpressure_both_ways() -> None:
    stalled_down, got_down, stalled_up, got_up = uvloop.run(backpressure())
    # While one side does not read, the other can only fill socket buffers and the transport's
    # high-water marks (about 12 MB here), not push the whole 96 MB through the sidecar's memory.
    assert stalled_down < 32 * 1024 * 1024, stalled_down
    assert stalled_up < 32 * 1024 * 1024, stalled_up
    assert got_down == BIG and got_up == BIG
