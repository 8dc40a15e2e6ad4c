"""The tokens bucket's refund: at an HTTP LLM request's end the bucket gets back what it was
charged (prompt estimate + n * max_tokens) and did not use (``sidecar.apis.charge.used``,
``Admission.refund``). The arithmetic and the bucket's cap on a fake clock; the answer observers'
real figures; then the ``inferwatch sidecar`` process in front of the real Triton's tiny_stream
(a stream that fails after 3 tokens costs its prompt estimate + 3, to the token) and in front of
nothing (a request that never reached a server costs nothing).
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import httpx
import pytest
import yaml

from inferwatch import contract
from reference_server import faults
from sidecar.apis.charge import prompt_estimate, used
from sidecar.apis.hooks import NoHooks, StreamEnd
from sidecar.apis.openai import OpenAIAnswer
from sidecar.apis.triton_generate import TritonGenerateAnswer
from sidecar.core.admission import SHED_QUEUE_FULL, SHED_TOKENS, Waiting
from tests.fixtures.sidecar import launch_sidecar
from tests.test_sidecar_overload_spec import admission

MODEL = "tiny_stream"
SHED = contract.REQUESTS_SHED.name


# --------------------------------------------------------------------------- what was used


@pytest.mark.parametrize(
    ("end", "expected"),
    [
        # usage: what the server says, whatever the estimate
        (StreamEnd(prompt_tokens=7, completion_tokens=20, usage_reported=True), 27),
        (StreamEnd(prompt_tokens=None, completion_tokens=20, usage_reported=True), 10 + 20),
        # no usage: the prompt estimate + the tokens counted from the events
        (StreamEnd(completion_tokens=3, counted_tokens=3), 10 + 3),
        (StreamEnd(completion_tokens=0, truncated=True), 10),
        # no answer body read (an error status, nothing came): no tokens delivered
        (None, 10),
        # unknown: a one-body answer without usage, or an answer that could not be read
        (StreamEnd(completion_tokens=None, streamed=False), 100),
        (StreamEnd(completion_tokens=3, counted_tokens=3, parse_error="an event that is not JSON"), 100),
    ],
)
def test_used_is_the_usage_else_the_prompt_estimate_plus_the_counted_tokens(
    end: StreamEnd | None, expected: int
) -> None:
    assert used(100, 10, end) == expected


def sse(*objs: dict | str) -> bytes:
    return b"".join(
        b"data: " + (o.encode() if isinstance(o, str) else json.dumps(o).encode()) + b"\n\n" for o in objs
    )


def test_used_from_the_observers_figures() -> None:
    # Triton's generate_stream: an error event after 3 tokens.
    triton = TritonGenerateAnswer(NoHooks(), streamed=True)
    token = {"model_name": MODEL, "model_version": "1", "text_output": "a "}
    triton.feed(sse(token, token, token, {"error": "injected"}), 1.0)
    assert used(300, 12, triton.finish(2.0)) == 12 + 3
    # Triton's generate (one body): nothing to count, the charge stays.
    whole = TritonGenerateAnswer(NoHooks(), streamed=False)
    whole.feed(json.dumps({"model_name": MODEL, "text_output": "a b a "}).encode(), 1.0)
    assert used(300, 12, whole.finish(2.0)) == 300
    # An OpenAI stream with usage (stream_options.include_usage).
    chunk = {"choices": [{"index": 0, "delta": {"content": "x"}}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}
    openai = OpenAIAnswer(NoHooks(), streamed=True)
    openai.feed(sse(chunk, chunk, usage, "[DONE]"), 1.0)
    assert used(300, 12, openai.finish(2.0)) == 9 + 2
    # Cut after two content events, no usage: estimate + 2.
    cut = OpenAIAnswer(NoHooks(), streamed=True)
    cut.feed(sse(chunk, chunk), 1.0)
    assert used(300, 12, cut.finish(2.0, complete=False)) == 12 + 2


def test_prompt_estimate_is_the_charges_prompt_part() -> None:
    assert [prompt_estimate(n) for n in (0, 1, 4, 5, 400)] == [0, 1, 1, 2, 100]


# --------------------------------------------------------------------------- the bucket


def reason(got: object) -> str | None:
    return getattr(got, "reason", None)


def test_refund_gives_back_the_unused_part_never_above_the_capacity() -> None:
    a, _ = admission({"tokens": {"capacity": 100, "fill_rate": 0.01}})  # the fake clock stands still
    assert a.acquire("m", tokens=100) is None
    assert reason(a.acquire("m", tokens=1)) == SHED_TOKENS
    a.refund("m", 100, 30)  # used 30 of 100: 70 back
    assert a.acquire("m", tokens=71) is not None
    assert a.acquire("m", tokens=70) is None and a.acquire("m", tokens=1) is not None
    a.refund("m", 100, 0)  # all of it back; then more than the bucket holds: capped
    a.refund("m", 100, 0)
    assert a.acquire("m", tokens=100) is None and a.acquire("m", tokens=1) is not None
    a.refund("m", 50, 80)  # used more than charged: nothing back, nothing taken
    assert a.acquire("m", tokens=1) is not None
    # A charge over the capacity took the capacity: the refund is from that, not from the cost.
    a.refund("m", 100, 0)
    assert a.acquire("m", tokens=5000) is None  # takes 100
    a.refund("m", 5000, 20)  # 80 back, not 4980 (capped to 100)
    assert a.acquire("m", tokens=81) is not None and a.acquire("m", tokens=80) is None
    # Nothing to refund to: no tokens bucket, no model, no limits at all.
    r, _ = admission({"requests": {"capacity": 1, "fill_rate": 0.01}})
    r.refund("m", 100, 0)
    r.refund(contract.MODEL_NONE, 100, 0)
    admission(None)[0].refund("m", 100, 0)


def test_a_request_shed_by_the_queue_gets_its_charge_back() -> None:
    """Tokens are taken before the concurrency check: a request then shed queue_full, timed out
    in the queue, or whose client left while it waited, never reached the server. (With the
    model's one slot taken, a probe of ``x`` tokens is shed ``tokens`` when the bucket holds
    less than x, else ``queue_full``: and with the refund, that probe cost nothing.)"""

    async def main() -> None:
        limits = {
            "tokens": {"capacity": 100, "fill_rate": 0.01},
            "concurrency": 1,
            "queue": 1,
            "queue_timeout_ms": 50,
        }
        a, _ = admission(limits)
        woken: list[object] = []
        assert a.acquire("m", 10) is None  # the one slot; 90 left
        waiting = a.acquire("m", 50, woken.append)  # queued, charged: 40 left
        assert isinstance(waiting, Waiting)
        assert reason(a.acquire("m", 41)) == SHED_TOKENS
        assert reason(a.acquire("m", 40)) == SHED_QUEUE_FULL  # charged, shed, given back
        assert reason(a.acquire("m", 40)) == SHED_QUEUE_FULL
        await asyncio.sleep(0.15)  # the waiter times out: its 50 come back
        assert len(woken) == 1 and reason(woken[0]) == "queue_timeout"
        assert reason(a.acquire("m", 91)) == SHED_TOKENS and reason(a.acquire("m", 90)) == SHED_QUEUE_FULL
        left = a.acquire("m", 50, woken.append)
        assert isinstance(left, Waiting)
        left.cancel()  # its client left: 50 back
        assert reason(a.acquire("m", 90)) == SHED_QUEUE_FULL
        # A waiter that gets its slot keeps its charge (refunded at its end, by its protocol).
        queued = a.acquire("m", 50, woken.append)
        assert isinstance(queued, Waiting)
        a.release("m")
        assert woken[-1] is None
        assert reason(a.acquire("m", 41)) == SHED_TOKENS and reason(a.acquire("m", 40)) == SHED_QUEUE_FULL
        a.refund("m", 50, 5)
        assert reason(a.acquire("m", 85)) == SHED_QUEUE_FULL

    asyncio.run(main())


# --------------------------------------------------------------------------- the sidecar process


def stream_body(max_tokens: int) -> bytes:
    return json.dumps({"text_input": "a b", "max_tokens": max_tokens}, separators=(",", ":")).encode()


def cost_of(body: bytes, max_tokens: int) -> int:
    return prompt_estimate(len(body)) + max_tokens


def body_costing(cost: int) -> tuple[bytes, int]:
    """A generate_stream body whose charge is exactly ``cost`` (max_tokens fills the rest)."""
    for m in range(cost, 0, -1):
        body = stream_body(m)
        if cost_of(body, m) == cost:
            return body, m
    raise AssertionError(cost)


def write_spec(tmp_path: Path, limits: dict, per_model: bool = True) -> Path:
    data: dict = {"models": [{"name": MODEL, "latency_sla_ms": 5000}]}
    if per_model:
        data["models"][0]["limits"] = limits
    else:
        data["defaults"] = {"limits": limits}
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.integration
def test_a_stream_that_fails_after_3_tokens_costs_its_prompt_estimate_plus_3(triton, tmp_path) -> None:
    """A bucket that holds exactly one request's charge (prompt estimate + max_tokens 64) and
    refills ~nothing. The first stream fails after 3 tokens: the bucket gets back 64 - 3, to the
    token, so a second request charged exactly that is admitted (without the refund: 429) and
    one charged a token more is shed."""
    first = stream_body(64)
    capacity = cost_of(first, 64)
    spec = write_spec(tmp_path, {"tokens": {"capacity": capacity, "fill_rate": 0.0001}})
    path = f"/v2/models/{MODEL}/versions/1/generate_stream"
    left = capacity - (prompt_estimate(len(first)) + 3)
    over, _ = body_costing(left + 1)
    exact, exact_m = body_costing(left)
    faults.clear(state_dir=triton.state_dir)
    try:
        faults.set_fault(MODEL, "1", error_after_tokens=3, state_dir=triton.state_dir)
        with launch_sidecar(triton.http_url, triton.grpc_url, tmp_path, "--spec", str(spec)) as sc:
            with httpx.Client(base_url=sc.base_url, timeout=60) as client:
                failed = client.post(path, content=first)
                faults.clear(state_dir=triton.state_dir)
                shed = client.post(path, content=over)
                admitted = client.post(path, content=exact)
                after = client.post(path, content=stream_body(1))  # the bucket is empty again
            counts = sc.counts(SHED, "model", "reason")
    finally:
        faults.clear(state_dir=triton.state_dir)

    assert failed.status_code == 200 and failed.text.count("text_output") == 3 and '"error"' in failed.text
    assert shed.status_code == 429 and shed.json()["reason"] == "tokens", shed.text
    assert admitted.status_code == 200, admitted.text
    assert admitted.text.count("text_output") == exact_m  # served whole
    # The second one used what it was charged (no usage from Triton: estimate + counted), so
    # nothing came back; even the smallest request is shed.
    assert after.status_code == 429
    assert counts.get((MODEL, "tokens")) == 2


@pytest.mark.integration
def test_a_request_that_never_reached_a_server_costs_nothing(tmp_path) -> None:
    """No upstream (the port refuses): each request is answered 503 and charged nothing in the
    end, so a bucket of one request's charge admits every one of them (without the refund, the
    second would be 429)."""
    body = stream_body(64)
    spec = write_spec(tmp_path, {"tokens": {"capacity": cost_of(body, 64), "fill_rate": 0.0001}}, False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
        with launch_sidecar(dead, dead, tmp_path, "--spec", str(spec), wait_ready=False) as sc:
            with httpx.Client(base_url=sc.base_url, timeout=60) as client:
                codes = [
                    client.post(f"/v2/models/{MODEL}/versions/1/generate_stream", content=body).status_code
                    for _ in range(3)
                ]
            log = sc.log()
    assert codes == [503, 503, 503], log
