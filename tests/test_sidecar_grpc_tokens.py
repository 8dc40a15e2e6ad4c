"""Token timing on gRPC ``ModelStreamInfer`` (sidecar/protocols/grpc_tokens.py): a decoupled model answers
one request with one response per token; the sidecar records TTFT, inter-token gaps, TPOT and
generation tokens per request, and a mid-stream error as a server_error.

Unit tests feed hand-made responses; the integration tests run both gRPC engines in-process with
a real ``Telemetry`` and the LLM telemetry (``sidecar.core.streams.StreamTelemetry``) in front of the real
Triton's ``tiny_stream`` (reference_server/README.md: 20 ms to the first token, then 10 ms per
token on version 1), driven by tritonclient's ``start_stream``/``async_stream_infer``.
"""

from __future__ import annotations

import asyncio
import queue
import struct
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
from prometheus_client import CollectorRegistry
from tritonclient.grpc import service_pb2 as pb

from inferwatch import contract
from reference_server import faults
from sidecar.apis.routes import classify
from sidecar.config import SidecarConfig
from sidecar.core.streams import StreamTelemetry
from sidecar.core.telemetry import Telemetry
from sidecar.protocols.grpc_aio import ENGINES, GrpcProxy
from sidecar.protocols.grpc_relay import GrpcRelay
from sidecar.protocols.grpc_streams import StreamMatcher
from sidecar.protocols.grpc_tokens import StreamTokens
from tests.fixtures.sidecar import launch_sidecar
from tests.test_sidecar_grpc import (
    REQUESTS,
    SmallTriton,
    infer_inputs,
    served_models,
    wait_for,
)
from tests.test_sidecar_grpc import (
    loop as loop,  # the module's event-loop thread fixture
)

MODEL = "tiny_stream"
TTFT = contract.TIME_TO_FIRST_TOKEN.name
TPOT = contract.TIME_PER_OUTPUT_TOKEN.name
ITL = contract.INTER_TOKEN_LATENCY.name
TOKENS = contract.TOKENS_TOTAL.name


class Metrics:
    """A ``Telemetry`` and its LLM telemetry on a fresh registry, and readers for the tests."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        config = SidecarConfig()
        self.telemetry = Telemetry(self.registry, config)
        self.streams = StreamTelemetry(self.registry, config, self.telemetry, classify)

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        total = 0.0
        for family in self.registry.collect():
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total

    def requests(self, code: str, outcome: str) -> float:
        return self.value(REQUESTS, model=MODEL, protocol="grpc", code=code, outcome=outcome)

    def tokens(self) -> float:
        return self.value(TOKENS, model=MODEL, protocol="grpc", type=contract.TOKEN_GENERATION)

    def count(self, name: str) -> float:
        return self.value(name + "_count", model=MODEL)  # histograms have no protocol label

    def total(self, name: str) -> float:
        return self.value(name + "_sum", model=MODEL)


# --------------------------------------------------------------------------- unit


def response(rid: str, text: bytes | None, final: bool | None = False, error: str = "") -> bytes:
    """A ModelStreamInferResponse as tiny_stream's are: one text_output per token."""
    r = pb.ModelStreamInferResponse(error_message=error)
    ir = r.infer_response
    ir.model_name, ir.model_version, ir.id = MODEL, "1", rid
    if final is not None:
        ir.parameters["triton_final_response"].bool_param = final
    if text is not None:
        ir.outputs.add(name="text_output", datatype="BYTES", shape=[1])
        ir.raw_output_contents.append(struct.pack("<I", len(text)) + text)
    return r.SerializeToString()


def test_tokens_per_request_by_id_and_the_error_closes_with_what_came_before() -> None:
    m = Metrics()
    m.telemetry.update_models({MODEL: ["1"]})
    matcher, tokens = StreamMatcher(), StreamTokens(m.streams)
    tel = m.telemetry
    for rid in ("a", "b"):
        matcher.add(rid, tel.begin(MODEL, "1", contract.PROTOCOL_GRPC), 10)

    def feed(data: bytes, rid: str, error: str = "", final: bool | None = False) -> None:
        tokens.response(matcher, data, rid, error)
        entry = matcher.take(rid, bool(error), final)
        if entry is not None:
            tokens.closed(entry[0])
            code = "INTERNAL" if error else "OK"
            tel.end(entry[0], code, tel.outcome_for_grpc(code), entry[1], len(data))

    for text in (b"x ", b"y ", b"z "):  # interleaved on one stream, told apart by their ids
        feed(response("a", text), "a")
        feed(response("b", text), "b")
    feed(response("a", b""), "a")  # an empty text is no token
    feed(response("a", None, final=True), "a", final=True)  # the empty final response
    feed(response("b", None, final=True, error="boom"), "b", "boom", final=True)
    assert m.requests("OK", "success") == 1 and m.requests("INTERNAL", "server_error") == 1
    assert m.tokens() == 6
    assert m.count(TTFT) == 2 and m.count(ITL) == 4 and m.count(TPOT) == 2


def test_a_request_without_tokens_records_no_token_metrics() -> None:
    m = Metrics()
    matcher, tokens = StreamMatcher(), StreamTokens(m.streams)
    obs = m.telemetry.begin(MODEL, "1", contract.PROTOCOL_GRPC)
    matcher.add("r", obs, 10)
    tokens.response(matcher, response("r", None, final=None, error="bad input"), "r", "bad input")
    entry = matcher.take("r", True, None)
    assert entry is not None
    tokens.closed(entry[0])
    assert m.tokens() == 0 and m.count(TTFT) == 0 and m.count(TPOT) == 0


# --------------------------------------------------------------------------- the real Triton


class TokenProxy:
    """One gRPC engine in-process, with ``Metrics``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, engine: str, upstream: str) -> None:
        self.loop = loop
        self.m = Metrics()
        cls = GrpcRelay if engine == "relay" else GrpcProxy
        host, _, port = upstream.rpartition(":")
        config = SidecarConfig(upstream_grpc=(host, int(port)))
        self.proxy = cls(config, self.m.telemetry, streams=self.m.streams)
        port = asyncio.run_coroutine_threadsafe(self.proxy.start("127.0.0.1", 0), loop).result(30)
        self.url = f"127.0.0.1:{port}"

    def serve_models(self, models: dict[str, list[str]]) -> None:
        self.loop.call_soon_threadsafe(self.m.telemetry.update_models, models)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.stop(0), self.loop).result(30)


@pytest.fixture(params=ENGINES)
def proxy(request, loop, triton) -> Iterator[TokenProxy]:
    p = TokenProxy(loop, request.param, triton.grpc_url)
    p.serve_models(served_models(triton.grpc_url))
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def clean_faults(triton) -> Iterator[None]:
    faults.clear(state_dir=triton.state_dir)
    try:
        yield
    finally:
        faults.clear(state_dir=triton.state_dir)


class Stream:
    """tritonclient's ModelStreamInfer through the proxy: what the callback got, per request id."""

    def __init__(self, url: str) -> None:
        self.client = tgrpc.InferenceServerClient(url)
        self.got: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.got.put((result, error)))

    def send(self, rid: str, tokens: int, empty_final: bool) -> None:
        text = tgrpc.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"alpha beta gamma"], dtype=np.object_))
        n = tgrpc.InferInput("max_tokens", [1], "INT32")
        n.set_data_from_numpy(np.array([tokens], np.int32))
        self.client.async_stream_infer(
            MODEL, [text, n], model_version="1", request_id=rid, enable_empty_final_response=empty_final
        )

    def read(self, n: int) -> list[tuple[str | None, str | None]]:
        """The next ``n`` callbacks: (text, error message)."""
        out = []
        for _ in range(n):
            result, error = self.got.get(timeout=30)
            if error is not None:
                out.append((None, error.message()))
                continue
            tokens = result.as_numpy("text_output")
            out.append((None if tokens is None else tokens[0].decode(), None))
        return out

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


@pytest.mark.integration
@pytest.mark.parametrize("empty_final", [True, False])
def test_a_stream_of_n_tokens_is_one_request_with_n_tokens_and_a_ttft(proxy, empty_final: bool) -> None:
    m = proxy.m
    s = Stream(proxy.url)
    try:
        s.send("r1", 5, empty_final)
        got = s.read(6 if empty_final else 5)
        assert [t for t, _ in got[:5]] == ["alpha ", "beta ", "gamma ", "alpha ", "beta "]
        if empty_final:
            assert got[5] == (None, None)  # the empty final response: no text
            # Its final flag closes the request while the stream stays open.
            wait_for(lambda: m.requests("OK", "success") == 1, what="the request counted")
        else:
            assert m.requests("OK", "success") == 0  # nothing marks its end yet
    finally:
        s.close()  # without the final response, the stream's end closes the request
    wait_for(lambda: m.requests("OK", "success") == 1, what="the request counted")
    assert m.value(REQUESTS, model=MODEL) == 1  # counted once
    assert m.tokens() == 5
    assert m.count(TTFT) == 1 and m.count(ITL) == 4 and m.count(TPOT) == 1
    # The model waits 20 ms after the request reached it before its first token: a lower bound.
    # (Its 10 ms between tokens is not one for the gaps seen here: delivery jitters.)
    assert m.total(TTFT) >= 0.02 and m.total(TPOT) > 0


@pytest.mark.integration
@pytest.mark.parametrize("empty_final", [True, False])
def test_an_error_after_n_tokens_is_a_server_error_with_its_tokens(
    proxy, triton, clean_faults, empty_final: bool
) -> None:
    faults.set_fault(MODEL, "1", error_after_tokens=2, state_dir=triton.state_dir)
    m = proxy.m
    s = Stream(proxy.url)
    try:
        s.send("r1", 6, empty_final)
        got = s.read(3)
        assert [t for t, _ in got[:2]] == ["alpha ", "beta "]
        assert got[2][1] is not None and faults.INJECTED in got[2][1]
        # The error closes the request; the stream stays open and carries the next request.
        wait_for(lambda: m.requests("INTERNAL", "server_error") == 1, what="the error counted")
    finally:
        s.close()
    assert m.requests("OK", "success") == 0
    assert m.tokens() == 2 and m.count(TTFT) == 1 and m.count(ITL) == 1 and m.count(TPOT) == 1


@pytest.mark.integration
def test_a_client_that_cancels_mid_stream_is_counted_with_the_tokens_it_got(proxy) -> None:
    m = proxy.m
    s = Stream(proxy.url)
    try:
        s.send("r1", 500, True)
        s.read(3)
    finally:
        s.client.stop_stream(cancel_requests=True)
        s.client.close()
    wait_for(lambda: m.requests("CANCELLED", "client_error") == 1, what="the cancelled request counted")
    assert m.value(REQUESTS, model=MODEL) == 1
    assert 3 <= m.tokens() < 500 and m.count(TTFT) == 1 and m.count(TPOT) == 1


@pytest.mark.integration
@pytest.mark.parametrize("engine", ENGINES)
def test_an_upstream_killed_mid_stream_is_a_server_error_with_the_tokens_sent(
    loop, engine, processes, tmp_path
) -> None:
    server = SmallTriton(processes, tmp_path, 0, f"--load-model={MODEL}").start()
    p = TokenProxy(loop, engine, server.grpc_url)
    try:
        p.serve_models({MODEL: ["1", "2"]})
        s = Stream(p.url)
        try:
            s.send("r1", 500, True)
            s.read(3)
            server.kill()
            wait_for(
                lambda: p.m.requests("UNAVAILABLE", "server_error") == 1,
                what="the cut stream counted",
            )
        finally:
            s.client.stop_stream(cancel_requests=True)
            s.client.close()
        assert p.m.value(REQUESTS, model=MODEL) == 1
        assert 3 <= p.m.tokens() < 500 and p.m.count(TTFT) == 1
    finally:
        p.close()
        server.stop()


@pytest.mark.integration
def test_two_requests_on_one_stream_and_unary_calls_record_no_tokens(proxy) -> None:
    m = proxy.m
    s = Stream(proxy.url)
    try:
        s.send("a", 3, True)
        s.send("b", 4, True)
        s.read(3 + 1 + 4 + 1)
        wait_for(lambda: m.requests("OK", "success") == 2, what="both requests counted")
    finally:
        s.close()
    assert m.tokens() == 7 and m.count(TTFT) == 2 and m.count(ITL) == 5
    # A unary call (KServe ModelInfer) goes by without touching the token metrics.
    client = tgrpc.InferenceServerClient(proxy.url)
    try:
        client.infer("ranker", infer_inputs("ranker"))
    finally:
        client.close()
    assert m.value(REQUESTS, model="ranker", code="OK") == 1
    assert m.value(TTFT + "_count", model="ranker") == 0
    assert m.value(TOKENS, model="ranker") == 0


@pytest.mark.integration
def test_the_sidecar_process_records_grpc_token_streams(triton, tmp_path) -> None:
    """``inferwatch sidecar`` hands its LLM telemetry to the gRPC side (sidecar.main)."""
    with launch_sidecar(triton.http_url, triton.grpc_url, tmp_path) as sc:
        s = Stream(sc.grpc_url)
        try:
            s.send("r1", 4, True)
            s.read(5)
        finally:
            s.close()

        def grpc_sum(name: str, **labels: str) -> float:
            found = sc.counts(name, "model", "protocol", *labels)
            return found.get((MODEL, "grpc", *labels.values()), 0.0)

        wait_for(lambda: grpc_sum(REQUESTS) == 1, what="the request counted")
        assert grpc_sum(TOKENS, type=contract.TOKEN_GENERATION) == 4
        # The token histograms have no protocol label: this test sends only gRPC.
        hist = sc.counts(TTFT + "_count", "model"), sc.counts(ITL + "_count", "model")
        assert hist[0].get((MODEL,)) == 1 and hist[1].get((MODEL,)) == 3
