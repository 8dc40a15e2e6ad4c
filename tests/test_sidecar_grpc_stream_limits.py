"""Per-model limits on ``ModelStreamInfer`` (bidirectional streaming), in front of the real Triton.

A stream's header block does not name its model; its first request message does. The sidecar
admits the stream there, under that model, so the fleet spec's limits apply to streams as to
unary calls: a refused stream gets RESOURCE_EXHAUSTED, is counted once as its first request (in
``inferwatch_requests_total`` and ``inferwatch_requests_shed_total``), and Triton never runs it;
an admitted stream holds its slot until it ends. Both gRPC engines, in the ``inferwatch
sidecar`` process, with the token-streaming model ``tiny_stream`` (version 1: 20 ms to the first
token, then 10 ms per token).
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import tritonclient.grpc as tgrpc

from inferwatch import contract
from tests.fixtures.sidecar import launch_sidecar
from tests.test_sidecar_overload import triton_success_count, write_spec

pytestmark = pytest.mark.integration

MODEL = "tiny_stream"
REQUESTS = contract.REQUESTS_TOTAL.name
SHED = contract.REQUESTS_SHED.name
EXHAUSTED = "StatusCode.RESOURCE_EXHAUSTED"


class Stream:
    """One tritonclient ``ModelStreamInfer`` stream (its own connection) and what it received."""

    def __init__(self, url: str) -> None:
        self.client = tgrpc.InferenceServerClient(url)
        self.got: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.got.put((result, error)))

    def send(self, tokens: int) -> None:
        text = tgrpc.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"alpha beta"], dtype=np.object_))
        n = tgrpc.InferInput("max_tokens", [1], "INT32")
        n.set_data_from_numpy(np.array([tokens], np.int32))
        self.client.async_stream_infer(MODEL, [text, n], model_version="1", enable_empty_final_response=True)

    def next(self) -> tuple[str, str | None]:
        """The next response: ("token", text), ("final", None), or (status, error message)."""
        result, error = self.got.get(timeout=30)
        if error is not None:
            return str(error.status()), error.message()
        out = result.as_numpy("text_output")
        return ("final", None) if out is None else ("token", out[0].decode())

    def answer(self) -> tuple[str, str]:
        """Read to the request's end: ("OK", its text) or (status, error message)."""
        texts = []
        while True:
            kind, value = self.next()
            if kind == "token":
                texts.append(value)
            elif kind == "final":
                return "OK", "".join(texts)
            else:
                return kind, value or ""

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def one_stream(url: str, tokens: int = 3) -> tuple[str, str]:
    s = Stream(url)
    try:
        s.send(tokens)
        return s.answer()
    finally:
        s.close()


@contextmanager
def held_stream(url: str) -> Iterator[Stream]:
    """A stream whose first token arrived and whose end is far away (4096 tokens); cancelled at exit."""
    s = Stream(url)
    try:
        s.send(4096)
        assert s.next()[0] == "token"
        yield s
    finally:
        s.close(cancel=True)


@pytest.mark.parametrize("engine", ["relay", "aio"])
def test_streams_over_the_bucket_are_refused_on_their_first_message(triton, tmp_path, engine) -> None:
    # fill_rate 0.01/s: not one token comes back during the burst, so the split is exact.
    capacity, burst = 2, 5
    spec = write_spec(tmp_path, {MODEL: {"requests": {"capacity": capacity, "fill_rate": 0.01}}})
    with launch_sidecar(
        triton.http_url, triton.grpc_url, tmp_path, "--spec", str(spec), "--grpc-engine", engine
    ) as sc:
        before = sc.counts(REQUESTS, "model", "protocol", "code")
        before_triton = triton_success_count(triton, MODEL)
        answers = [one_stream(sc.grpc_url) for _ in range(burst - 1)]
        # The last one on a connection that carries on: a refused stream harms nothing else on it.
        s = Stream(sc.grpc_url)
        try:
            s.send(3)
            answers.append(s.answer())
            assert s.client.is_server_live()  # no model: not limited
        finally:
            s.close()
        after = sc.counts(REQUESTS, "model", "protocol", "code")
        shed = sc.counts(SHED, "model", "reason")
        after_triton = triton_success_count(triton, MODEL)

    codes = [code for code, _ in answers]
    assert codes == ["OK"] * capacity + [EXHAUSTED] * (burst - capacity), answers
    assert all(text == "alpha beta alpha " for _, text in answers[:capacity])
    assert all("requests/s" in message for _, message in answers[capacity:])
    assert shed.get((MODEL, "requests")) == burst - capacity

    def counted(code: str) -> float:
        return after.get((MODEL, "grpc", code), 0.0) - before.get((MODEL, "grpc", code), 0.0)

    assert counted("RESOURCE_EXHAUSTED") == burst - capacity
    assert counted("OK") == capacity
    assert after_triton - before_triton == capacity  # the refused streams never ran


@pytest.mark.parametrize("engine", ["relay", "aio"])
def test_a_stream_holds_its_models_slot_until_it_ends(triton, tmp_path, engine) -> None:
    spec = write_spec(tmp_path, {MODEL: {"concurrency": 1}})
    with launch_sidecar(
        triton.http_url, triton.grpc_url, tmp_path, "--spec", str(spec), "--grpc-engine", engine
    ) as sc:
        with held_stream(sc.grpc_url):
            full = one_stream(sc.grpc_url)
        after_release = one_stream(sc.grpc_url)  # the held stream ended: its slot is free
        shed = sc.counts(SHED, "model", "reason")

    assert full[0] == EXHAUSTED and "in flight and the queue is full" in full[1], full
    assert after_release == ("OK", "alpha beta alpha "), after_release
    assert shed.get((MODEL, "queue_full")) == 1
