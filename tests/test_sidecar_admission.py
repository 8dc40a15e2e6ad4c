"""Admission (sidecar/core/admission.py): one limit for every protocol.

Unit tests of ``Admission``, and the ``inferwatch sidecar`` process in front of the real Triton
with ``--max-in-flight 2``: two requests held on one protocol, and the next request on the other
protocol gets that protocol's fixed overload answer (HTTP 503, gRPC RESOURCE_EXHAUSTED), counted.
Requests are held open with the token-streaming model (tiny_stream): an HTTP ``generate_stream``
that the client has not finished reading, or a gRPC ``ModelStreamInfer`` stream left open (a
stream counts once, however many requests it carries).
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Iterator

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc

from inferwatch import contract
from reference_server.catalog import example_input
from sidecar.core.admission import IN_FLIGHT, Admission
from tests.fixtures.sidecar import launch_sidecar

REQUESTS = contract.REQUESTS_TOTAL.name
STREAM_MODEL = "tiny_stream"


# --------------------------------------------------------------------------- unit


def test_admits_up_to_the_limit_then_refuses_with_a_reason() -> None:
    a = Admission(2)
    assert a.acquire("m") is None and a.acquire("other") is None  # the limit is global
    refusal = a.acquire("m")
    assert refusal is not None and refusal.reason == IN_FLIGHT
    assert refusal.message == "inferwatch sidecar: more than 2 requests in flight"
    assert a.active == 2  # a refusal holds nothing
    a.release("m")
    assert a.acquire("m") is None and a.active == 2


def test_no_limit_admits_everything() -> None:
    a = Admission(0)
    assert all(a.acquire("m") is None for _ in range(10_000))


# --------------------------------------------------------------------------- the process


@contextlib.contextmanager
def held_http_streams(sidecar, n: int) -> Iterator[None]:
    """``n`` generate_stream requests whose first token arrived and whose end is far away."""
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(base_url=sidecar.base_url, timeout=30))
        lines = []  # kept: a line iterator that is collected closes its response
        for _ in range(n):
            resp = stack.enter_context(
                client.stream(
                    "POST",
                    f"/v2/models/{STREAM_MODEL}/versions/1/generate_stream",
                    json={"text_input": "a b", "max_tokens": 4096},
                )
            )
            assert resp.status_code == 200
            lines.append(resp.iter_lines())
            next(lines[-1])  # the first token: the request is in flight
        yield


@contextlib.contextmanager
def held_grpc_streams(sidecar, n: int) -> Iterator[None]:
    """``n`` open ModelStreamInfer streams, each after one finished request."""
    clients = []
    try:
        for _ in range(n):
            client = tgrpc.InferenceServerClient(sidecar.grpc_url)
            clients.append(client)
            got: queue.Queue = queue.Queue()
            client.start_stream(callback=lambda result, error, got=got: got.put((result, error)))
            text = tgrpc.InferInput("text_input", [1], "BYTES")
            text.set_data_from_numpy(np.array([b"a"], dtype=np.object_))
            tokens = tgrpc.InferInput("max_tokens", [1], "INT32")
            tokens.set_data_from_numpy(np.array([1], np.int32))
            client.async_stream_infer(STREAM_MODEL, [text, tokens], model_version="1")
            _result, error = got.get(timeout=30)
            assert error is None, error
        yield
    finally:
        for client in clients:
            client.stop_stream()
            client.close()


def infer_ranker_http(sidecar) -> httpx.Response:
    x = example_input("ranker", batch=1)["FEATURES"]
    body = {
        "inputs": [
            {"name": "FEATURES", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}
        ]
    }
    return httpx.post(f"{sidecar.base_url}/v2/models/ranker/versions/1/infer", json=body, timeout=30)


def wait_idle(sidecar, timeout: float = 30.0) -> None:
    """Until the sidecar has no request in flight (a client's leaving reaches it asynchronously)."""
    deadline = time.monotonic() + timeout
    while sum(sidecar.counts(contract.REQUESTS_IN_FLIGHT.name).values()) > 0:
        assert time.monotonic() < deadline, "requests still in flight after their clients left"
        time.sleep(0.05)


def ready_grpc(sidecar) -> None:
    with grpc.insecure_channel(sidecar.grpc_url) as channel:
        live = channel.unary_unary("/inference.GRPCInferenceService/ServerLive")
        live(b"", timeout=30)


@pytest.mark.integration
@pytest.mark.parametrize("engine", ["relay", "aio"])
def test_max_in_flight_is_the_total_across_http_and_grpc(triton, tmp_path, engine) -> None:
    with launch_sidecar(
        triton.http_url, triton.grpc_url, tmp_path, "--max-in-flight", "2", "--grpc-engine", engine
    ) as sc:
        before = sc.counts(REQUESTS, "protocol", "code")
        # Two HTTP requests in flight: a gRPC call is refused, RESOURCE_EXHAUSTED.
        with held_http_streams(sc, 2):
            with pytest.raises(grpc.RpcError) as info:
                ready_grpc(sc)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "more than 2 requests in flight" in info.value.details()
        # Both released (the client left; the sidecar learns it a moment later): the gRPC side
        # admits again.
        wait_idle(sc)
        ready_grpc(sc)
        # Two gRPC streams in flight: an HTTP request is refused, 503.
        with held_grpc_streams(sc, 2):
            assert infer_ranker_http(sc).status_code == 503
        wait_idle(sc)
        assert infer_ranker_http(sc).status_code == 200
        after = sc.counts(REQUESTS, "protocol", "code")

    def delta(protocol: str, code: str) -> float:
        return after.get((protocol, code), 0.0) - before.get((protocol, code), 0.0)

    assert delta("grpc", "RESOURCE_EXHAUSTED") == 1
    assert delta("http", "503") == 1
