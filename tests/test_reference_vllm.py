"""The LLM reference server: `inferwatch vllm` runs the real vLLM (CPU build) on the tiny model
built at install time, serves it under two names, streams one SSE event per token, keeps its own
token counters, and stops every process it started on SIGTERM.

One vLLM start (35 to 90 s, about 3 GB) serves the whole module; the last test stops it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from reference_server.llm.vllm_server import DEFAULT_MODEL_DIR, SERVED_NAMES
from tests.fixtures.net import VENV_BIN, free_port, wait_http

pytestmark = pytest.mark.integration

CLI = str(VENV_BIN / "inferwatch")


def _vllm_metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, subprocess.Popen, Path]]:
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    proc = subprocess.Popen(
        [CLI, "vllm", "--port", str(port), "--log-file", str(log), "--kv-cache-blocks", "128"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/v1/models", timeout=300, proc=proc)
        yield url, proc, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_the_tiny_model_is_built_at_install_time() -> None:
    built = json.loads((DEFAULT_MODEL_DIR / "inferwatch-tiny-model.json").read_text())
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == 64  # the CPU kernel refuses 16
    assert built["vocab_size"] == config["vocab_size"] > 1000
    assert (
        "chat_template" in (DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text()
        or (DEFAULT_MODEL_DIR / "chat_template.jinja").is_file()
    )


def test_serves_the_model_under_both_names(vllm) -> None:
    url, _, _ = vllm
    names = {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]}
    assert names == set(SERVED_NAMES)


def test_chat_and_completions_answer_with_usage(vllm) -> None:
    url, _, _ = vllm
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "tiny-llm", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 12},
        timeout=120,
    ).json()
    assert chat["usage"]["prompt_tokens"] > 0
    assert 0 < chat["usage"]["completion_tokens"] <= 12
    assert chat["choices"][0]["finish_reason"] in ("length", "stop")
    completion = httpx.post(
        f"{url}/v1/completions",
        json={"model": "tiny-llm-canary", "prompt": "def main():", "max_tokens": 5},
        timeout=120,
    ).json()
    assert 0 < completion["usage"]["completion_tokens"] <= 5


def test_a_stream_has_one_event_per_token_and_vllm_counts_them(vllm) -> None:
    url, _, _ = vllm
    before = httpx.get(f"{url}/metrics").text
    events: list[dict] = []
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json={
            "model": "tiny-llm",
            "messages": [{"role": "user", "content": "count"}],
            "max_tokens": 16,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        timeout=120,
    ) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    usage = events[-1]["usage"]
    content = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]
    # The first event carries only the role: TTFT must be measured to the first content event.
    assert events[0]["choices"][0]["delta"].get("role") == "assistant"
    assert not events[0]["choices"][0]["delta"].get("content")
    assert len(content) == usage["completion_tokens"]
    after = httpx.get(f"{url}/metrics").text
    gained = _vllm_metric(after, "vllm:generation_tokens_total") - _vllm_metric(
        before, "vllm:generation_tokens_total"
    )
    assert gained == usage["completion_tokens"]
    assert _vllm_metric(after, "vllm:time_to_first_token_seconds_count") >= 1


def test_the_kv_cache_is_capped_in_blocks(vllm) -> None:
    """--kv-cache-blocks reaches vLLM: a small cache is how saturation incidents are provoked."""
    url, _, _ = vllm
    info = [
        ln for ln in httpx.get(f"{url}/metrics").text.splitlines() if ln.startswith("vllm:cache_config_info{")
    ]
    assert info and 'num_gpu_blocks="128"' in info[0], info


def test_a_busy_port_and_a_missing_environment_are_one_line_errors(vllm, tmp_path: Path) -> None:
    url, _, _ = vllm
    busy = url.rsplit(":", 1)[1]
    out = subprocess.run([CLI, "vllm", "--port", busy], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "already in use" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run(
        [CLI, "vllm", "--python", str(tmp_path / "none"), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert "scripts/bootstrap" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([CLI, "vllm", "--kv-cache-gib", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--kv-cache-gib" in out.stderr
    out = subprocess.run([CLI, "vllm", "--kv-cache-blocks", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--kv-cache-blocks" in out.stderr


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_stops_the_server_its_engine_and_its_worker(vllm) -> None:
    url, proc, _ = vllm
    port = int(url.rsplit(":", 1)[1])
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 30
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _group_alive(proc.pid), "vLLM left processes behind"
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0
