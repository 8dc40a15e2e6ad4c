"""`inferwatch load` for token streams: --protocol openai against the real vLLM (one start for the
whole module, 35 to 90 s, about 3 GB) and --protocol triton-generate against the real Triton's
tiny_stream; the client-side token counts are checked against each server's own counters.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from inferwatch import cli, contract
from reference_server import catalog, faults, triton_metrics
from reference_server.defaults import VLLM_PORT
from reference_server.llm.vllm_server import DEFAULT_PORT
from reference_server.loadgen import LoadConfig, LoadError, Summary, Target, run_load
from reference_server.stream_load import Lengths, StreamLoadGenerator
from tests.fixtures.net import VENV_BIN, free_port, inferwatch_cmd, wait_http

pytestmark = pytest.mark.integration

STREAM = catalog.STREAM_MODELS["tiny_stream"]


def vllm_counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real vLLM on the tiny model: HOST:PORT."""
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    proc = subprocess.Popen(
        [str(VENV_BIN / "inferwatch"), "vllm", "--port", str(port), "--log-file", str(log)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", timeout=300, proc=proc)
        yield f"127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def clean_faults(triton) -> Iterator[Path]:
    faults.clear(state_dir=triton.state_dir)
    try:
        yield triton.state_dir
    finally:
        faults.clear(state_dir=triton.state_dir)


def counters(url: str) -> tuple[float, float, float]:
    base = f"http://{url}"
    return (
        vllm_counter(base, "vllm:prompt_tokens_total"),
        vllm_counter(base, "vllm:generation_tokens_total"),
        vllm_counter(base, "vllm:request_success_total"),
    )


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_openai_streams_report_ttft_tpot_and_the_tokens_vllm_counted(vllm: str, endpoint: str) -> None:
    before = counters(vllm)
    s = run_load(
        LoadConfig(
            url=vllm,
            protocol="openai",
            rate=3,
            duration=4,
            targets=[Target.parse("tiny-llm", "openai")],
            endpoint=endpoint,
            prompt_tokens="8-24",
            output_tokens="16",
            ignore_eos=True,
            timeout=60,
            seed=1,
        )
    )
    after = counters(vllm)
    assert s.sent == s.ok > 0 and not s.errors, s
    # Every token the client counted is one vLLM counted, request by request.
    assert s.generation_tokens == after[1] - before[1] == 16 * s.ok
    assert s.prompt_tokens == after[0] - before[0] > 0
    assert after[2] - before[2] == s.ok
    assert s.ttft_s is not None and s.tpot_s is not None and s.inter_token_s is not None
    assert 0 < s.ttft_s["p50"] <= s.ttft_s["p99"] <= s.ttft_s["max"] <= s.latency_s["max"]
    assert 0 < s.tpot_s["p50"] < s.latency_s["p50"]
    assert s.inter_token_s["p50"] > 0


def test_openai_without_streaming_and_a_mix_of_served_names(vllm: str) -> None:
    before = counters(vllm)
    s = run_load(
        LoadConfig(
            url=vllm,
            protocol="openai",
            concurrency=2,
            duration=3,
            targets=[Target.parse("tiny-llm=3", "openai"), Target.parse("tiny-llm-canary=1", "openai")],
            stream=False,
            endpoint="completions",
            prompt_tokens="normal:16:4",
            output_tokens="4-8",
            ignore_eos=True,
            timeout=60,
            seed=2,
        )
    )
    after = counters(vllm)
    assert s.sent == s.ok > 0 and not s.errors
    assert set(s.by_target) == {"tiny-llm", "tiny-llm-canary"}
    assert s.ttft_s is None and s.tpot_s is None  # one answer per request: nothing to time per token
    assert s.generation_tokens == after[1] - before[1]
    assert 4 * s.ok <= s.generation_tokens <= 8 * s.ok
    assert s.prompt_tokens == after[0] - before[0]


def test_openai_cli_json_and_one_line_errors(vllm: str, capsys: pytest.CaptureFixture) -> None:
    proc = subprocess.run(
        inferwatch_cmd(
            "load", "--protocol", "openai", "--url", vllm, "--rate", "2", "--duration", "2",
            "--output-tokens", "8", "--ignore-eos", "--json", "--timeout", "60",
        ),
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["protocol"] == "openai" and data["ok"] == data["sent"] > 0
    assert set(data["ttft_s"]) == set(data["tpot_s"]) == {"p50", "p90", "p99", "max"}
    assert data["generation_tokens"] == 8 * data["ok"]
    for args, words in (
        (["--model", "no-such-llm"], "no-such-llm not served at"),
        (["--batch", "2"], "batch applies to KServe v2 tensors"),
        (["--output-tokens", "0"], "between 1 and"),
    ):
        code = cli.main(
            ["load", "--protocol", "openai", "--url", vllm, "--rate", "1", "--duration", "1", *args]
        )
        err = capsys.readouterr().err
        assert code != 0 and err.startswith("inferwatch: error:") and words in err, (args, err)
        assert len(err.strip().splitlines()) == 1


def test_triton_generate_stream_pace_and_tritons_counters(triton) -> None:
    ok_name = contract.TRITON_REQUEST_SUCCESS.name
    before = triton_metrics.scrape(triton.metrics_url)
    s = run_load(
        LoadConfig(
            url=triton.http_url,
            protocol="triton-generate",
            rate=10,
            duration=3,
            targets=[Target.parse("tiny_stream:1", "triton-generate")],
            prompt_tokens="4",
            output_tokens="6",
            seed=3,
        )
    )
    after = triton_metrics.scrape(triton.metrics_url)
    assert s.sent == s.ok > 0 and not s.errors
    assert triton_metrics.delta(before, after, ok_name, "tiny_stream", "1") == s.ok
    assert s.generation_tokens == 6 * s.ok and s.prompt_tokens == 4 * s.ok
    # The model's pace is a floor for what the client sees.
    assert s.ttft_s["p50"] >= STREAM.ttft_ms["1"] / 1000 * 0.95
    assert s.tpot_s["p50"] >= STREAM.per_token_ms["1"] / 1000 * 0.8


def test_triton_generate_counts_errors_inside_and_before_the_stream(triton, clean_faults: Path) -> None:
    config = LoadConfig(
        url=triton.http_url,
        protocol="triton-generate",
        concurrency=2,
        duration=1.5,
        targets=[Target.parse("tiny_stream:2", "triton-generate")],
        output_tokens="6",
        seed=4,
    )
    faults.set_fault("tiny_stream", "2", error_after_tokens=3, state_dir=clean_faults)
    s = run_load(config)
    assert s.ok == 0 and s.errors == {"stream_error": s.sent} and s.sent > 0
    faults.set_fault("tiny_stream", "2", error_after_tokens=0, state_dir=clean_faults)
    s = run_load(config)
    assert s.ok == 0 and s.errors == {"400": s.sent} and s.sent > 0
    faults.clear(state_dir=clean_faults)
    s = run_load(LoadConfig(**{**config.__dict__, "stream": False}))
    assert s.ok == s.sent > 0 and s.generation_tokens == 6 * s.ok and s.ttft_s is None


def test_lengths_and_bad_stream_settings() -> None:
    assert VLLM_PORT == DEFAULT_PORT  # load's default for openai is where inferwatch vllm listens
    rng = random.Random(0)
    assert Lengths.parse("7", "x").sample(rng) == 7
    assert {Lengths.parse("3-5", "x").sample(rng) for _ in range(200)} == {3, 4, 5}
    normal = [Lengths.parse("normal:50:5", "x").sample(rng) for _ in range(2000)]
    assert 49 < sum(normal) / len(normal) < 51 and min(normal) >= 1
    for text, words in (
        ("0", "between 1"),
        ("5-2", "low end"),
        ("abc", "expected N, A-B"),
        ("1-999999", "between"),
    ):
        with pytest.raises(LoadError, match=words):
            Lengths.parse(text, "output tokens")
    with pytest.raises(LoadError, match="not a streaming reference model"):
        Target.parse("ranker", "triton-generate")
    with pytest.raises(LoadError, match="no version 7"):
        Target.parse("tiny_stream:7", "triton-generate")
    with pytest.raises(LoadError, match="not a reference model"):
        Target.parse("tiny_stream", "http")  # a stream cannot answer KServe infer
    assert Target.parse("org/model:tag=2", "openai") == Target("org/model:tag", "", 2.0)
    with pytest.raises(LoadError, match="endpoint"):
        LoadConfig(url="127.0.0.1:1", protocol="openai", rate=1, endpoint="embeddings").validate()  # type: ignore[arg-type]


def test_triton_generate_cli_refuses_what_triton_does_not_serve(capsys: pytest.CaptureFixture) -> None:
    port = str(free_port())
    code = cli.main(["load", "--protocol", "triton-generate", "--url", f"127.0.0.1:{port}", "--rate", "1"])
    err = capsys.readouterr().err
    assert (
        code != 0 and f"cannot reach Triton at 127.0.0.1:{port}" in err and len(err.strip().splitlines()) == 1
    )


def _scripted_openai_server(script: dict[str, list[bytes]]) -> tuple[str, socket.socket]:
    """A raw socket server for what a real server will not send on demand: each request's
    `model` picks a list of byte pieces, written one by one (an HTTP/1.1 answer, then close)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve(conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = int(
                next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
            )
            while len(body) < length:
                body += conn.recv(65536)
            try:
                for piece in script[json.loads(body)["model"]]:
                    conn.sendall(piece)
                    time.sleep(0.002)
            except OSError:
                pass  # the client left first (it gave up on a bad event)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return f"127.0.0.1:{listener.getsockname()[1]}", listener


def test_openai_stream_parsing_at_any_split_and_broken_streams() -> None:
    status = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n"
    head = status + b"Transfer-Encoding: chunked\r\n\r\n"
    close = status + b"\r\n"  # a body that ends when the connection closes

    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    role = {"choices": [{"delta": {"role": "assistant"}}]}
    events = [role] + [{"choices": [{"delta": {"content": f"t{i}"}}]} for i in range(3)]
    events.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}})
    good = b"".join(b"data: " + json.dumps(e).encode() + b"\r\n\r\n" for e in events) + b": a comment\r\n"
    good += b"data: [DONE]\r\n\r\n"
    script = {
        # CRLF line ends, one byte per chunk, so every event is split at every position.
        "split-everywhere": [head, *(chunk(good[i : i + 1]) for i in range(len(good))), b"0\r\n\r\n"],
        "cut": [head, chunk(good[: good.index(b"t1")])],  # the server goes away mid-event
        "cut-no-chunks": [close, good[: good.index(b"t1")]],  # the same, with a body that ends at close
        "no-done": [head, chunk(good[: good.index(b"data: [DONE]")]), b"0\r\n\r\n"],
        "garbage": [close, b"data: {not json\n\n"],
        "error": [close, b'data: {"error": {"message": "engine died", "code": 500}}\n\ndata: [DONE]\n\n'],
    }
    url, listener = _scripted_openai_server(script)

    def two_requests(model: str) -> Summary:
        gen = StreamLoadGenerator(LoadConfig(url=url, protocol="openai", rate=1, targets=[Target(model)]))

        async def send() -> None:
            client, _ = gen._make_client()
            try:
                for _ in range(2):
                    gen.stats.on_send(model)
                    await gen._one(client, None, Target(model), time.monotonic())
            finally:
                await client.close()

        asyncio.run(send())
        return gen.snapshot()

    try:
        s = two_requests("split-everywhere")
        assert s.ok == 2 and not s.errors
        # usage wins over counting events; the role-only first event is no token.
        assert (s.prompt_tokens, s.generation_tokens) == (10, 6)
        assert s.ttft_s is not None and s.ttft_s["p50"] > 0
        assert s.inter_token_s is not None and s.inter_token_s["p50"] > 0
        for model, label in (
            ("cut", "incomplete_stream"),
            ("cut-no-chunks", "incomplete_stream"),
            ("no-done", "incomplete_stream"),
            ("garbage", "bad_event"),
            ("error", "stream_error"),
        ):
            s = two_requests(model)
            assert s.ok == 0 and s.errors == {label: 2}, (model, s.errors)
    finally:
        listener.close()
