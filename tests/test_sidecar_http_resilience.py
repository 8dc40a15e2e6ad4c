"""The sidecar under failure, with the real Triton: the upstream killed in the middle of a load
run (no hang, every request accounted for, recovery by itself) and SIGTERM in the middle of a
load run (no accepted request fails)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from inferwatch import contract
from reference_server.launcher import TritonServer
from tests.fixtures.net import free_port
from tests.fixtures.sidecar import launch_sidecar

pytestmark = pytest.mark.integration

GOOD = {"inputs": [{"name": "FEATURES", "shape": [1, 16, 32], "datatype": "FP32", "data": [0.25] * 512}]}
NOT_ACCEPTED = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)


class Load:
    """Threads posting inferences in a loop; records (start, end, status or error name)."""

    def __init__(self, base_url: str, path: str, threads: int, fresh_connections: bool, pause: float = 0.0):
        self.base_url, self.path, self.pause = base_url, path, pause
        self.fresh = fresh_connections
        self.results: list[tuple[float, float, int | str]] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(threads)]

    def run(self, i: int) -> None:
        headers = {"Connection": "close"} if self.fresh and i % 3 else {}
        with httpx.Client(base_url=self.base_url, timeout=30, headers=headers) as client:
            while not self.stop.is_set():
                t0 = time.monotonic()
                try:
                    result: int | str = client.post(self.path, json=GOOD).status_code
                except httpx.HTTPError as exc:
                    result = type(exc).__name__
                with self.lock:
                    self.results.append((t0, time.monotonic(), result))
                if result != 200:
                    time.sleep(self.pause)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def tally(self) -> Counter:
        return Counter(r for _, _, r in self.results)


def upstream_up(sc) -> float | None:
    for labels, value in sc.samples(contract.UPSTREAM_UP.name):
        if labels["upstream"] == "http":
            return value
    return None


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_upstream_killed_mid_load_then_back(tmp_path: Path) -> None:
    ports = {"http_port": free_port(), "grpc_port": free_port(), "metrics_port": free_port()}
    only_ranker = ("--model-control-mode=explicit", "--load-model=ranker")
    server = TritonServer(state_dir_path=tmp_path / "t1", extra_args=only_ranker, **ports).start()
    restarted = None
    try:
        with launch_sidecar(
            server.http_url, server.grpc_url, tmp_path, "--grpc-port", "0", "--request-timeout", "5"
        ) as sc:
            with Load(sc.base_url, "/v2/models/ranker/versions/1/infer", 4, False, pause=0.02) as load:
                wait_for(lambda: load.tally()[200] >= 50, 30, "traffic to flow")
                os.killpg(server.proc.pid, signal.SIGKILL)  # Triton dies abruptly, stubs and all
                server.proc.wait()
                killed = time.monotonic()
                wait_for(lambda: upstream_up(sc) == 0, 10, "upstream_up to drop to 0")
                wait_for(lambda: load.tally()[503] >= 20, 10, "fast 503s while the upstream is down")
                restarted = TritonServer(
                    state_dir_path=tmp_path / "t2", extra_args=only_ranker, **ports
                ).start()
                back = time.monotonic()
                wait_for(lambda: any(r == 200 and t0 > back for t0, _, r in load.results), 30, "recovery")
            wait_for(lambda: upstream_up(sc) == 1, 10, "upstream_up back to 1")
            tally = load.tally()
            counted = Counter()
            for labels, value in sc.samples(contract.REQUESTS_TOTAL.name):
                counted[int(labels["code"])] += int(value)
                expected = "success" if labels["code"] == "200" else "server_error"
                assert labels["outcome"] == expected, labels
            in_flight = sc.samples(contract.REQUESTS_IN_FLIGHT.name)

            # A model loaded later (through the sidecar's own proxy of the repository API) gets
            # its own label once the sidecar re-reads the index, which an unknown name triggers.
            def labelled_as(model: str) -> set[str]:
                httpx.post(f"{sc.base_url}/v2/models/{model}/infer", json={}, timeout=30)
                return {
                    labels["model"]
                    for labels, _ in sc.samples(contract.REQUESTS_TOTAL.name)
                    if labels["code"] not in ("200", "502", "503")
                }

            assert labelled_as("dense_unbatched") == {contract.MODEL_OVERFLOW}
            r = httpx.post(f"{sc.base_url}/v2/repository/models/dense_unbatched/load", timeout=120)
            assert r.status_code == 200, r.text
            wait_for(lambda: "dense_unbatched" in labelled_as("dense_unbatched"), 20, "the new model's label")

            # With no traffic at all, the sidecar's own probe notices the upstream going away.
            restarted.stop()
            wait_for(lambda: upstream_up(sc) == 0, 10, "upstream_up to drop to 0 without traffic")
    finally:
        for s in (server, restarted):
            if s is not None:
                s.stop()
    # Every request got an HTTP answer (no hang, no client-side error), and the sidecar
    # counted each one with the code the client saw.
    assert set(tally) <= {200, 502, 503}, tally
    assert tally[503] >= 20 and tally[200] >= 50
    assert counted == tally
    assert all(v == 0 for _, v in in_flight)
    durations = [end - start for start, end, _ in load.results]
    assert max(durations) < 5.0, max(durations)
    # While the upstream was down, answers were fast (a refused connect, not a timeout).
    down = sorted(end - start for start, end, r in load.results if r == 503 and start > killed)
    assert down[len(down) // 2] < 0.5


def test_sigterm_mid_load_fails_no_accepted_request(triton, tmp_path: Path) -> None:
    with launch_sidecar(triton.http_url, triton.grpc_url, tmp_path, "--grpc-port", "0") as sc:
        # ranker version 2 takes ~25 ms, so requests are in flight when the signal lands.
        with Load(sc.base_url, "/v2/models/ranker/versions/2/infer", 6, True, pause=0.01) as load:
            wait_for(lambda: load.tally()[200] >= 30, 30, "traffic to flow")
            sent = time.monotonic()
            os.kill(sc.proc.pid, signal.SIGTERM)
            rc = sc.proc.wait(40)
            time.sleep(0.2)
        log = sc.log()
    stopped = [json.loads(line) for line in log.splitlines() if '"msg": "stopped"' in line]
    assert rc == 0 and stopped, log[-2000:]
    tally = load.tally()
    ok = tally[200]
    # Every request the sidecar read was answered 200; the rest never reached it (listener closed).
    assert stopped[0]["http_requests"] == ok, (stopped[0], tally)
    assert stopped[0]["in_flight_left"] == 0
    assert set(tally) <= {200, *(e.__name__ for e in NOT_ACCEPTED)}, tally
    # Some requests were in flight when SIGTERM arrived and finished during the drain.
    assert any(t0 < sent < t1 and r == 200 for t0, t1, r in load.results)


def test_request_timeout_and_client_disconnect(triton, tmp_path: Path) -> None:
    """A slow upstream answer becomes a 504 at --request-timeout; past --max-in-flight the fixed
    overload answer; a client that leaves cancels its request at once (499, nothing in flight)."""
    import socket
    import subprocess

    from tests.fixtures.net import inferwatch_cmd

    state = ["--state-dir", str(triton.state_dir)]
    fault = ["fault", "set", "--model", "ranker", "--version", "1", "--extra-latency-ms", "2500", *state]
    body = json.dumps(GOOD).encode()
    request = (
        b"POST /v2/models/ranker/versions/1/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    )
    args = ("--grpc-port", "0", "--request-timeout", "1", "--max-in-flight", "1")
    with launch_sidecar(triton.http_url, triton.grpc_url, tmp_path, *args) as sc:
        subprocess.run(inferwatch_cmd(*fault), check=True, capture_output=True)
        try:
            started = time.monotonic()
            r = httpx.post(f"{sc.base_url}/v2/models/ranker/versions/1/infer", json=GOOD, timeout=10)
            took = time.monotonic() - started
            assert r.status_code == 504 and "did not answer in time" in r.json()["error"]
            assert 0.9 < took < 2.0, took

            with socket.create_connection(("127.0.0.1", sc.http_port)) as s:
                s.sendall(request)
                wait_for(
                    lambda: any(v == 1 for _, v in sc.samples(contract.REQUESTS_IN_FLIGHT.name)),
                    5,
                    "in flight",
                )
                # --max-in-flight 1: a second request meanwhile gets the fixed overload answer.
                over = httpx.post(f"{sc.base_url}/v2/models/ranker/versions/1/infer", json=GOOD, timeout=10)
                assert over.status_code == 503 and "overloaded" in over.json()["error"]
            left = time.monotonic()
            wait_for(
                lambda: all(v == 0 for _, v in sc.samples(contract.REQUESTS_IN_FLIGHT.name)), 5, "cancel"
            )
            assert time.monotonic() - left < 0.9  # not the 1 s timeout nor the 2.5 s answer
        finally:
            subprocess.run(inferwatch_cmd("fault", "clear", "--model", "ranker", *state), check=True)
        counted = {
            (labels["code"], labels["outcome"]): value
            for labels, value in sc.samples(contract.REQUESTS_TOTAL.name)
            if labels["model"] == "ranker"
        }
    assert counted == {
        ("504", "server_error"): 1.0,
        ("499", "client_error"): 1.0,
        ("503", "server_error"): 1.0,
    }
