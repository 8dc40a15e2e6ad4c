"""Triton's generate / generate_stream observer: unit tests on Triton 2.51's exact framing, then
the same observer fed the live bytes of the real Triton's tiny_stream model (its pace, an error
after N tokens, an error before any token, the non-streamed answer)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from reference_server import faults
from sidecar.apis.hooks import StreamEnd
from sidecar.apis.triton_generate import TritonGenerateAnswer

MODEL = "tiny_stream"


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_model(self, model: str, version: str) -> None:
        self.calls.append(("model", model, version))

    def on_first_token(self, t: float, n: int) -> None:
        self.calls.append(("first", t, n))

    def on_token(self, t: float, n: int, gap: float) -> None:
        self.calls.append(("token", t, n, gap))

    def on_end(self, end: StreamEnd) -> None:
        self.calls.append(("end", end))


def event(obj: dict) -> bytes:
    # Triton 2.51 writes compact JSON, LF line ends, one blank line after each event.
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def token(text: str, version: str = "1") -> bytes:
    return event({"model_name": MODEL, "model_version": version, "text_output": text})


def run(chunks: list[bytes], streamed: bool = True, complete: bool = True) -> tuple[StreamEnd, Recorder]:
    hooks = Recorder()
    answer = TritonGenerateAnswer(hooks, streamed)
    for i, chunk in enumerate(chunks):
        answer.feed(chunk, float(i))
    end = answer.finish(float(len(chunks)), complete=complete)
    assert [c[0] for c in hooks.calls].count("end") == 1 and hooks.calls[-1] == ("end", end)
    return end, hooks


def test_one_token_per_event_model_version_once_and_gaps() -> None:
    end, hooks = run([token("a ", "2"), token("b ", "2"), token("c ", "2")])
    assert hooks.calls[:4] == [
        ("model", MODEL, "2"),
        ("first", 0.0, 1),
        ("token", 1.0, 1, 1.0),
        ("token", 2.0, 1, 1.0),
    ]
    assert (end.completion_tokens, end.prompt_tokens, end.usage_reported) == (3, None, False)
    assert (end.tpot, end.truncated, end.error, end.finish_reasons) == (1.0, False, None, ())


def test_the_same_figures_at_every_split() -> None:
    body = token("one ") + token("") + token("two ") + event({"error": "injected fault: boom"})
    want, _ = run([body])
    assert (want.completion_tokens, want.events, want.error) == (2, 4, "injected fault: boom")
    for cut in range(len(body) + 1):
        end, hooks = run([body[:cut], body[cut:]])
        assert (end.completion_tokens, end.events, end.error) == (2, 4, "injected fault: boom"), cut
        assert hooks.calls[0] == ("model", MODEL, "1")


def test_an_error_event_after_tokens_and_a_cut_stream() -> None:
    end, _ = run([token("a "), token("b "), event({"error": "injected fault: tiny_stream version 1"})])
    assert (end.error, end.error_code, end.completion_tokens, end.truncated) == (
        "injected fault: tiny_stream version 1",
        None,
        2,
        False,
    )
    # No end marker in this protocol: whether the body ended cleanly is the caller's word.
    end, _ = run([token("a "), token("b")[:20]], complete=False)
    assert (end.completion_tokens, end.truncated, end.error) == (1, True, None)


def test_the_documented_mid_stream_error_exactly() -> None:
    # reference_server/README.md, "What a mid-stream error looks like": the bytes of the body.
    body = (
        b'data: {"model_name":"tiny_stream","model_version":"2","text_output":"a "}\n\n'
        b'data: {"model_name":"tiny_stream","model_version":"2","text_output":"b "}\n\n'
        b'data: {"error":"injected fault: tiny_stream version 2 (error after 2 tokens)"}\n\n'
    )
    for cut in range(len(body) + 1):
        end, hooks = run([body[:cut], body[cut:]])
        assert (end.completion_tokens, end.error, end.truncated) == (
            2,
            "injected fault: tiny_stream version 2 (error after 2 tokens)",
            False,
        )
        assert hooks.calls[0] == ("model", MODEL, "2")
    # Triton's own refusals of a generate body: 500 and 200 with an error body.
    for raw in (
        b'{"error":"Unable to parse \'data\': ..."}',
        b'{"error":"generate expects model to produce exactly 1 response, use generate stream"}',
    ):
        assert run([raw], streamed=False)[0].error.startswith(json.loads(raw)["error"][:10])


def test_non_streamed_generate() -> None:
    end, hooks = run(
        [b'{"model_name":"tiny_stream",', b'"model_version":"2","text_output":"a b a "}'], streamed=False
    )
    assert hooks.calls[0] == ("model", MODEL, "2")
    assert (end.completion_tokens, end.streamed, end.error) == (None, False, None)
    assert [c[0] for c in hooks.calls] == ["model", "end"]
    end, _ = run([b'{"error":"injected fault: tiny_stream version 2"}'], streamed=False)
    assert end.error == "injected fault: tiny_stream version 2"
    assert run([b"not json"], streamed=False)[0].parse_error == "an answer that is not a JSON object"
    deep = b"[" * 100_000 + b"]" * 100_000
    assert run([b"data: " + deep + b"\n\n"])[0].parse_error == "an answer that is not a JSON object"


@pytest.fixture
def clean_faults(triton) -> Iterator[Path]:
    faults.clear(state_dir=triton.state_dir)
    try:
        yield triton.state_dir
    finally:
        faults.clear(state_dir=triton.state_dir)


def live(triton, endpoint: str, body: dict, version: str = "1") -> tuple[int, StreamEnd, Recorder, bytes]:
    """POST to the real Triton and feed the observer each chunk as it arrives, timed."""
    hooks = Recorder()
    with httpx.stream(
        "POST",
        f"http://{triton.http_url}/v2/models/{MODEL}/versions/{version}/{endpoint}",
        json=body,
        timeout=60,
    ) as resp:
        answer = TritonGenerateAnswer(
            hooks, streamed=resp.headers["content-type"].startswith("text/event-stream")
        )
        raw = b""
        for chunk in resp.iter_raw():
            raw += chunk
            answer.feed(chunk, time.monotonic())
    return resp.status_code, answer.finish(time.monotonic()), hooks, raw


@pytest.mark.integration
def test_live_generate_stream(triton, clean_faults: Path) -> None:
    status, end, hooks, raw = live(triton, "generate_stream", {"text_input": "alpha beta", "max_tokens": 6})
    assert status == 200
    assert hooks.calls[0] == ("model", MODEL, "1")
    assert (end.completion_tokens, end.content_events, end.error, end.truncated) == (6, 6, None, False)
    gaps = [c[3] for c in hooks.calls if c[0] == "token"]
    assert len(gaps) == 5 and all(g > 0 for g in gaps)
    assert end.tpot == pytest.approx(sum(gaps) / 5)
    # The recorded bytes, split anywhere, give the same count.
    for cut in range(0, len(raw) + 1, 3):
        answer = TritonGenerateAnswer(Recorder(), streamed=True)
        answer.feed(raw[:cut], 0.0)
        answer.feed(raw[cut:], 1.0)
        assert answer.finish(2.0).completion_tokens == 6


@pytest.mark.integration
def test_live_error_after_n_tokens_and_before_any(triton, clean_faults: Path) -> None:
    faults.set_fault(MODEL, "1", error_after_tokens=3, state_dir=clean_faults)
    status, end, _, _ = live(triton, "generate_stream", {"text_input": "x", "max_tokens": 8})
    assert status == 200  # the status went out with the first token: only the event tells
    assert end.completion_tokens == 3
    assert end.error == f"{faults.INJECTED} {MODEL} version 1 (error after 3 tokens)"
    faults.set_fault(MODEL, "1", error_after_tokens=0, state_dir=clean_faults)
    status, end, hooks, _ = live(triton, "generate_stream", {"text_input": "x", "max_tokens": 8})
    assert status == 400 and end.error.startswith(faults.INJECTED)
    assert end.completion_tokens == 0 and [c[0] for c in hooks.calls] == ["end"]


@pytest.mark.integration
def test_live_generate_not_streamed(triton, clean_faults: Path) -> None:
    body = {"text_input": "a b", "max_tokens": 3, "stream": False}
    status, end, hooks, _ = live(triton, "generate", body, version="2")
    assert status == 200 and hooks.calls[0] == ("model", MODEL, "2")
    assert (end.streamed, end.error, end.completion_tokens) == (False, None, None)
