"""Cost of the sidecar's generative-API parsing (``sidecar/apis/``), on one core, no network.

1. The streaming body scanner (``json_scan.py``): MB/s over a 1 MB OpenAI request body whose
   ``model`` comes last (the worst place: every byte is scanned), for bodies of different shapes,
   fed in 64 KiB chunks as a proxy would; ``json.loads`` of the whole body beside it for scale.
2. The answer observers (SSE parser + ``openai.py`` / ``triton_generate.py``): microseconds per
   streamed event, over a recorded 128-token vLLM stream fed one event per chunk (as vLLM writes
   them), to hold against nginx's 27 us of CPU per streamed token (nginx 1.22 in front of vLLM here,
   measured when the LLM work began).

    .venv/bin/python benchmarks/json_scan.py [--repeat 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sidecar.apis.hooks import NoHooks
from sidecar.apis.json_scan import OPENAI_FIELDS, BodyScanner, Outcome
from sidecar.apis.openai import OpenAIAnswer
from sidecar.apis.triton_generate import TritonGenerateAnswer

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "llm_streams"

MB = 1_000_000
CHUNK = 65536


def _body(messages: list[dict], ensure_ascii: bool = False) -> bytes:
    return json.dumps(
        {"messages": messages, "max_tokens": 128, "stream": True, "model": "tiny-llm"},
        ensure_ascii=ensure_ascii,
    ).encode()


def bodies() -> dict[str, bytes]:
    text = 'The quick brown fox jumps over the lazy dog, then asks: "why?"\n'
    long = text * (MB // len(text))
    short = [{"role": "user" if i % 2 else "assistant", "content": "ok, next"} for i in range(MB // 45)]
    return {
        "one long message (ASCII, a few escapes per line)": _body([{"role": "user", "content": long}]),
        f"{len(short)} short messages": _body(short),
        "non-ASCII text as raw UTF-8": _body([{"role": "user", "content": "Привет, мир! " * (MB // 23)}]),
        "non-ASCII text as \\u escapes": _body(
            [{"role": "user", "content": "Привет, мир! " * (MB // 62)}], ensure_ascii=True
        ),
        "token ids (completions prompt)": json.dumps(
            {"prompt": list(range(1000, 1000 + MB // 6)), "model": "tiny-llm"}
        ).encode(),
    }


def best_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def scan(raw: bytes) -> None:
    s = BodyScanner(fields=OPENAI_FIELDS)
    for i in range(0, len(raw), CHUNK):
        s.feed(raw[i : i + CHUNK])
    assert s.finish() is Outcome.FOUND and s.value == "tiny-llm"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    print("| body (model last) | size | scanner MB/s (best / median) | json.loads MB/s (best) |")
    print("| --- | --- | --- | --- |")
    for name, raw in bodies().items():
        best, median = best_seconds(lambda raw=raw: scan(raw), args.repeat)
        loads, _ = best_seconds(lambda raw=raw: json.loads(raw), args.repeat)
        size = len(raw) / MB
        print(f"| {name} | {size:.2f} MB | {size / best:.0f} / {size / median:.0f} | {size / loads:.0f} |")
    print()
    print("| answer | events | observer us per event (best / median) |")
    print("| --- | --- | --- |")
    for name, answer, chunks in streams():
        best, median = best_seconds(lambda a=answer, c=chunks: observe(a, c), args.repeat)
        print(
            f"| {name} | {len(chunks)} | {best / len(chunks) * 1e6:.1f} / {median / len(chunks) * 1e6:.1f} |"
        )


def streams():
    vllm = [
        p + b"\n\n" for p in (FIXTURES / "vllm_chat_stream_usage_128.sse").read_bytes().split(b"\n\n") if p
    ]
    triton = [
        b'data: {"model_name":"tiny_stream","model_version":"1","text_output":"word "}\n\n'
        for _ in range(128)
    ]
    return [
        ("vLLM chat, 128 tokens with usage (OpenAIAnswer)", OpenAIAnswer, vllm),
        ("Triton generate_stream, 128 tokens (TritonGenerateAnswer)", TritonGenerateAnswer, triton),
    ]


def observe(cls, chunks: list[bytes]) -> None:
    answer = cls(NoHooks(), streamed=True)
    for i, chunk in enumerate(chunks):
        answer.feed(chunk, float(i))
    assert answer.finish(float(len(chunks))).completion_tokens == 128


if __name__ == "__main__":
    main()
