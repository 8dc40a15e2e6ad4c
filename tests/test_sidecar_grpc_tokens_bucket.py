"""The fleet spec's ``tokens`` bucket on gRPC, in front of the real Triton, both engines.

A ``ModelInfer`` call, and a ``ModelStreamInfer`` stream's first message, is charged what
``sidecar.protocols.grpc_charge`` reads from its ``ModelInferRequest``: ceil(message bytes / 4)
+ max_tokens (an input tensor ``max_tokens``, else a request parameter ``max_tokens``, else
256). Each test sizes the bucket to exactly K requests' charge (computed here from the bytes
tritonclient sends): K are admitted, the next is shed (RESOURCE_EXHAUSTED, reason ``tokens``),
and Triton never runs it. A bucket that charged the default, or nothing, would admit another
number. ``fill_rate`` 0.01/s: nothing refills during the burst.

A stream gets back, at its end, what it was charged and not sent (its prompt estimate and the
tokens it was sent, every request, are what it used): the bursts keep their streams open until
the last is tried, and one test checks the refund to the token.
"""

from __future__ import annotations

import queue

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
from tritonclient.grpc import _utils as tutils
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from inferwatch import contract
from reference_server import faults
from reference_server.catalog import example_input
from sidecar.apis.charge import BYTES_PER_TOKEN, DEFAULT_MAX_TOKENS
from tests.fixtures.sidecar import launch_sidecar
from tests.test_sidecar_overload import triton_success_count, write_spec

pytestmark = pytest.mark.integration

STREAM_MODEL, UNARY_MODEL = "tiny_stream", "ranker"
REQUESTS = contract.REQUESTS_TOTAL.name
SHED = contract.REQUESTS_SHED.name
INFER = "/inference.GRPCInferenceService/ModelInfer"
ENGINES = ["relay", "aio"]
# A prompt over one HTTP/2 frame (16 KiB): the relay reads a max_tokens tensor behind it from a
# later frame, and decides there.
LONG = b"alpha beta " * 4000


def charge_of(message: pb.ModelInferRequest, generated: int) -> int:
    return -(-message.ByteSize() // BYTES_PER_TOKEN) + generated


def bucket(cost: int, k: int) -> dict:
    return {"tokens": {"capacity": k * cost, "fill_rate": 0.01}}


def counted(before: dict, after: dict, key: tuple[str, ...]) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def sidecar_with(triton, tmp_path, limits: dict, engine: str):
    """``inferwatch sidecar`` on ``engine`` in front of the real Triton, ``limits`` per model."""
    spec = write_spec(tmp_path, limits)
    return launch_sidecar(
        triton.http_url, triton.grpc_url, tmp_path, "--spec", str(spec), "--grpc-engine", engine
    )


# --------------------------------------------------------------------------- ModelStreamInfer


def stream_request(source: str, tokens: int, prompt: bytes) -> tuple[list, dict | None]:
    """tiny_stream's inputs and parameters with max_tokens as a tensor, a parameter, or not at all."""
    text = tgrpc.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt], dtype=np.object_))
    inputs = [text]
    if source == "tensor":
        n = tgrpc.InferInput("max_tokens", [1], "INT32")
        n.set_data_from_numpy(np.array([tokens], np.int32))
        inputs.append(n)
    return inputs, ({"max_tokens": tokens} if source == "parameter" else None)


def stream_message(inputs: list, parameters: dict | None) -> pb.ModelInferRequest:
    """The message tritonclient's ``async_stream_infer`` below writes (its own builder)."""
    msg = tutils._get_inference_request(
        STREAM_MODEL, inputs, "1", "", None, 0, False, False, 0, None, parameters
    )
    msg.parameters["triton_enable_empty_final_response"].bool_param = True
    return msg


class Stream:
    """One tritonclient stream (its own connection); ``answer`` reads one request's end."""

    def __init__(self, url: str) -> None:
        self.client = tgrpc.InferenceServerClient(url)
        self.got: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.got.put((result, error)))

    def send(self, inputs: list, parameters: dict | None) -> None:
        self.client.async_stream_infer(
            STREAM_MODEL, inputs, model_version="1", enable_empty_final_response=True, parameters=parameters
        )

    def answer(self) -> tuple[str, str]:
        """("OK", tokens received) or (status, error message)."""
        tokens = 0
        while True:
            result, error = self.got.get(timeout=60)
            if error is not None:
                return str(error.status()), error.message()
            if result.as_numpy("text_output") is None:
                return "OK", str(tokens)
            tokens += 1

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def one_stream(url: str, inputs: list, parameters: dict | None) -> tuple[str, str]:
    s = Stream(url)
    try:
        s.send(inputs, parameters)
        return s.answer()
    finally:
        s.close()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    ("source", "prompt", "generated"),
    [
        ("tensor", LONG, 5),  # behind a prompt longer than a frame
        ("parameter", b"alpha beta", 700),
        ("default", b"alpha beta", DEFAULT_MAX_TOKENS),
    ],
)
def test_a_streams_first_message_pays_its_charge(triton, tmp_path, engine, source, prompt, generated) -> None:
    k = 3
    inputs, parameters = stream_request(source, generated, prompt)
    cost = charge_of(stream_message(inputs, parameters), generated)
    limits = {STREAM_MODEL: bucket(cost, k)}
    with sidecar_with(triton, tmp_path, limits, engine) as sc:
        before = sc.counts(REQUESTS, "model", "protocol", "code")
        before_triton = triton_success_count(triton, STREAM_MODEL)
        streams, answers = [], []
        try:  # each stream stays open: the refund at its end would refill the bucket
            for _ in range(k + 1):
                streams.append(Stream(sc.grpc_url))
                streams[-1].send(inputs, parameters)
                answers.append(streams[-1].answer())
        finally:
            for stream in streams:
                stream.close()
        after = sc.counts(REQUESTS, "model", "protocol", "code")
        shed = sc.counts(SHED, "model", "reason")
        after_triton = triton_success_count(triton, STREAM_MODEL)

    codes = [code for code, _ in answers]
    assert codes == ["OK"] * k + ["StatusCode.RESOURCE_EXHAUSTED"], answers
    assert "tokens/s" in answers[-1][1]
    if source == "tensor":
        assert all(tokens == str(generated) for _, tokens in answers[:k])  # the model read it too
    assert shed.get((STREAM_MODEL, "tokens")) == 1
    assert counted(before, after, (STREAM_MODEL, "grpc", "OK")) == k
    assert counted(before, after, (STREAM_MODEL, "grpc", "RESOURCE_EXHAUSTED")) == 1
    assert after_triton - before_triton == k  # the shed stream never ran


@pytest.mark.parametrize("engine", ENGINES)
def test_later_messages_of_a_stream_are_not_charged(triton, tmp_path, engine) -> None:
    inputs, parameters = stream_request("tensor", 3, b"alpha beta")
    cost = charge_of(stream_message(inputs, parameters), 3)
    limits = {STREAM_MODEL: bucket(cost, 1)}
    with sidecar_with(triton, tmp_path, limits, engine) as sc:
        s = Stream(sc.grpc_url)
        try:
            answers = []
            for _ in range(3):  # one stream, three requests: the stream paid once
                s.send(inputs, parameters)
                answers.append(s.answer())
        finally:
            s.close()
        next_stream = one_stream(sc.grpc_url, inputs, parameters)
        shed = sc.counts(SHED, "model", "reason")

    assert answers == [("OK", "3")] * 3, answers
    assert next_stream[0] == "StatusCode.RESOURCE_EXHAUSTED", next_stream
    assert shed.get((STREAM_MODEL, "tokens")) == 1


@pytest.mark.parametrize("engine", ENGINES)
def test_a_stream_failed_after_3_tokens_costs_its_estimate_plus_3(triton, tmp_path, engine) -> None:
    """A bucket of exactly one stream's charge (prompt estimate + max_tokens 64) that refills
    ~nothing. That stream fails after 3 tokens: at its end the bucket gets back 64 - 3, to the
    token, so a stream charged exactly that is admitted (without the refund: shed) and one
    charged a token more is shed. max_tokens is an INT32 tensor: every message here is the same
    size, so the prompt estimate is one figure."""
    prompt = b"alpha beta"
    estimate = charge_of(stream_message(*stream_request("tensor", 64, prompt)), 0)
    capacity = estimate + 64
    left = capacity - (estimate + 3)
    limits = {STREAM_MODEL: {"tokens": {"capacity": capacity, "fill_rate": 0.0001}}}
    faults.clear(state_dir=triton.state_dir)
    try:
        faults.set_fault(STREAM_MODEL, "1", error_after_tokens=3, state_dir=triton.state_dir)
        with sidecar_with(triton, tmp_path, limits, engine) as sc:
            failed = one_stream(sc.grpc_url, *stream_request("tensor", 64, prompt))
            faults.clear(state_dir=triton.state_dir)
            over = one_stream(sc.grpc_url, *stream_request("tensor", left - estimate + 1, prompt))
            exact = one_stream(sc.grpc_url, *stream_request("tensor", left - estimate, prompt))
            shed = sc.counts(SHED, "model", "reason")
    finally:
        faults.clear(state_dir=triton.state_dir)

    assert failed[0] not in ("OK", "StatusCode.RESOURCE_EXHAUSTED"), failed  # Triton's in-stream error
    assert over[0] == "StatusCode.RESOURCE_EXHAUSTED" and "tokens/s" in over[1], over
    assert exact == ("OK", str(left - estimate)), exact  # admitted, served whole
    assert shed.get((STREAM_MODEL, "tokens")) == 1


# --------------------------------------------------------------------------- ModelInfer


def ranker_call(parameters: dict | None) -> tuple[list, pb.ModelInferRequest]:
    x = example_input(UNARY_MODEL, batch=1)["FEATURES"]
    inp = tgrpc.InferInput("FEATURES", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    msg = tutils._get_inference_request(
        UNARY_MODEL, [inp], "", "", None, 0, False, False, 0, None, parameters
    )
    return [inp], msg


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    ("parameters", "generated"),
    [
        # a padding parameter puts the message over one frame: the relay decides on a later one
        ({"max_tokens": 40, "note": "x" * 40000}, 40),
        ({"max_tokens": 40}, 40),
        (None, DEFAULT_MAX_TOKENS),
    ],
)
def test_model_infer_pays_its_charge(triton, tmp_path, engine, parameters, generated) -> None:
    k = 4
    inputs, msg = ranker_call(parameters)
    cost = charge_of(msg, generated)
    limits = {UNARY_MODEL: bucket(cost, k)}
    with sidecar_with(triton, tmp_path, limits, engine) as sc:
        before = sc.counts(REQUESTS, "model", "protocol", "code")
        before_triton = triton_success_count(triton, UNARY_MODEL)
        client = tgrpc.InferenceServerClient(sc.grpc_url)
        codes = []
        try:
            for _ in range(k + 1):
                try:
                    client.infer(UNARY_MODEL, inputs, parameters=parameters)
                    codes.append("OK")
                except InferenceServerException as exc:
                    codes.append(str(exc.status()))
                    message = exc.message()
            assert client.is_server_live()  # the connection carries on after a shed call
        finally:
            client.close()
        after = sc.counts(REQUESTS, "model", "protocol", "code")
        shed = sc.counts(SHED, "model", "reason")
        after_triton = triton_success_count(triton, UNARY_MODEL)

    assert codes == ["OK"] * k + ["StatusCode.RESOURCE_EXHAUSTED"], codes
    assert "tokens/s" in message
    assert shed.get((UNARY_MODEL, "tokens")) == 1
    assert counted(before, after, (UNARY_MODEL, "grpc", "OK")) == k
    assert counted(before, after, (UNARY_MODEL, "grpc", "RESOURCE_EXHAUSTED")) == 1
    assert after_triton - before_triton == k


@pytest.mark.parametrize("engine", ENGINES)
def test_a_malformed_message_is_charged_the_default(triton, tmp_path, engine) -> None:
    """A message that names its model and then is not protobuf: charged the prompt estimate and
    the default, sent to Triton (which refuses it), never a fault of the sidecar."""
    message = pb.ModelInferRequest(model_name=UNARY_MODEL).SerializeToString() + b"\x0b" + b"\x00" * 37
    cost = -(-len(message) // BYTES_PER_TOKEN) + DEFAULT_MAX_TOKENS
    limits = {UNARY_MODEL: bucket(cost, 1)}
    with sidecar_with(triton, tmp_path, limits, engine) as sc:
        with grpc.insecure_channel(sc.grpc_url) as channel:
            call = channel.unary_unary(INFER)  # no serializers: the bytes as they are
            codes = []
            for _ in range(2):
                try:
                    call(message, timeout=30)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    codes.append(exc.code())
            live = channel.unary_unary("/inference.GRPCInferenceService/ServerLive")(b"", timeout=30)
        shed = sc.counts(SHED, "model", "reason")
        log = sc.log()

    assert codes[0] not in (grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED), codes  # Triton's refusal
    assert codes[1] == grpc.StatusCode.RESOURCE_EXHAUSTED, codes
    assert shed.get((UNARY_MODEL, "tokens")) == 1
    assert pb.ServerLiveResponse.FromString(live).live
    assert "relay failure" not in log and "Traceback" not in log
