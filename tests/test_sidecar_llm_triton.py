"""The sidecar in front of the real Triton's token-streaming model (``tiny_stream``): generate and
generate_stream pass unchanged and are measured like the OpenAI API (TTFT, inter-token gaps,
TPOT, generation tokens, the version Triton picked); an error after N tokens inside the 200
stream is a server_error with its N tokens; a client that leaves mid-stream is 499 with the
tokens it got; a Triton killed mid-stream is a server_error and the client's stream is closed
after its tokens. The session's sidecar and Triton (tests/fixtures) serve every test but the
last, which kills a Triton of its own.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from inferwatch import contract as c
from reference_server import faults
from tests.fixtures.sidecar import SidecarInfo, launch_sidecar
from tests.fixtures.triton import start_triton

pytestmark = pytest.mark.integration

MODEL = "tiny_stream"
REQUESTS = c.REQUESTS_TOTAL.name
TOKENS = c.TOKENS_TOTAL.name
TTFT = c.TIME_TO_FIRST_TOKEN.name + "_count"
ITL = c.INTER_TOKEN_LATENCY.name + "_count"
TPOT = c.TIME_PER_OUTPUT_TOKEN.name + "_count"


@pytest.fixture
def clean_faults(triton) -> Iterator[Path]:
    faults.clear(state_dir=triton.state_dir)
    try:
        yield triton.state_dir
    finally:
        faults.clear(state_dir=triton.state_dir)


def _path(endpoint: str, version: str = "") -> str:
    return f"/v2/models/{MODEL}" + (f"/versions/{version}" if version else "") + f"/{endpoint}"


def _raw(base: str, path: str, body: dict) -> tuple[int, bytes]:
    resp = httpx.post(base + path, json=body, timeout=60)
    return resp.status_code, resp.content


class Delta:
    """The sidecar's series by (model, version[, more labels]) before and after a block."""

    def __init__(self, sidecar: SidecarInfo) -> None:
        self.sidecar = sidecar
        self.names = (REQUESTS, TOKENS, TTFT, ITL, TPOT)
        self.before = {n: sidecar.counts(n, *self._keys(n)) for n in self.names}

    @staticmethod
    def _keys(name: str) -> tuple[str, ...]:
        if name == REQUESTS:
            return ("model", "version", "code", "outcome")
        if name == TOKENS:
            return ("model", "version", "type")
        return ("model", "version")

    def __call__(self, name: str, *key: str) -> float:
        after = self.sidecar.counts(name, *self._keys(name))
        return after.get(key, 0.0) - self.before[name].get(key, 0.0)


def test_generate_stream_passes_unchanged_and_is_measured(triton, sidecar: SidecarInfo, clean_faults) -> None:
    body = {"text_input": "a b c", "max_tokens": 6}
    direct = _raw(f"http://{triton.http_url}", _path("generate_stream", "1"), body)
    delta = Delta(sidecar)
    # Without a version in the URL, the version Triton picked (the newest, 2) labels the request.
    for version in ("1", ""):
        status, raw = _raw(sidecar.base_url, _path("generate_stream", version), body)
        assert status == 200
        if version:
            assert raw == direct[1]  # byte for byte
    events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert len(events) == 6 and events[0]["model_version"] == "2"
    for version in ("1", "2"):
        assert delta(REQUESTS, MODEL, version, "200", c.OUTCOME_SUCCESS) == 1
        assert delta(TTFT, MODEL, version) == 1
        assert delta(ITL, MODEL, version) == 5  # one gap per token after the first
        assert delta(TPOT, MODEL, version) == 1
        assert delta(TOKENS, MODEL, version, c.TOKEN_GENERATION) == 6
        assert delta(TOKENS, MODEL, version, c.TOKEN_PROMPT) == 0  # Triton reports no usage
    assert delta(REQUESTS, MODEL, "", "200", c.OUTCOME_SUCCESS) == 0


def test_ttft_and_inter_token_gaps_follow_the_models_pace(triton, sidecar: SidecarInfo, clean_faults) -> None:
    faults.set_fault(MODEL, "1", ttft_ms=300, per_token_ms=100, state_dir=clean_faults)
    name = c.TIME_TO_FIRST_TOKEN.name
    series = [m + s for m in (name, c.INTER_TOKEN_LATENCY.name) for s in ("_sum", "_count")]
    before = {n: sidecar.counts(n, "model", "version") for n in series}
    status, _ = _raw(sidecar.base_url, _path("generate_stream", "1"), {"text_input": "a", "max_tokens": 4})
    assert status == 200
    key = (MODEL, "1")

    def mean(metric: str) -> float:
        total, n = (
            sidecar.counts(metric + s, "model", "version")[key] - before[metric + s].get(key, 0)
            for s in ("_sum", "_count")
        )
        return total / n

    # Lower bounds only (the model sleeps at least this long; a busy machine adds to it).
    assert mean(name) >= 0.3
    assert mean(c.INTER_TOKEN_LATENCY.name) >= 0.09


def test_generate_is_counted_without_token_timing(triton, sidecar: SidecarInfo, clean_faults) -> None:
    delta = Delta(sidecar)
    body = {"text_input": "a b", "max_tokens": 3, "stream": False}
    status, raw = _raw(sidecar.base_url, _path("generate", "1"), body)
    assert status == 200 and json.loads(raw)["text_output"] == "a b a "
    assert delta(REQUESTS, MODEL, "1", "200", c.OUTCOME_SUCCESS) == 1
    assert delta(TTFT, MODEL, "1") == 0  # one answer: no first token to time
    assert delta(TOKENS, MODEL, "1", c.TOKEN_GENERATION) == 0  # no usage, no events to count


def test_an_error_after_n_tokens_is_a_server_error_with_its_tokens(
    triton, sidecar: SidecarInfo, clean_faults
) -> None:
    faults.set_fault(MODEL, "1", error_after_tokens=3, state_dir=clean_faults)
    delta = Delta(sidecar)
    status, raw = _raw(
        sidecar.base_url, _path("generate_stream", "1"), {"text_input": "a b", "max_tokens": 8}
    )
    # What the client gets is Triton's own: 200, three tokens, one error event.
    assert status == 200
    events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert len(events) == 4 and events[-1]["error"].startswith(faults.INJECTED)
    assert delta(REQUESTS, MODEL, "1", "200", c.OUTCOME_SERVER_ERROR) == 1
    assert delta(REQUESTS, MODEL, "1", "200", c.OUTCOME_SUCCESS) == 0
    assert delta(TOKENS, MODEL, "1", c.TOKEN_GENERATION) == 3
    # Before any token the status says it: 400, a client error (the request could not run).
    faults.set_fault(MODEL, "1", error_after_tokens=0, state_dir=clean_faults)
    status, _ = _raw(sidecar.base_url, _path("generate_stream", "1"), {"text_input": "a", "max_tokens": 8})
    assert status == 400
    assert delta(REQUESTS, MODEL, "1", "400", c.OUTCOME_CLIENT_ERROR) == 1


def test_a_client_that_leaves_is_499_with_the_tokens_it_got(
    triton, sidecar: SidecarInfo, clean_faults
) -> None:
    faults.set_fault(MODEL, "1", ttft_ms=0, per_token_ms=100, state_dir=clean_faults)
    delta = Delta(sidecar)
    payload = json.dumps({"text_input": "a", "max_tokens": 100}).encode()
    head = (
        f"POST {_path('generate_stream', '1')} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", sidecar.http_port), timeout=30) as sock:
        sock.sendall(head + payload)
        got = b""
        while got.count(b"text_output") < 3:
            got += sock.recv(4096)
    deadline = time.monotonic() + 15
    while not delta(REQUESTS, MODEL, "1", "499", c.OUTCOME_CLIENT_ERROR) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert delta(REQUESTS, MODEL, "1", "499", c.OUTCOME_CLIENT_ERROR) == 1
    # The tokens that passed to the client before it left: 100 would take 10 s.
    assert 3 <= delta(TOKENS, MODEL, "1", c.TOKEN_GENERATION) < 20
    assert delta(TTFT, MODEL, "1") == 1


def test_the_kserve_path_stays_without_llm_series(triton, sidecar: SidecarInfo) -> None:
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [0.0] * 16}]}
    delta = Delta(sidecar)
    httpx.post(f"{sidecar.base_url}/v2/models/ranker/versions/1/infer", json=body, timeout=60)
    assert sum(delta(REQUESTS, "ranker", "1", code, o) for code in ("200", "400") for o in c.OUTCOMES) == 1
    series = {labels["model"] for labels, _ in sidecar.samples(TTFT)}
    assert "ranker" not in series


def test_triton_killed_mid_stream_is_a_server_error_and_the_client_stream_closes(tmp_path: Path) -> None:
    """A Triton of its own (only tiny_stream loaded), killed while a stream passes."""
    server = start_triton(
        tmp_path / "state", extra_args=("--model-control-mode=explicit", f"--load-model={MODEL}")
    )
    try:
        faults.set_fault(MODEL, "1", ttft_ms=0, per_token_ms=100, state_dir=tmp_path / "state")
        with launch_sidecar(server.http_url, server.grpc_url, tmp_path, "--grpc-port", "0") as sc:
            delta = Delta(sc)
            payload = json.dumps({"text_input": "a", "max_tokens": 100}).encode()
            head = (
                f"POST {_path('generate_stream', '1')} HTTP/1.1\r\nHost: x\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
            ).encode()
            with socket.create_connection(("127.0.0.1", sc.http_port), timeout=30) as sock:
                sock.sendall(head + payload)
                got = b""
                while got.count(b"text_output") < 3:
                    got += sock.recv(4096)
                assert server.proc is not None
                os.killpg(server.proc.pid, signal.SIGKILL)
                server.proc.wait()
                while more := sock.recv(65536):  # EOF (not a reset, not a hang) after the tokens
                    got += more
            assert got.startswith(b"HTTP/1.1 200") and not got.endswith(b"0\r\n\r\n")
            assert delta(REQUESTS, MODEL, "1", "502", c.OUTCOME_SERVER_ERROR) == 1
            assert 3 <= delta(TOKENS, MODEL, "1", c.TOKEN_GENERATION) < 20
    finally:
        server.stop()
