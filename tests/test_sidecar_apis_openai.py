"""The OpenAI-compatible answer observer, fed real vLLM answers (recorded by
tests/fixtures/llm_streams/record_vllm.py) and hand-made streams with known timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sidecar.apis.hooks import StreamEnd
from sidecar.apis.openai import OpenAIAnswer, is_event_stream
from sidecar.apis.sse import SSEParser

FIXTURES = Path(__file__).parent / "fixtures" / "llm_streams"


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


def raw(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def by_event(body: bytes) -> list[bytes]:
    """The stream cut after each event, as a proxy would see it when every event is one write."""
    return [part + b"\n\n" for part in body.split(b"\n\n") if part]


def run(chunks: list[bytes], streamed: bool = True, complete: bool = True) -> tuple[StreamEnd, Recorder]:
    """Feed chunk i at t = i seconds; finish at t = len(chunks)."""
    hooks = Recorder()
    answer = OpenAIAnswer(hooks, streamed)
    for i, chunk in enumerate(chunks):
        answer.feed(chunk, float(i))
    end = answer.finish(float(len(chunks)), complete=complete)
    assert hooks.calls[-1] == ("end", end) and [c[0] for c in hooks.calls].count("end") == 1
    return end, hooks


def test_content_type() -> None:
    assert is_event_stream("text/event-stream; charset=utf-8")
    assert is_event_stream("Text/Event-Stream")
    assert not is_event_stream("application/json")


def test_chat_stream_first_token_is_the_first_content_event_not_the_role_event() -> None:
    chunks = by_event(raw("vllm_chat_stream_usage.sse"))
    first = json.loads(chunks[0][6:])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    end, hooks = run(chunks)
    assert hooks.calls[0] == ("first", 1.0, 1)  # event 1, not event 0
    tokens = [c for c in hooks.calls if c[0] == "token"]
    assert [c[1:] for c in tokens] == [(float(i), 1, 1.0) for i in range(2, 13)]
    assert (end.prompt_tokens, end.completion_tokens, end.usage_reported) == (12, 12, True)
    assert end.counted_tokens == 12 and end.content_events == 12
    assert end.finish_reasons == ("length",)
    assert (end.error, end.truncated, end.parse_error) == (None, False, None)
    assert (end.first_token_t, end.last_token_t, end.tpot) == (1.0, 12.0, 1.0)


def test_a_stream_without_usage_counts_its_tokens_from_the_events() -> None:
    end, _ = run(by_event(raw("vllm_chat_stream.sse")))
    assert (end.prompt_tokens, end.completion_tokens, end.usage_reported) == (None, 12, False)
    end, _ = run(by_event(raw("vllm_completions_stream.sse")))
    assert (end.prompt_tokens, end.completion_tokens, end.usage_reported) == (None, 10, False)
    assert end.finish_reasons == ("length",) and not end.truncated


@pytest.mark.parametrize(
    ("name", "counted", "usage"),
    [
        # vLLM sends one event per token; an empty "content" (a token ending inside a UTF-8
        # character) is a token without content. Recorded here:
        ("vllm_chat_stream_usage", 12, 12),
        ("vllm_chat_stream_usage_128", 128, 128),
        ("vllm_chat_stream_n2_usage", 12, 12),
        ("vllm_chat_stream_stop", 1, 1),
        ("vllm_chat_stream_continuous_usage", 5, 5),
        ("vllm_completions_stream_usage", 8, 8),
        ("vllm_completions_stream_n2_usage", 10, 10),
        # ... except this one: 104 events for 128 tokens (vLLM put several tokens in some events).
        ("vllm_completions_stream_usage_128", 104, 128),
    ],
)
def test_counted_tokens_against_usage(name: str, counted: int, usage: int) -> None:
    end, _ = run(by_event(raw(name + ".sse")))
    assert (end.counted_tokens, end.completion_tokens, end.usage_reported) == (counted, usage, True)


def test_two_choices_finish_twice_and_count_both() -> None:
    end, hooks = run(by_event(raw("vllm_chat_stream_n2_usage.sse")))
    assert end.finish_reasons == ("length", "length")
    assert sum(c[2] for c in hooks.calls if c[0] in ("first", "token")) == 12


def test_continuous_usage_the_last_one_wins() -> None:
    end, _ = run(by_event(raw("vllm_chat_stream_continuous_usage.sse")))
    assert (end.prompt_tokens, end.completion_tokens) == (12, 5)
    assert end.content_events == 4  # one of the five tokens ended inside a character


def test_an_error_event_inside_a_200_stream_after_the_engine_died() -> None:
    end, hooks = run(by_event(raw("vllm_chat_stream_engine_killed.sse")))
    assert end.error == "EngineCore encountered an issue. See stack trace (above) for the root cause."
    assert end.error_code == 500
    assert not end.truncated  # vLLM still sent [DONE]
    assert end.finish_reasons == () and end.completion_tokens == 5 and not end.usage_reported
    assert [c[0] for c in hooks.calls][:1] == ["first"]


def test_the_older_error_shape_and_a_bare_message() -> None:
    body = b'data: {"object":"error","message":"boom","type":"InternalServerError","code":500}\n\n'
    end, _ = run([body])
    assert (end.error, end.error_code, end.truncated) == ("boom", 500, True)
    end, _ = run([b'data: {"error":"bad thing","code":"503"}\n\ndata: [DONE]\n\n'])
    assert (end.error, end.error_code, end.truncated) == ("bad thing", 503, False)


def test_a_stream_cut_anywhere_before_done_is_truncated_with_the_tokens_so_far() -> None:
    body = raw("vllm_chat_stream_usage.sse")
    done_at = body.index(b"data: [DONE]") + len(b"data: [DONE]\n\n")
    whole = SSEParser().feed(body)
    for cut in range(0, len(body) + 1, 5):
        end, _ = run([body[:cut]])
        sent = [json.loads(e.data) for e in SSEParser().feed(body[:cut]) if e.data != b"[DONE]"]
        content = sum(1 for e in sent if e["choices"] and e["choices"][0]["delta"].get("content"))
        assert end.truncated == (cut < done_at), cut
        assert end.counted_tokens == content, cut
        if cut < len(body) - 200:  # the usage event has not arrived
            assert (end.usage_reported, end.completion_tokens) == (False, content)
    assert len(whole) == 15
    # The caller's word counts too: a body cut after [DONE] by a dying connection is still cut.
    assert run([body], complete=False)[0].truncated


def test_the_same_figures_whatever_the_split() -> None:
    body = raw("vllm_completions_stream_usage.sse")
    want, _ = run([body])
    for cut in range(len(body) + 1):
        end, _ = run([body[:cut], body[cut:]])
        assert (end.counted_tokens, end.completion_tokens, end.finish_reasons, end.content_events) == (
            want.counted_tokens,
            want.completion_tokens,
            want.finish_reasons,
            want.content_events,
        )
    end, _ = run([body[i : i + 1] for i in range(len(body))])
    assert end.content_events == want.content_events == 7


def test_tpot_and_gaps_from_the_callers_clock() -> None:
    def ev(content: str) -> bytes:
        return (
            b"data: "
            + json.dumps({"choices": [{"index": 0, "delta": {"content": content}}]}).encode()
            + b"\n\n"
        )

    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    hooks = Recorder()
    answer = OpenAIAnswer(hooks, streamed=True)
    for t, chunk in [(0.05, role), (0.1, ev("a")), (0.15, ev("b")), (0.3, ev("c") + b"data: [DONE]\n\n")]:
        answer.feed(chunk, t)
    end = answer.finish(0.31)
    assert hooks.calls[0] == ("first", 0.1, 1)
    gaps = [c[3] for c in hooks.calls if c[0] == "token"]
    assert gaps == pytest.approx([0.05, 0.15])
    assert end.tpot == pytest.approx((0.3 - 0.1) / 2)
    # With usage, TPOT divides by its token count (an event may carry several tokens).
    hooks = Recorder()
    answer = OpenAIAnswer(hooks, streamed=True)
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5}}\n\ndata: [DONE]\n\n'
    for t, chunk in [(0.1, ev("a")), (0.3, ev("bcde") + usage)]:
        answer.feed(chunk, t)
    assert answer.finish(0.4).tpot == pytest.approx(0.2 / 4)
    # One token: no TPOT.
    answer = OpenAIAnswer(Recorder(), streamed=True)
    answer.feed(ev("a") + b"data: [DONE]\n\n", 0.1)
    assert answer.finish(0.2).tpot is None


def test_logprobs_and_token_ids_give_the_exact_count_per_event() -> None:
    chat = {"choices": [{"delta": {"content": "ab"}, "logprobs": {"content": [{}, {}]}}]}
    comp = {"choices": [{"text": "abc", "logprobs": {"tokens": ["a", "b", "c"]}}]}
    ids = {"choices": [{"text": "abcd", "token_ids": [1, 2, 3, 4]}]}
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in (chat, comp, ids))
    end, hooks = run([body + b"data: [DONE]\n\n"])
    assert end.completion_tokens == 9
    assert [c[2] for c in hooks.calls[:3]] == [2, 3, 4]


def test_empty_deltas_and_reasoning() -> None:
    events = [
        {"choices": [{"delta": {"role": "assistant"}}]},
        {"choices": [{"delta": {"reasoning_content": "hmm"}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}}]},
        {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]},  # OpenAI's own last event
    ]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    end, _ = run(by_event(body))
    assert (end.counted_tokens, end.content_events, end.first_token_t) == (2, 2, 1.0)
    assert end.finish_reasons == ("tool_calls",)


@pytest.mark.parametrize(
    ("name", "prompt", "completion", "reasons"),
    [("vllm_chat.json", 12, 12, ("length",)), ("vllm_completions.json", 3, 10, ("length",))],
)
def test_non_streamed_answers_have_usage_and_no_token_timing(name, prompt, completion, reasons) -> None:
    body = raw(name)
    end, hooks = run([body[:100], body[100:]], streamed=False)
    assert [c[0] for c in hooks.calls] == ["end"]
    assert (end.prompt_tokens, end.completion_tokens, end.finish_reasons) == (prompt, completion, reasons)
    assert (end.streamed, end.truncated, end.error, end.tpot) == (False, False, None, None)


def test_non_streamed_error_bodies() -> None:
    end, _ = run([raw("vllm_unknown_model.json")], streamed=False)
    assert end.error_code == 404 and "does not exist" in end.error
    end, _ = run([raw("vllm_chat_stream_too_long.json")], streamed=False)
    assert end.error_code == 400 and end.error.startswith("max_tokens=100000")


def test_what_cannot_be_read_is_a_parse_error_not_a_crash() -> None:
    assert run([b"data: {not json\n\ndata: [DONE]\n\n"])[0].parse_error == "an event that is not JSON"
    assert run([b"data: [1]\n\n"])[0].parse_error == "an event that is not a JSON object"
    assert run([b"<html>oops"], streamed=False)[0].parse_error == "an answer that is not JSON"
    deep = b"[" * 100_000 + b"]" * 100_000  # json.loads raises RecursionError, not ValueError
    assert run([b"data: " + deep + b"\n\n"])[0].parse_error == "an event that is not JSON"
    assert run([deep], streamed=False)[0].parse_error == "an answer that is not JSON"
    hooks = Recorder()
    answer = OpenAIAnswer(hooks, streamed=False, max_body=10)
    answer.feed(b"{" + b" " * 20 + b"}", 0.0)
    assert answer.finish(1.0).parse_error == "answer longer than 10 bytes"
    answer = OpenAIAnswer(Recorder(), streamed=True, sse=SSEParser(max_line=64))
    answer.feed(b"data: " + b"x" * 100 + b"\n\n" + raw("vllm_chat_stream_stop.sse"), 0.0)
    end = answer.finish(1.0)
    assert end.parse_error == "line longer than 64 bytes"
    # Every later event is longer than 64 bytes too: only [DONE] got through.
    assert (end.completion_tokens, end.events, end.truncated) == (0, 1, False)


def test_finish_twice_calls_on_end_once() -> None:
    hooks = Recorder()
    answer = OpenAIAnswer(hooks, streamed=True)
    answer.feed(raw("vllm_chat_stream_stop.sse"), 0.0)
    assert answer.finish(1.0) is answer.finish(2.0, complete=False)
    assert [c[0] for c in hooks.calls].count("end") == 1


def test_an_embeddings_answer_gives_its_prompt_tokens() -> None:
    body = {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": [0.1] * 64}],
        "model": "tiny-llm",
        "usage": {"prompt_tokens": 7, "total_tokens": 7},
    }
    end, hooks = run([json.dumps(body).encode()], streamed=False)
    assert (end.prompt_tokens, end.completion_tokens, end.error) == (7, None, None)
    assert [c[0] for c in hooks.calls] == ["end"]


def test_the_package_exports_the_interface() -> None:
    import sidecar.apis as apis

    assert {"Hooks", "StreamEnd", "BodyScanner", "OpenAIAnswer", "TritonGenerateAnswer", "SSEParser"} <= set(
        apis.__all__
    )
