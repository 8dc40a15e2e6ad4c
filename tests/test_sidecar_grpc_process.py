"""gRPC through the ``inferwatch sidecar`` process: its /metrics equal what clients saw, request
for request; SIGTERM drains gRPC calls in flight; an upstream killed mid-load leaves no call
hanging, every call accounted for, and traffic flowing again when it returns."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections import Counter

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
from tritonclient.utils import InferenceServerException

from inferwatch import contract
from tests.fixtures.net import free_port
from tests.fixtures.sidecar import SidecarInfo, launch_sidecar
from tests.test_sidecar_grpc import SERVICE, SmallTriton, fault, infer_inputs, raw_infer_request, wait_for

pytestmark = pytest.mark.integration

REQUESTS = contract.REQUESTS_TOTAL.name
DURATION_COUNT = contract.REQUEST_DURATION.name + "_count"
IN_FLIGHT = contract.REQUESTS_IN_FLIGHT.name
UP = contract.UPSTREAM_UP.name


def grpc_counts(sc: SidecarInfo) -> Counter:
    """(model, code, outcome) -> gRPC requests the sidecar counted."""
    out: Counter = Counter()
    for labels, value in sc.samples(REQUESTS):
        if labels["protocol"] == contract.PROTOCOL_GRPC:
            out[(labels["model"], labels["code"], labels["outcome"])] += int(value)
    return out


def grpc_duration_count(sc: SidecarInfo) -> int:
    # The histogram has no protocol label; the tests that read it send only gRPC.
    return int(sum(v for _labels, v in sc.samples(DURATION_COUNT)))


def in_flight(sc: SidecarInfo) -> float:
    return sum(v for _, v in sc.samples(IN_FLIGHT))


def grpc_up(sc: SidecarInfo) -> float | None:
    return next((v for labels, v in sc.samples(UP) if labels["upstream"] == "grpc"), None)


def code_of(exc: InferenceServerException) -> str:
    return (exc.status() or "StatusCode.UNKNOWN").removeprefix("StatusCode.")


def test_sidecar_counts_equal_what_grpc_clients_saw(triton, sidecar) -> None:
    before, before_hist = grpc_counts(sidecar), grpc_duration_count(sidecar)
    client = tgrpc.InferenceServerClient(sidecar.grpc_url)
    seen: Counter = Counter()  # (model label, code) as the client saw it

    def call(model_label: str, fn, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
            seen[(model_label, "OK")] += 1
        except InferenceServerException as exc:
            seen[(model_label, code_of(exc))] += 1

    bad = tgrpc.InferInput("NOT_AN_INPUT", [1, 16, 32], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 16, 32), np.float32))
    fault(triton.state_dir, "set", "--model", "ranker", "--version", "2", "--error-rate", "0.5")
    try:
        for i in range(20):
            call("ranker", client.infer, "ranker", infer_inputs("ranker", seed=i), model_version="2")
        for i in range(5):
            call("dense_unbatched", client.infer, "dense_unbatched", infer_inputs("dense_unbatched", seed=i))
            call(contract.MODEL_OVERFLOW, client.infer, f"no_such_model_{i}", infer_inputs("ranker"))
            call("ranker", client.infer, "ranker", [bad])
            call("ranker", client.get_model_metadata, "ranker")

        # A stream: each message is one request, its response or in-stream error closes it.
        answers: queue.Queue = queue.Queue()
        client.start_stream(lambda result, error: answers.put(error))
        for i in range(10):
            client.async_stream_infer(
                "ranker", infer_inputs("ranker", seed=i), model_version="2", request_id=str(i)
            )
        client.async_stream_infer("no_such_model", infer_inputs("ranker"), request_id="x")
        for _ in range(11):
            error = answers.get(timeout=30)
            if error is None:
                seen[("ranker", "OK")] += 1
            elif "unknown model" in error.message():
                seen[(contract.MODEL_OVERFLOW, "NOT_FOUND")] += 1
            else:
                assert "injected" in error.message()
                seen[("ranker", "INTERNAL")] += 1
        client.stop_stream()
    finally:
        fault(triton.state_dir, "clear", "--model", "ranker")
        client.close()

    assert seen[("ranker", "INTERNAL")] > 0 and seen[("ranker", "OK")] > 0  # the fault really fired
    wait_for(lambda: in_flight(sidecar) == 0, what="nothing in flight")
    after = grpc_counts(sidecar)
    delta = Counter({k: after[k] - before[k] for k in after if after[k] != before[k]})
    expected = Counter(
        {
            (m, code, contract.OUTCOME_SUCCESS if code == "OK" else outcome_of(code)): n
            for (m, code), n in seen.items()
        }
    )
    assert delta == expected
    # Unknown models are counted, not timed (the series budget).
    timed = sum(n for (m, _), n in seen.items() if m != contract.MODEL_OVERFLOW)
    assert grpc_duration_count(sidecar) - before_hist == timed
    assert grpc_up(sidecar) == 1


def outcome_of(code: str) -> str:
    if code in ("INTERNAL", "UNAVAILABLE", "UNKNOWN", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"):
        return contract.OUTCOME_SERVER_ERROR
    return contract.OUTCOME_CLIENT_ERROR


def test_sigterm_drains_grpc_calls_in_flight(triton, tmp_path) -> None:
    fault(triton.state_dir, "set", "--model", "ranker", "--version", "1", "--extra-latency-ms", "800")
    try:
        with launch_sidecar(triton.http_url, triton.grpc_url, tmp_path, "--drain-timeout", "20") as sc:
            results: list[str] = []

            def one(i: int) -> None:
                client = tgrpc.InferenceServerClient(sc.grpc_url)
                try:
                    client.infer(
                        "ranker", infer_inputs("ranker", seed=i), model_version="1", client_timeout=20
                    )
                    results.append("OK")
                except InferenceServerException as exc:
                    results.append(code_of(exc))

            threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            wait_for(lambda: in_flight(sc) == 4, what="4 calls in flight")
            os.killpg(sc.proc.pid, signal.SIGTERM)
            for t in threads:
                t.join(30)
            assert results == ["OK"] * 4
            assert sc.proc.wait(30) == 0
    finally:
        fault(triton.state_dir, "clear", "--model", "ranker")


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_upstream_killed_mid_load_no_hang_all_counted_and_recovers(how: str, processes, tmp_path) -> None:
    """SIGKILL: the upstream vanishes; SIGTERM: it drains and says GOAWAY (a rolling restart)."""
    server = SmallTriton(processes, tmp_path / "triton").start()
    with launch_sidecar(
        server.http_url,
        server.grpc_url,
        tmp_path,
        "--connect-timeout",
        "0.5",
    ) as sc:
        seen: Counter = Counter()
        slowest = [0.0]
        stop = threading.Event()
        lock = threading.Lock()

        def load() -> None:
            client = tgrpc.InferenceServerClient(sc.grpc_url)
            inputs = infer_inputs("ranker")
            while not stop.is_set():
                started = time.monotonic()
                try:
                    client.infer("ranker", inputs, model_version="1", client_timeout=10)
                    code = "OK"
                except InferenceServerException as exc:
                    code = code_of(exc)
                    time.sleep(0.01)
                with lock:
                    seen[code] += 1
                    slowest[0] = max(slowest[0], time.monotonic() - started)
            client.close()

        workers = [threading.Thread(target=load) for _ in range(2)]
        for w in workers:
            w.start()
        try:
            wait_for(lambda: seen["OK"] >= 20, timeout=30, what="traffic flowing")
            if how == "SIGKILL":
                server.kill()
            else:
                server.stop()  # Triton finishes what it has, then exits
            wait_for(lambda: seen["UNAVAILABLE"] >= 20, timeout=10, what="fast UNAVAILABLE answers")
            assert grpc_up(sc) == 0
            ok_before = seen["OK"]
            server.start()  # same ports, same command
            wait_for(lambda: seen["OK"] >= ok_before + 20, timeout=30, what="traffic flowing again")
            assert grpc_up(sc) == 1
        finally:
            stop.set()
            for w in workers:
                w.join(30)
            server.stop()

        assert slowest[0] < 10  # nothing waited for the client deadline: no call hung
        assert set(seen) <= {"OK", "UNAVAILABLE", "INTERNAL", "CANCELLED"}, seen
        wait_for(lambda: in_flight(sc) == 0, what="nothing in flight")
        counted = grpc_counts(sc)
        by_code: Counter = Counter()
        for (_, code, _), n in counted.items():
            by_code[code] += n
        assert by_code == seen
        assert all(outcome == outcome_of(code) or code == "OK" for (_, code, outcome) in counted)


@pytest.mark.parametrize("engine", ["relay", "aio"])
def test_grpc_engine_flag_picks_the_engine(engine: str, triton, tmp_path) -> None:
    with launch_sidecar(triton.http_url, triton.grpc_url, tmp_path, "--grpc-engine", engine) as sc:
        client = tgrpc.InferenceServerClient(sc.grpc_url)
        result = client.infer("ranker", infer_inputs("ranker"), model_version="1")
        assert result.as_numpy("SCORES").shape == (1, 16)
        client.close()
        wait_for(lambda: grpc_counts(sc)[("ranker", "OK", "success")] == 1, what="the call counted")
        listening = "grpc relay listening" if engine == "relay" else "grpc proxy listening"
        assert listening in sc.log()


# Reconnect quickly while a sidecar restarts (gRPC's default backoff grows to 120 s).
FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 300),
]
SIGTERM_ROUNDS = 20


def test_repeated_sigterm_under_grpc_load_fails_no_call(triton, tmp_path) -> None:
    """A rolling restart: 4 clients keep calling the sidecar (the real Triton behind it) while it
    gets SIGTERM, exits and starts again on the same port, 20 times. Calls the sidecar took
    before its GOAWAY are answered; later ones are refused unprocessed and retried by gRPC on the
    next sidecar. Not one call fails. The clients wait for a connection (``wait_for_ready``), as
    a client does while the only endpoint restarts; that covers the seconds with no listener, not
    a call the sidecar accepted."""
    port = free_port()
    request = raw_infer_request("ranker", "1")
    stop = threading.Event()
    lock = threading.Lock()
    ok = [0]
    failures: list[str] = []

    def load() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=FAST_RECONNECT) as channel:
            infer = channel.unary_unary(SERVICE + "ModelInfer")
            while not stop.is_set():
                try:
                    infer(request, timeout=60, wait_for_ready=True)
                    with lock:
                        ok[0] += 1
                except grpc.RpcError as exc:
                    with lock:
                        failures.append(f"{exc.code().name}: {exc.details()}")

    workers = [threading.Thread(target=load) for _ in range(4)]
    for w in workers:
        w.start()
    try:
        for i in range(SIGTERM_ROUNDS):
            with launch_sidecar(
                triton.http_url, triton.grpc_url, tmp_path, "--grpc-port", str(port), name=f"sidecar-{i}"
            ) as sc:
                before = ok[0]
                wait_for(lambda before=before: ok[0] >= before + 20, timeout=30, what=f"round {i}: load")
                if i == SIGTERM_ROUNDS - 1:
                    stop.set()  # no sidecar comes after this one: the clients' last calls go to it
                os.killpg(sc.proc.pid, signal.SIGTERM)
                assert sc.proc.wait(30) == 0, sc.log()
                assert not failures, (i, failures[:5])
    finally:
        stop.set()
        for w in workers:
            w.join(90)
    assert not failures, failures[:5]
    assert ok[0] >= 20 * SIGTERM_ROUNDS
