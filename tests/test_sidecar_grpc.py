"""The gRPC proxy against the real Triton: tritonclient.grpc through the proxy sees what it sees
directly (unary, binary tensors, streaming, metadata and config calls, errors), and the proxy's
counters equal what the client saw.

The proxy runs in-process on its own uvloop thread (as ``inferwatch sidecar`` runs it) with a real
``Telemetry`` on a fresh registry per test, so counts are exact; the sidecar process as a whole
is covered by the sidecar suites.
"""

from __future__ import annotations

import asyncio
import http.server
import itertools
import json
import queue
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import uvloop
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.exposition import generate_latest as generate_latest_openmetrics
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from inferwatch import contract
from reference_server.catalog import MODELS, example_input
from reference_server.launcher import TritonServer, find_binary, prepare_backends, triton_env
from sidecar.config import SidecarConfig
from sidecar.core.telemetry import UPSTREAM_GRPC, Telemetry
from sidecar.protocols.grpc_aio import ENGINES, GrpcProxy
from sidecar.protocols.grpc_relay import GrpcRelay
from tests.fixtures.net import Processes, free_port, inferwatch_cmd, wait_http

pytestmark = pytest.mark.integration

REQUESTS = contract.REQUESTS_TOTAL.name
IN_FLIGHT = contract.REQUESTS_IN_FLIGHT.name
UP = contract.UPSTREAM_UP.name
SERVICE = "/inference.GRPCInferenceService/"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class LoopThread:
    """One uvloop for every proxy of the module: grpc.aio binds its completion queue to the
    loops it has seen, so loops are not created and closed per test."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="grpc-proxy", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class InProcessProxy:
    """One gRPC engine with a real ``Telemetry``, served from the shared event-loop thread;
    ``settings`` are ``SidecarConfig`` fields (``request_timeout``, ``max_in_flight``, ...)."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, engine: str, upstream: str, tracer=None, **settings
    ) -> None:
        host, _, port = upstream.rpartition(":")
        config = SidecarConfig(upstream_grpc=(host.strip("[]"), int(port)), **settings)
        self.registry = CollectorRegistry()
        self.telemetry = Telemetry(self.registry, config, tracer)
        self.loop = loop
        self.engine = engine
        self.proxy = (GrpcRelay if engine == "relay" else GrpcProxy)(config, self.telemetry)
        self.url = f"127.0.0.1:{self.run(self.proxy.start('127.0.0.1', 0))}"

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve_models(self, models: dict[str, list[str]]) -> None:
        """What sidecar.main's refresher does with the upstream's repository index."""
        self.loop.call_soon_threadsafe(self.telemetry.update_models, models)

    def close(self) -> None:
        self.run(self.proxy.stop(0))

    def count(self, model: str, code: str, outcome: str, version: str = "") -> float:
        labels = {"model": model, "version": version, "protocol": "grpc", "code": code, "outcome": outcome}
        return self.registry.get_sample_value(REQUESTS, labels) or 0.0

    def counts(self) -> Counter:
        """(model, version, code, outcome) -> requests counted."""
        out: Counter = Counter()
        for family in self.registry.collect():
            for s in family.samples:
                if s.name == REQUESTS:
                    key = (s.labels["model"], s.labels["version"], s.labels["code"], s.labels["outcome"])
                    out[key] += int(s.value)
        return out

    def in_flight(self) -> float:
        return sum(s.value for f in self.registry.collect() for s in f.samples if s.name == IN_FLIGHT)

    def upstream_up(self) -> float | None:
        return self.registry.get_sample_value(UP, {"upstream": UPSTREAM_GRPC})


class SmallTriton:
    """A second Triton serving ``ranker`` only, started through ``Processes.start`` (the test's
    process registry, which stops it at the end), with ``TritonServer``'s argv and backends."""

    def __init__(self, processes: Processes, state_dir: Path, grpc_port: int = 0, *extra: str) -> None:
        self.processes = processes
        self.server = TritonServer(
            grpc_port=grpc_port or free_port(),
            http_port=free_port(),
            metrics_port=free_port(),
            state_dir_path=state_dir,
            extra_args=("--model-control-mode=explicit", "--load-model=ranker", *extra),
        )
        binary = find_binary()
        self.cmd = self.server.command(binary, prepare_backends(binary, state_dir / "backends"))
        self.env = triton_env(faults_dir=state_dir / "faults")
        self.proc: subprocess.Popen | None = None
        self.grpc_url = self.server.grpc_url
        self.http_url = self.server.http_url

    def start(self) -> SmallTriton:
        self.proc = self.processes.start("triton", self.cmd, env=self.env)
        wait_http(f"http://{self.http_url}/v2/health/ready", timeout=180, proc=self.proc)
        return self

    def kill(self) -> None:
        """SIGKILL: the upstream vanishes without a goodbye."""
        assert self.proc is not None
        self.processes.stop(self.proc, signal.SIGKILL)

    def stop(self) -> None:
        if self.proc is not None:
            self.processes.stop(self.proc)


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what} not reached after {timeout}s")


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    thread = LoopThread()
    try:
        yield thread.loop
    finally:
        thread.stop()


def served_models(grpc_url: str) -> dict[str, list[str]]:
    """Model -> versions, from the upstream's repository index (what the refresher reads)."""
    index = tgrpc.InferenceServerClient(grpc_url).get_model_repository_index(as_json=True)
    out: dict[str, list[str]] = {}
    for entry in index["models"]:
        out.setdefault(entry["name"], []).append(entry.get("version", ""))
    return out


@pytest.fixture(scope="module")
def served(triton) -> dict[str, list[str]]:
    return served_models(triton.grpc_url)


@pytest.fixture(params=ENGINES)
def engine(request) -> str:
    """Both engines of the gRPC side: the HTTP/2 frame relay and the grpc.aio proxy."""
    return request.param


@pytest.fixture
def proxy(loop, engine, triton, served) -> Iterator[InProcessProxy]:
    p = InProcessProxy(loop, engine, triton.grpc_url)
    p.serve_models(served)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def clients(triton, proxy) -> Iterator[tuple[tgrpc.InferenceServerClient, tgrpc.InferenceServerClient]]:
    direct = tgrpc.InferenceServerClient(triton.grpc_url)
    via = tgrpc.InferenceServerClient(proxy.url)
    try:
        yield direct, via
    finally:
        direct.close()
        via.close()


def fault(state_dir: Path, *args: str) -> None:
    subprocess.run(
        inferwatch_cmd("fault", *args, "--state-dir", str(state_dir)),
        check=True,
        capture_output=True,
        timeout=30,
    )


def infer_inputs(model: str, batch: int = 1, seed: int = 0) -> list[tgrpc.InferInput]:
    tensors = []
    for t in MODELS[model].inputs:
        data = example_input(model, batch=batch, seed=seed)[t.name]
        tensor = tgrpc.InferInput(t.name, list(data.shape), t.datatype)
        tensor.set_data_from_numpy(data)  # binary tensor data (raw_input_contents)
        tensors.append(tensor)
    return tensors


def raw_infer_request(model: str, version: str = "") -> bytes:
    """A valid ModelInferRequest as bytes, for calls made without tritonclient."""
    req = pb.ModelInferRequest(model_name=model, model_version=version)
    for t in MODELS[model].inputs:
        data = example_input(model, seed=0)[t.name]
        req.inputs.add(name=t.name, datatype=t.datatype, shape=list(data.shape))
        req.raw_input_contents.append(data.tobytes())
    return req.SerializeToString()


def outputs_of(result: tgrpc.InferResult, model: str) -> np.ndarray:
    return result.as_numpy(MODELS[model].output.name)


def error_of(fn, *args, **kwargs) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as info:
        fn(*args, **kwargs)
    return info.value.status(), info.value.message()


# --------------------------------------------------------------------------- unary


def test_unary_methods_give_identical_answers(clients, proxy) -> None:
    direct, via = clients
    for name in ("is_server_live", "is_server_ready"):
        assert getattr(via, name)() is getattr(direct, name)() is True
    assert via.get_server_metadata(as_json=True) == direct.get_server_metadata(as_json=True)
    assert via.get_model_repository_index(as_json=True) == direct.get_model_repository_index(as_json=True)
    for model, info in MODELS.items():
        assert via.is_model_ready(model) is direct.is_model_ready(model) is True
        assert via.get_model_config(model, as_json=True) == direct.get_model_config(model, as_json=True)
        for version in info.versions:
            assert via.get_model_metadata(model, version, as_json=True) == direct.get_model_metadata(
                model, version, as_json=True
            )

    counts = proxy.counts()
    assert counts[("", "", "OK", "success")] == 4  # live, ready, server metadata, repository index
    assert counts[("ranker", "", "OK", "success")] == 2  # ready + config
    assert counts[("ranker", "1", "OK", "success")] == counts[("ranker", "2", "OK", "success")] == 1
    assert sum(counts.values()) == 4 + sum(2 + len(i.versions) for i in MODELS.values())


def test_inference_with_binary_tensors_is_byte_identical(clients, proxy) -> None:
    direct, via = clients
    sent = 0
    for model, info in MODELS.items():
        for version in info.versions:
            for batch in (1, 8):  # 8 rows of dense: 128 KiB each way, past the 64 KiB flow-control windows
                inputs = infer_inputs(model, batch=batch, seed=batch)
                a = direct.infer(model, inputs, model_version=version, request_id=f"{model}-{batch}")
                b = via.infer(
                    model,
                    inputs,
                    model_version=version,
                    request_id=f"{model}-{batch}",
                    headers={"traceparent": TRACEPARENT},
                )
                assert outputs_of(b, model).tobytes() == outputs_of(a, model).tobytes()
                assert b.get_response(as_json=True) == a.get_response(as_json=True)
                assert proxy.count(model, "OK", "success", version) == (2 if batch == 8 else 1)
                sent += 1
    assert sum(proxy.counts().values()) == sent
    assert proxy.in_flight() == 0
    byte_samples = {
        s.labels["model"]: s.value
        for f in proxy.registry.collect()
        for s in f.samples
        if s.name == contract.REQUEST_BYTES.name
    }
    assert byte_samples["dense_batched"] > 2 * 4 * MODELS["dense_batched"].input.shape[0]


def test_unknown_model_and_bad_input_pass_triton_codes_through(clients, proxy) -> None:
    direct, via = clients
    inputs = infer_inputs("ranker")
    seen = []
    for call in (
        lambda c: c.infer("no_such_model", inputs),
        lambda c: c.get_model_metadata("no_such_model"),
        lambda c: c.infer("ranker", inputs, model_version="99"),
    ):
        seen.append(error_of(call, via))
        assert seen[-1] == error_of(call, direct)
    unknown_version_code = seen[2][0].removeprefix("StatusCode.")
    bad = tgrpc.InferInput("NOT_AN_INPUT", [1, 16, 32], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 16, 32), np.float32))
    status, message = error_of(via.infer, "ranker", [bad])
    assert (status, message) == error_of(direct.infer, "ranker", [bad])
    assert status == "StatusCode.INVALID_ARGUMENT"

    counts = proxy.counts()
    # Names Triton does not serve collapse into the overflow label; the code is Triton's.
    assert counts[(contract.MODEL_OVERFLOW, "", "NOT_FOUND", "client_error")] == 2
    # An unserved version of a served model keeps the model and collapses the version.
    assert counts[("ranker", contract.MODEL_OVERFLOW, unknown_version_code, "client_error")] == 1
    assert counts[("ranker", "", "INVALID_ARGUMENT", "client_error")] == 1


def test_injected_errors_are_identical_and_counted_as_server_errors(triton, clients, proxy) -> None:
    direct, via = clients
    fault(triton.state_dir, "set", "--model", "ranker", "--version", "2", "--error-rate", "1")
    try:
        inputs = infer_inputs("ranker")
        got = error_of(via.infer, "ranker", inputs, model_version="2")
        assert got == error_of(direct.infer, "ranker", inputs, model_version="2")
        assert got[0] == "StatusCode.INTERNAL" and "injected" in got[1]
        assert via.infer("ranker", inputs, model_version="1").as_numpy("SCORES") is not None
    finally:
        fault(triton.state_dir, "clear", "--model", "ranker")
    assert proxy.count("ranker", "INTERNAL", "server_error", "2") == 1
    assert proxy.count("ranker", "OK", "success", "1") == 1


def test_malformed_request_bytes_get_tritons_answer(triton, proxy) -> None:
    def raw(url: str) -> tuple[grpc.StatusCode, str]:
        with grpc.insecure_channel(url) as channel:
            call = channel.unary_unary(SERVICE + "ModelInfer")
            with pytest.raises(grpc.RpcError) as info:
                call(b"\x0a\x50truncated", timeout=10)
            return info.value.code(), info.value.details()

    got = raw(proxy.url)
    assert got == raw(triton.grpc_url)
    assert proxy.count("", got[0].name, Telemetry.outcome_for_grpc(got[0].name)) == 1


def test_methods_outside_the_service_pass_through(triton, proxy) -> None:
    """grpc.health.v1 (Triton serves it) answers the same bytes; an unknown method gets an error
    status (not a hang) and is counted with the code the client saw."""

    def call(url: str, method: str) -> tuple[str, bytes | None]:
        with grpc.insecure_channel(url) as channel:
            try:
                return "OK", channel.unary_unary(method)(b"", timeout=10)
            except grpc.RpcError as exc:
                return exc.code().name, None

    health = "/grpc.health.v1.Health/Check"
    assert call(proxy.url, health) == call(triton.grpc_url, health) == ("OK", b"\x08\x01")  # SERVING
    assert proxy.count("", "OK", "success") == 1
    code, _ = call(proxy.url, "/inference.NoSuchService/Nothing")
    # UNIMPLEMENTED from Triton; INTERNAL when grpc's client loses that race (module docstring).
    assert code in ("UNIMPLEMENTED", "INTERNAL")
    assert proxy.count("", code, Telemetry.outcome_for_grpc(code)) == 1


def test_concurrent_calls_on_shared_connections_are_each_counted_once(clients, proxy) -> None:
    """Calls from several threads multiplex on the same HTTP/2 connections: every answer is
    right for its own request and every call is counted once, under its own labels."""
    _direct, via = clients
    expected = {
        ("ranker", "1"): outputs_of(
            clients[0].infer("ranker", infer_inputs("ranker", seed=1), model_version="1"), "ranker"
        ),
        ("ranker", "2"): outputs_of(
            clients[0].infer("ranker", infer_inputs("ranker", seed=2), model_version="2"), "ranker"
        ),
    }
    failures: list[str] = []

    def worker(n: int) -> None:
        for i in range(15):
            version = "1" if (n + i) % 2 else "2"
            try:
                if i % 5 == 4:
                    error_of(via.infer, "no_such_model", infer_inputs("ranker"))
                    continue
                got = via.infer("ranker", infer_inputs("ranker", seed=int(version)), model_version=version)
                if outputs_of(got, "ranker").tobytes() != expected[("ranker", version)].tobytes():
                    failures.append(f"thread {n} call {i}: wrong answer")
            except Exception as exc:  # collected: the assertion below names it
                failures.append(f"thread {n} call {i}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures, failures[:5]
    wait_for(lambda: proxy.in_flight() == 0, what="nothing in flight")
    counts = proxy.counts()
    assert counts[("ranker", "1", "OK", "success")] == counts[("ranker", "2", "OK", "success")] == 36
    assert counts[(contract.MODEL_OVERFLOW, "", "NOT_FOUND", "client_error")] == 18
    assert sum(counts.values()) == 90


def test_bytes_that_are_not_http2_close_the_connection_and_harm_nothing(proxy) -> None:
    host, port = proxy.url.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n" + b"\x00" * 64)
        sock.settimeout(10)
        try:
            while sock.recv(4096):  # the server may send its own preface first; then it closes
                pass
        except ConnectionResetError:
            pass
    client = tgrpc.InferenceServerClient(proxy.url)
    assert client.is_server_live()
    assert sum(proxy.counts().values()) == 1


# --------------------------------------------------------------------------- streaming


def stream_results(client: tgrpc.InferenceServerClient, requests: list[dict], headers=None) -> dict:
    """Send each request on one ModelStreamInfer stream; id -> ("ok", output bytes) | ("error", message)."""
    answers: queue.Queue = queue.Queue()
    client.start_stream(lambda result, error: answers.put((result, error)), headers=headers)
    try:
        for req in requests:
            client.async_stream_infer(**req)
        out = {}
        for _ in requests:
            result, error = answers.get(timeout=30)
            if error is not None:
                out[len(out)] = ("error", error.message())
            else:
                rid = result.get_response().id
                model = result.get_response().model_name
                out[rid] = ("ok", outputs_of(result, model).tobytes())
        return out
    finally:
        client.stop_stream()


def test_stream_results_identical_and_each_message_counted(clients, proxy) -> None:
    direct, via = clients
    bad = tgrpc.InferInput("NOT_AN_INPUT", [1, 16, 32], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 16, 32), np.float32))
    requests = [
        *(
            {
                "model_name": "ranker",
                "inputs": infer_inputs("ranker", seed=i),
                "model_version": v,
                "request_id": f"r{v}-{i}",
            }
            for i in range(3)
            for v in ("1", "2")
        ),
        {"model_name": "dense_batched", "inputs": infer_inputs("dense_batched", batch=2), "request_id": "d"},
        {"model_name": "no_such_model", "inputs": infer_inputs("ranker"), "request_id": "missing"},
        {"model_name": "ranker", "inputs": [bad], "request_id": "bad"},
    ]
    got = stream_results(via, requests, headers={"traceparent": TRACEPARENT})
    assert got == stream_results(direct, requests)
    assert sum(1 for kind, _ in got.values() if kind == "ok") == 7

    wait_for(lambda: proxy.in_flight() == 0, what="stream observations closed")
    counts = proxy.counts()
    assert counts[("ranker", "1", "OK", "success")] == 3
    assert counts[("ranker", "2", "OK", "success")] == 3
    assert counts[("dense_batched", "", "OK", "success")] == 1
    assert counts[(contract.MODEL_OVERFLOW, "", "NOT_FOUND", "client_error")] == 1
    assert counts[("ranker", "", "INVALID_ARGUMENT", "client_error")] == 1
    assert sum(counts.values()) == len(requests)


def test_stream_injected_errors_and_triton_grpc_error_metadata(triton, clients, proxy) -> None:
    """An in-stream error counts as INTERNAL; the client's ``triton_grpc_error`` metadata reaches
    Triton through the proxy (it then ends the stream with the real status, as it does direct)."""
    direct, via = clients
    fault(triton.state_dir, "set", "--model", "ranker", "--version", "2", "--error-rate", "1")
    try:
        requests = [
            {
                "model_name": "ranker",
                "inputs": infer_inputs("ranker"),
                "model_version": "2",
                "request_id": "x",
            }
        ]
        got = stream_results(via, requests)
        assert got == stream_results(direct, requests)
        assert got[0][0] == "error" and "injected" in got[0][1]

        def with_status(client) -> str:
            answers: queue.Queue = queue.Queue()
            client.start_stream(
                lambda result, error: answers.put(error), headers={"triton_grpc_error": "true"}
            )
            client.async_stream_infer(**requests[0])
            error = answers.get(timeout=30)
            client.stop_stream()
            return error.status()

        assert with_status(via) == with_status(direct) == "StatusCode.INTERNAL"
    finally:
        fault(triton.state_dir, "clear", "--model", "ranker")
    wait_for(lambda: proxy.in_flight() == 0, what="stream observations closed")
    assert proxy.count("ranker", "INTERNAL", "server_error", "2") == 2


# --------------------------------------------------------------------------- deadlines, cancel


def test_client_deadline_and_proxy_timeout(loop, engine, triton, served) -> None:
    fault(triton.state_dir, "set", "--model", "ranker", "--version", "1", "--extra-latency-ms", "4000")
    short = InProcessProxy(loop, engine, triton.grpc_url, request_timeout=0.3)
    long = InProcessProxy(loop, engine, triton.grpc_url)
    try:
        short.serve_models(served)
        long.serve_models(served)
        inputs = infer_inputs("ranker")
        # The client's deadline travels upstream.
        started = time.monotonic()
        status, _ = error_of(
            tgrpc.InferenceServerClient(long.url).infer,
            "ranker",
            inputs,
            model_version="1",
            client_timeout=0.3,
        )
        assert status == "StatusCode.DEADLINE_EXCEEDED" and time.monotonic() - started < 3.0
        # No client deadline: the proxy's per-request timeout ends the call.
        started = time.monotonic()
        status, _ = error_of(
            tgrpc.InferenceServerClient(short.url).infer, "ranker", inputs, model_version="1"
        )
        assert status == "StatusCode.DEADLINE_EXCEEDED" and time.monotonic() - started < 3.0
    finally:
        fault(triton.state_dir, "clear", "--model", "ranker")
    for p in (short, long):
        wait_for(
            lambda p=p: p.count("ranker", "DEADLINE_EXCEEDED", "server_error", "1") == 1,
            what="deadline counted",
        )
        assert p.in_flight() == 0
        p.close()


def test_client_cancel_is_counted_and_releases_the_request(triton, proxy) -> None:
    fault(triton.state_dir, "set", "--model", "ranker", "--extra-latency-ms", "2000")
    try:
        request = raw_infer_request("ranker", "1")
        with grpc.insecure_channel(proxy.url) as channel:
            future = channel.unary_unary(SERVICE + "ModelInfer").future(request, timeout=30)
            wait_for(lambda: proxy.in_flight() == 1, what="request in flight")
            future.cancel()
            wait_for(
                lambda: proxy.count("ranker", "CANCELLED", "client_error", "1") == 1,
                timeout=5.0,
                what="cancel",
            )
        assert proxy.in_flight() == 0
    finally:
        fault(triton.state_dir, "clear", "--model", "ranker")


def test_message_size_limit(loop, engine, triton, served) -> None:
    small = InProcessProxy(loop, engine, triton.grpc_url, max_body_bytes=64 * 1024)
    try:
        small.serve_models(served)
        client = tgrpc.InferenceServerClient(small.url)
        status, _ = error_of(client.infer, "dense_batched", infer_inputs("dense_batched", batch=8))
        assert status == "StatusCode.RESOURCE_EXHAUSTED"
        if engine == "relay":  # the relay answers it itself and counts it; grpc.aio refuses it uncounted
            assert small.count("dense_batched", "RESOURCE_EXHAUSTED", "server_error") == 1
        # The proxy is unharmed: a request under the limit passes.
        assert client.infer("ranker", infer_inputs("ranker")).as_numpy("SCORES") is not None
        assert small.count("ranker", "OK", "success") == 1
    finally:
        small.close()


def test_in_flight_limit_gives_the_fixed_overload_answer_and_counts_it(loop, engine, triton, served) -> None:
    limited = InProcessProxy(loop, engine, triton.grpc_url, max_in_flight=1)
    fault(triton.state_dir, "set", "--model", "ranker", "--version", "1", "--extra-latency-ms", "3000")
    try:
        limited.serve_models(served)
        with grpc.insecure_channel(limited.url) as channel:
            infer = channel.unary_unary(SERVICE + "ModelInfer")
            first = infer.future(raw_infer_request("ranker", "1"), timeout=30)
            wait_for(lambda: limited.in_flight() == 1, what="one call in flight")
            with pytest.raises(grpc.RpcError) as info:
                infer(raw_infer_request("ranker", "2"), timeout=30)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert not first.done()  # refused while the accepted call was still running
            assert first.result(timeout=30)  # the accepted call is unharmed
        assert limited.count("ranker", "RESOURCE_EXHAUSTED", "server_error", "2") == 1
        assert limited.count("ranker", "OK", "success", "1") == 1
    finally:
        fault(triton.state_dir, "clear", "--model", "ranker")
        limited.close()


# --------------------------------------------------------------------------- dead upstream


def test_dead_upstream_is_unavailable_fast_counted_and_recovers(loop, engine, processes, tmp_path) -> None:
    port = free_port()
    p = InProcessProxy(loop, engine, f"127.0.0.1:{port}", connect_timeout=0.5)
    try:
        client = tgrpc.InferenceServerClient(p.url)
        for _ in range(5):
            started = time.monotonic()
            status, _ = error_of(client.is_server_ready, client_timeout=10)
            assert status == "StatusCode.UNAVAILABLE" and time.monotonic() - started < 2.0  # not 10
        assert p.count("", "UNAVAILABLE", "server_error") == 5
        wait_for(lambda: p.upstream_up() == 0, what="upstream_up 0")

        # The upstream comes back on the same address: traffic flows again without a restart.
        server = SmallTriton(processes, tmp_path, port).start()
        try:
            wait_for(lambda: p.upstream_up() == 1, timeout=5, what="upstream_up 1")
            result = client.infer("ranker", infer_inputs("ranker"), model_version="1")
            assert result.as_numpy("SCORES") is not None
        finally:
            server.stop()
        assert p.count("", "UNAVAILABLE", "server_error") == 5
        assert p.in_flight() == 0
    finally:
        p.close()


# --------------------------------------------------------------------------- tracing


class OtlpJsonReceiver:
    """Collects the spans Triton exports (OTLP/HTTP, JSON) on a loopback port."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                for rs in body.get("resourceSpans", []):
                    for ss in rs.get("scopeSpans", []):
                        receiver.spans.extend(ss.get("spans", []))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_trace_context_reaches_triton_through_the_proxy(loop, engine, processes, tmp_path) -> None:
    """With tracing on, the proxy's server span continues the client's trace and is the parent of
    Triton's own span (Triton exports its spans over OTLP); the histogram exemplar carries the trace."""
    receiver = OtlpJsonReceiver()
    server = SmallTriton(
        processes,
        tmp_path,
        0,
        "--trace-config=mode=opentelemetry",
        "--trace-config=rate=1",
        "--trace-config=level=TIMESTAMPS",
        f"--trace-config=opentelemetry,url=127.0.0.1:{receiver.port}/v1/traces",
        "--trace-config=opentelemetry,bsp_schedule_delay=100",
    ).start()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    p = InProcessProxy(loop, engine, server.grpc_url, tracer=provider.get_tracer("test"))
    try:
        p.serve_models({"ranker": ["1", "2"]})
        client = tgrpc.InferenceServerClient(p.url)
        assert client.is_server_live()
        # Triton does not join every incoming trace: right after start, and now and then later
        # (seen in a fresh-clone CI run, after a call that had joined), a call starts a new trace
        # in Triton although the header block it received was byte for byte the one of calls that
        # join (logged while investigating). So each try is a fresh trace; every try Triton joins
        # must have the proxy's span as the parent, and one must join: a proxy that dropped or
        # garbled the context would never get there.
        deadline = time.monotonic() + 90
        for attempt in itertools.count(1):
            trace_id = f"{attempt:08x}" + TRACEPARENT.split("-")[1][8:]
            traceparent = f"00-{trace_id}-{TRACEPARENT.split('-')[2]}-01"
            exporter.clear()
            client.infer(
                "ranker", infer_inputs("ranker"), model_version="1", headers={"traceparent": traceparent}
            )
            ours = wait_for(exporter.get_finished_spans, what="the proxy's span")[0]
            assert ours.name == "inference.GRPCInferenceService/ModelInfer"
            assert ours.kind.name == "SERVER"
            assert format(ours.context.trace_id, "032x") == trace_id
            assert format(ours.parent.span_id, "016x") == TRACEPARENT.split("-")[2]
            assert ours.attributes["rpc.system"] == "grpc"
            assert ours.attributes["rpc.method"] == "ModelInfer"
            assert ours.attributes["rpc.grpc.status_code"] == 0

            def triton_request_span(trace_id: str = trace_id) -> dict | None:
                return next(
                    (
                        s
                        for s in receiver.spans
                        if s.get("traceId") == trace_id and s["name"] == "InferRequest"
                    ),
                    None,
                )

            end = time.monotonic() + 3  # Triton exports every 100 ms
            while (theirs := triton_request_span()) is None and time.monotonic() < end:
                time.sleep(0.1)
            if theirs is not None:
                break
            assert time.monotonic() < deadline, f"Triton never joined a trace; spans: {receiver.spans}"
        # Both engines send the proxy's span context upstream: Triton's span is its child.
        assert theirs["parentSpanId"] == format(ours.context.span_id, "016x")

        text = generate_latest_openmetrics(p.registry).decode()
        assert f'trace_id="{trace_id}"' in text
    finally:
        p.close()
        server.stop()
        receiver.close()
        provider.shutdown()
