"""The sidecar's HTTP side at the edges of its life and its upstream connections' lives.

- Start: the sidecar starts before Triton (as in a pod); requests sent the moment Triton is
  ready are counted under their model, and ``/readyz`` is 503 until the upstream is ready and
  its model index read (a plain HTTP upstream without those endpoints turns ready too).
- Replays: a request is resent on a fresh upstream connection only when it provably never
  reached the server (its write failed); a POST the upstream read before closing is not
  (502, counted as server_error), while a GET (safe to repeat) is.
- Drain (in-process): a connection accepted while draining is served, its answer says
  ``Connection: close``; a kept-alive connection's next request is served, then closed.
- Drain (the real Triton, 20 SIGTERMs in a row, ``--drain-delay``): zero failed requests, with
  clients that behave like those behind a Kubernetes Service. ``sigterm_rounds`` takes any
  number of load generators (each with ``start``/``stop``/``failures``), so the gRPC half adds
  its own next to ``HttpLoad``.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import signal
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

import httpx
import pytest
import tritonclient.http as thttp
import uvloop
from prometheus_client import CollectorRegistry

from inferwatch import contract
from reference_server.catalog import example_input
from reference_server.launcher import TritonServer
from sidecar.config import SidecarConfig
from sidecar.core.telemetry import Telemetry
from sidecar.protocols.http1 import POOL_IDLE_SECONDS, serve
from tests.fixtures.net import free_port
from tests.fixtures.sidecar import SidecarInfo, launch_sidecar

GOOD = {"inputs": [{"name": "FEATURES", "shape": [1, 16, 32], "datatype": "FP32", "data": [0.25] * 512}]}


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def readyz(sc: SidecarInfo) -> tuple[int, dict]:
    r = httpx.get(sc.ready_url, timeout=5)
    return r.status_code, r.json()


# --------------------------------------------------------------------------------------------
# Start: attribution from the first request, readiness
# --------------------------------------------------------------------------------------------
@pytest.mark.integration
def test_requests_sent_as_soon_as_triton_is_ready_count_under_their_model(tmp_path: Path) -> None:
    ports = {"http_port": free_port(), "grpc_port": free_port(), "metrics_port": free_port()}
    server = TritonServer(
        state_dir_path=tmp_path / "triton",
        extra_args=("--model-control-mode=explicit", "--load-model=ranker"),
        **ports,
    )
    upstream = f"127.0.0.1:{ports['http_port']}"
    started: list[BaseException | None] = []
    finished = threading.Event()

    def start_triton() -> None:
        try:
            server.start()
            started.append(None)
        except BaseException as exc:  # reported below
            started.append(exc)
        # Triton dies with the thread that started it (the launcher's PR_SET_PDEATHSIG).
        finished.wait(300)

    # No --spec: ranker is not a configured model, only the upstream can make it a label.
    grpc = f"127.0.0.1:{ports['grpc_port']}"
    with launch_sidecar(upstream, grpc, tmp_path, "--grpc-port", "0", wait_ready=False) as sc:
        code, body = readyz(sc)
        assert code == 503 and body["upstream"].startswith("unreachable"), body
        assert not body["model_index_read"]
        starter = threading.Thread(target=start_triton, daemon=True)
        starter.start()
        try:
            # Triton's own readiness, polled tightly: the requests go out the moment it says ready.
            with httpx.Client(timeout=1) as poll:

                def triton_ready() -> bool:
                    try:
                        return poll.get(f"http://{upstream}/v2/health/ready").status_code == 200
                    except httpx.HTTPError:
                        return False

                def failed() -> bool:
                    return bool(started) and started[0] is not None

                wait_for(lambda: failed() or triton_ready(), 200, "Triton to be ready")
                if failed():
                    raise AssertionError(f"Triton did not start: {started[0]}")
            inputs = []
            for name, array in example_input("ranker", 1, seed=1).items():
                inp = thttp.InferInput(name, list(array.shape), "FP32")
                inp.set_data_from_numpy(array, binary_data=True)
                inputs.append(inp)
            client = thttp.InferenceServerClient(sc.http_url, concurrency=20)
            handles = [client.async_infer("ranker", inputs, model_version="1") for _ in range(20)]
            for h in handles:
                h.get_result()
            client.close()
            counted = sc.counts(contract.REQUESTS_TOTAL.name, "model", "version", "code")
            wait_for(lambda: readyz(sc)[0] == 200, 30, "/readyz to turn 200")
            assert readyz(sc)[1]["model_index_read"] is True
        finally:
            server.stop()
            finished.set()
            starter.join(200)
    assert started == [None], started
    assert counted == {("ranker", "1", "200"): 20.0}, counted


@pytest.mark.integration
def test_an_upstream_without_kserve_endpoints_still_turns_ready(tmp_path: Path) -> None:
    """A plain HTTP server (404 for /v2/health/ready and the index) counts as ready once it
    answers, and its names are admitted first come, as before readiness checked the upstream."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Plain(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            ok = self.path.startswith("/api/")
            body = b"{}" if ok else b"no such path"
            self.send_response(200 if ok else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, format: str, *args: object) -> None:
            pass

    plain = ThreadingHTTPServer(("127.0.0.1", 0), Plain)
    threading.Thread(target=plain.serve_forever, daemon=True).start()
    try:
        upstream = f"127.0.0.1:{plain.server_address[1]}"
        route = ("--route", r"^/api/(?P<model>[^/]+)")
        with launch_sidecar(upstream, upstream, tmp_path, "--grpc-port", "0", *route) as sc:
            code, body = readyz(sc)
            assert code == 200 and body["upstream"] == "ready" and body["model_index_read"], body
            assert httpx.post(f"{sc.base_url}/api/sentiment", json={}).status_code == 200
            counted = sc.counts(contract.REQUESTS_TOTAL.name, "model", "code")
    finally:
        plain.shutdown()
    assert counted == {("sentiment", "200"): 1.0}


# --------------------------------------------------------------------------------------------
# Replays
# --------------------------------------------------------------------------------------------
Seen = list[tuple[int, bytes]]  # (upstream connection number, request line), in order


class Peer:
    """A keep-alive HTTP/1.1 upstream that records every request it reads, answers each with
    200, except that ``close_after_reading`` makes it close a reused connection right after
    reading a request (the request reached it; no answer); ``reset_all`` resets every
    connection it has accepted."""

    def __init__(self) -> None:
        self.seen: Seen = []
        self.close_after_reading = False
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.AbstractServer | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = len(self.writers)
        self.writers.append(writer)
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                self.seen.append((conn, head.split(b"\r\n", 1)[0]))
                if self.close_after_reading and served:
                    writer.close()
                    return
                served += 1
                if head.startswith(b"GET /slow "):  # the head now, the body half a second later
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n")
                    await writer.drain()
                    await asyncio.sleep(0.5)
                    writer.write(b"{}")
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    def reset_all(self) -> None:
        for w in self.writers:
            sock = w.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            w.transport.abort()


async def ask(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = next(
        int(v)
        for k, _, v in (ln.partition(b": ") for ln in head.split(b"\r\n"))
        if k.lower() == b"content-length"
    )
    await reader.readexactly(length)
    writer.close()
    return head


POST = b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
GET = b"GET /v2/models/m HTTP/1.1\r\nHost: x\r\n\r\n"


async def replay_scenario(second: bytes, reset: bool) -> tuple[bytes, Seen, CollectorRegistry]:
    """One request (pools the upstream connection), then ``second`` on the pooled connection:
    the upstream either reads it and closes, or (``reset``) reset the connection before it
    was sent. (status line of the second answer, what the upstream read, the registry)."""
    peer = Peer()
    port = await peer.start()
    registry = CollectorRegistry()
    config = SidecarConfig(upstream_http=("127.0.0.1", port), host="127.0.0.1", http_port=0)
    proxy = await serve(config, Telemetry(registry, config))
    try:
        assert (await ask(proxy.port, POST)).startswith(b"HTTP/1.1 200")
        assert len(proxy.pool) == 1
        if reset:
            # The reset arrives while the event loop has not yet looked at the pooled connection
            # (a race in real life, made certain here): the proxy picks it and its write fails.
            proxy.pool[0].transport.pause_reading()
            peer.reset_all()
            await asyncio.sleep(0.1)
        else:
            peer.close_after_reading = True
        head = await ask(proxy.port, second)
    finally:
        await proxy.stop(1)
        assert peer.server is not None
        peer.server.close()
    return head.split(b"\r\n", 1)[0], peer.seen, registry


def test_a_post_the_upstream_read_is_not_replayed() -> None:
    status, seen, registry = uvloop.run(replay_scenario(POST, reset=False))
    assert status == b"HTTP/1.1 502 Bad Gateway"
    # Read once, by the connection it was sent on: no second copy on a fresh connection.
    assert seen == [(0, POST.split(b"\r\n")[0]), (0, POST.split(b"\r\n")[0])]
    # The first answer (200) proved model m; the broken exchange is the sidecar's 502.
    labels = {"model": "m", "version": "", "protocol": "http", "code": "502", "outcome": "server_error"}
    assert registry.get_sample_value(contract.REQUESTS_TOTAL.name, labels) == 1


def test_a_get_is_replayed_and_a_post_whose_write_failed_is_sent_once() -> None:
    # A GET changes nothing: repeated on a fresh connection after the upstream read it and closed.
    status, seen, _ = uvloop.run(replay_scenario(GET, reset=False))
    assert status == b"HTTP/1.1 200 OK"
    assert [c for c, line in seen if line.startswith(b"GET")] == [0, 1]
    # A POST whose write failed never reached the upstream: sent on a fresh connection, once.
    status, seen, _ = uvloop.run(replay_scenario(POST, reset=True))
    assert status == b"HTTP/1.1 200 OK"
    assert seen == [(0, POST.split(b"\r\n")[0]), (1, POST.split(b"\r\n")[0])]


@contextlib.asynccontextmanager
async def proxy_before_peer() -> AsyncIterator[tuple[Any, Peer]]:
    """An in-process HTTP proxy in front of a ``Peer``; both stopped at the end."""
    peer = Peer()
    port = await peer.start()
    config = SidecarConfig(upstream_http=("127.0.0.1", port), host="127.0.0.1", http_port=0)
    proxy = await serve(config, Telemetry(CollectorRegistry(), config))
    try:
        yield proxy, peer
    finally:
        await proxy.stop(1)
        assert peer.server is not None
        peer.server.close()


async def idle_pool_scenario() -> Seen:
    async with proxy_before_peer() as (proxy, peer):
        await ask(proxy.port, POST)
        await ask(proxy.port, POST)  # reuses the pooled connection
        await asyncio.sleep(POOL_IDLE_SECONDS + 0.75)
        assert not proxy.pool
        await ask(proxy.port, POST)  # a new connection: the idle one was closed by the sidecar
    return peer.seen


def test_idle_pooled_connections_close_before_common_upstream_keepalive_timeouts() -> None:
    # Closing first means an upstream with a 5 s keep-alive timeout (uvicorn, Node) never closes
    # a connection as a POST is written to it, which could then not be replayed.
    assert POOL_IDLE_SECONDS < 5
    assert [conn for conn, _ in uvloop.run(idle_pool_scenario())] == [0, 0, 1]


# --------------------------------------------------------------------------------------------
# Drain, in-process
# --------------------------------------------------------------------------------------------
async def drain_scenario() -> dict[str, bytes]:
    peer = Peer()
    port = await peer.start()
    config = SidecarConfig(upstream_http=("127.0.0.1", port), host="127.0.0.1", http_port=0)
    proxy = await serve(config, Telemetry(CollectorRegistry(), config))
    out: dict[str, bytes] = {}
    try:
        # Kept alive before SIGTERM, idle when it arrives.
        r1, w1 = await asyncio.open_connection("127.0.0.1", proxy.port)
        w1.write(POST)
        await r1.readuntil(b"{}")
        r2, w2 = await asyncio.open_connection("127.0.0.1", proxy.port)
        w2.write(POST)
        await r2.readuntil(b"{}")
        # An answer under way when SIGTERM arrives, its head already sent without "close".
        r3, w3 = await asyncio.open_connection("127.0.0.1", proxy.port)
        w3.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        slow_head = await asyncio.wait_for(r3.readuntil(b"\r\n\r\n"), 10)

        proxy.begin_drain()  # SIGTERM: /readyz says 503, the listener still accepts (--drain-delay)
        out["accepted_while_draining"] = await ask(proxy.port, POST)
        w1.write(POST)  # the kept-alive client's next request
        out["kept_alive_during_delay"] = await asyncio.wait_for(r1.read(), 10)  # served, then EOF
        assert b"connection: close" not in slow_head.lower()
        await asyncio.wait_for(r3.readexactly(2), 10)
        await asyncio.sleep(0.1)  # the client reuses the connection it was not told to leave
        w3.write(POST)
        out["answer_begun_before_drain"] = await asyncio.wait_for(r3.read(), 10)

        stopping = asyncio.create_task(proxy.stop(10))  # the listener closes
        await asyncio.sleep(0.2)
        w2.write(POST)  # a request already on its way on an idle kept-alive connection
        out["kept_alive_after_close"] = await asyncio.wait_for(r2.read(), 10)
        await asyncio.wait_for(stopping, 10)
    finally:
        assert peer.server is not None
        peer.server.close()
    return out


def test_drain_serves_accepted_and_kept_alive_connections_then_closes_them() -> None:
    out = uvloop.run(drain_scenario())
    for what, answer in out.items():
        head = answer.lower()
        assert head.startswith(b"http/1.1 200 ok"), (what, answer)
        assert b"\r\nconnection: close\r\n" in head, (what, answer)


# --------------------------------------------------------------------------------------------
# Drain, the real Triton, 20 SIGTERMs in a row
# --------------------------------------------------------------------------------------------
class Load(Protocol):
    """A load generator for ``sigterm_rounds``; ``gone`` is set once the sidecar's /readyz
    said 503 (a Service took the endpoint out): a client then opens no new connection to it."""

    def start(self, sc: SidecarInfo, gone: threading.Event) -> None: ...

    def stop(self) -> None: ...

    def answered(self) -> int: ...  # requests answered with success

    def failures(self) -> list[str]: ...  # everything else, one line each


class HttpLoad:
    """Threads posting inferences: odd threads on one kept-alive connection each, even threads
    on a new connection per request. A connection is dropped when an answer says
    ``Connection: close`` (as any HTTP/1.1 client does); once ``gone`` is set, no new one opens."""

    def __init__(self, path: str, threads: int = 6) -> None:
        self.path, self.threads_n = path, threads
        self.body = json.dumps(GOOD).encode()
        self.ok = 0
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.halt = threading.Event()
        self.threads: list[threading.Thread] = []

    def start(self, sc: SidecarInfo, gone: threading.Event) -> None:
        self.ok, self.errors = 0, []
        self.halt.clear()
        self.threads = [
            threading.Thread(target=self.run, args=(sc.http_port, i % 2 == 1, gone), daemon=True)
            for i in range(self.threads_n)
        ]
        for t in self.threads:
            t.start()

    def run(self, port: int, keep_alive: bool, gone: threading.Event) -> None:
        conn: http.client.HTTPConnection | None = None
        headers = {"Content-Type": "application/json"} | ({} if keep_alive else {"Connection": "close"})
        while not self.halt.is_set():
            if conn is None:
                if gone.is_set():
                    time.sleep(0.02)
                    continue
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            try:
                conn.request("POST", self.path, self.body, headers)
                resp = conn.getresponse()
                resp.read()
                result = "200" if resp.status == 200 else f"HTTP {resp.status}"
                closing = resp.will_close
            except (OSError, http.client.HTTPException) as exc:
                result, closing = f"{type(exc).__name__}: {exc}", True
            with self.lock:
                if result == "200":
                    self.ok += 1
                else:
                    self.errors.append(result)
            if closing:
                conn.close()
                conn = None
        if conn is not None:
            conn.close()

    def stop(self) -> None:
        self.halt.set()
        for t in self.threads:
            t.join(60)

    def answered(self) -> int:
        return self.ok

    def failures(self) -> list[str]:
        return list(self.errors)


def sigterm_rounds(
    triton, tmp_path: Path, loads: list[Load], rounds: int, *args: str
) -> list[tuple[int, dict, list[str]]]:
    """Per round: a fresh sidecar under every load; SIGTERM once traffic flows; wait for its
    exit. Returns (exit code, the "stopped" log record, failures) per round."""
    out = []
    for n in range(rounds):
        gone = threading.Event()
        with launch_sidecar(triton.http_url, triton.grpc_url, tmp_path, *args, name=f"sidecar-{n}") as sc:
            for load in loads:
                load.start(sc, gone)
            try:
                wait_for(lambda: all(load.answered() >= 10 for load in loads), 60, "traffic to flow")
                os.kill(sc.proc.pid, signal.SIGTERM)

                # The Service's view: the endpoint goes once /readyz says 503 (which it does
                # while the listener still accepts, for --drain-delay).
                def not_ready() -> bool:
                    try:
                        return httpx.get(sc.ready_url, timeout=1).status_code == 503
                    except httpx.HTTPError:
                        return False

                wait_for(not_ready, 10, "/readyz to say 503")
                gone.set()
                rc = sc.proc.wait(60)
            finally:
                gone.set()
                for load in loads:
                    load.stop()
            log = sc.log()
        stopped = [json.loads(line) for line in log.splitlines() if '"msg": "stopped"' in line]
        failures = [f for load in loads for f in load.failures()]
        out.append((rc, stopped[0] if stopped else {}, failures))
    return out


@pytest.mark.integration
def test_twenty_sigterms_under_load_fail_no_request(triton, tmp_path: Path) -> None:
    load = HttpLoad("/v2/models/ranker/versions/2/infer")
    # The delay leaves the clients' "Service" (which watches /readyz) ample time on a busy machine.
    results = sigterm_rounds(triton, tmp_path, [load], 20, "--grpc-port", "0", "--drain-delay", "2")
    assert all(rc == 0 and stopped for rc, stopped, _ in results), results
    assert all(stopped["in_flight_left"] == 0 for _, stopped, _ in results), results
    failed = Counter(f for _, _, failures in results for f in failures)
    assert not failed, failed


async def late_sweeper_scenario() -> Seen:
    async with proxy_before_peer() as (proxy, peer):
        await ask(proxy.port, POST)
        assert len(proxy.pool) == 1
        # A busy event loop (32 streams on two loaded cores did it): the sweeper does not run
        # while the pooled connection passes its idle limit, and the upstream's keep-alive
        # timeout may be closing it right now.
        time.sleep(POOL_IDLE_SECONDS + 0.5)
        await ask(proxy.port, POST)  # a new connection, whichever of sweeper or request runs first
    return peer.seen


def test_a_connection_idle_past_the_limit_is_not_reused_when_the_sweeper_runs_late() -> None:
    # Reused, the upstream could close it as the POST is written: a 502 the client cannot retry.
    assert [conn for conn, _ in uvloop.run(late_sweeper_scenario())] == [0, 1]
