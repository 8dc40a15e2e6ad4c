"""The token-streaming reference model (tiny_stream) on the real Triton: generate, generate_stream
(server-sent events) and gRPC ModelStreamInfer, its pace, injected LLM faults, and what Triton
sends when a stream fails part way (the sidecar relies on these shapes: reference_server/README.md).
"""

from __future__ import annotations

import ast
import json
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from inferwatch import cli, contract
from reference_server import catalog, faults, triton_metrics

pytestmark = pytest.mark.integration

MODEL = "tiny_stream"
INFO = catalog.STREAM_MODELS[MODEL]


@pytest.fixture
def clean_faults(triton) -> Iterator[Path]:
    faults.clear(state_dir=triton.state_dir)
    try:
        yield triton.state_dir
    finally:
        faults.clear(state_dir=triton.state_dir)


def url(triton, endpoint: str, version: str = "") -> str:
    path = f"/v2/models/{MODEL}" + (f"/versions/{version}" if version else "")
    return f"http://{triton.http_url}{path}/{endpoint}"


def sse(triton, body: dict, version: str = "") -> tuple[int, str, list[tuple[float, str]]]:
    """POST generate_stream: (status, content type, [(seconds since the request, raw line)])
    for every line, so the test sees the exact framing."""
    lines = []
    t0 = time.monotonic()
    with httpx.stream("POST", url(triton, "generate_stream", version), json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            lines.append((time.monotonic() - t0, line))
    return resp.status_code, resp.headers["content-type"], lines


def events(lines: list[tuple[float, str]]) -> list[tuple[float, dict]]:
    return [(t, json.loads(line.removeprefix("data: "))) for t, line in lines if line.startswith("data: ")]


def grpc_stream(triton, text: str, max_tokens: int | None, empty_final: bool, version: str = "") -> list:
    """One request over tritonclient's ModelStreamInfer: [(seconds, tokens or None, final flag,
    error message or None)] until the final response (or an error) arrives."""
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((time.monotonic(), result, error)))
    try:
        inputs = [grpcclient.InferInput("text_input", [1], "BYTES")]
        inputs[0].set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
        if max_tokens is not None:
            inputs.append(grpcclient.InferInput("max_tokens", [1], "INT32"))
            inputs[1].set_data_from_numpy(np.array([max_tokens], np.int32))
        t0 = time.monotonic()
        client.async_stream_infer(
            MODEL, inputs, model_version=version, request_id="r1", enable_empty_final_response=empty_final
        )
        out = []
        while True:
            try:
                t, result, error = got.get(timeout=1.0 if not empty_final and out else 30)
            except queue.Empty:
                return out  # no final response is sent without the empty-final option
            if error is not None:
                out.append((t - t0, None, None, error.message()))
                return out
            params = result.get_response(as_json=True).get("parameters", {})
            final = params["triton_final_response"]["bool_param"]
            tokens = result.as_numpy("text_output")
            out.append((t - t0, None if tokens is None else [x.decode() for x in tokens], final, None))
            if final:
                return out
    finally:
        client.stop_stream()
        client.close()


def test_generate_stream_sends_one_event_per_token_at_the_models_pace(triton) -> None:
    status, ctype, lines = sse(triton, {"text_input": "alpha beta gamma", "max_tokens": 7}, version="1")
    assert status == 200 and ctype.startswith("text/event-stream")
    got = events(lines)
    assert [e["text_output"] for _, e in got] == [
        "alpha ",
        "beta ",
        "gamma ",
        "alpha ",
        "beta ",
        "gamma ",
        "alpha ",
    ]
    assert {(e["model_name"], e["model_version"]) for _, e in got} == {(MODEL, "1")}
    # LF framing: "data: {...}", a blank line, nothing else.
    assert [line for _, line in lines] == [
        x for _, e in got for x in ("data: " + json.dumps(e, separators=(",", ":")), "")
    ]
    # The pace is a floor (the model sleeps), so only lower bounds hold on a busy machine: the
    # first token after ttft, the last one after ttft + 6 gaps.
    times = [t for t, _ in got]
    assert times[0] >= INFO.ttft_ms["1"] / 1000 * 0.95
    assert times[-1] >= (INFO.ttft_ms["1"] + 6 * INFO.per_token_ms["1"]) / 1000 * 0.95


def test_default_max_tokens_and_the_canary_is_slower(triton, clean_faults: Path) -> None:
    _, _, v1 = sse(triton, {"text_input": "x"}, version="1")
    _, _, v2 = sse(triton, {"text_input": "x"}, version="2")
    _, _, newest = sse(triton, {"text_input": "x", "max_tokens": 1})
    assert len(events(v1)) == len(events(v2)) == INFO.default_max_tokens
    assert events(newest)[0][1]["model_version"] == "2"  # no version: the newest
    assert INFO.per_token_ms["2"] > INFO.per_token_ms["1"]
    n = INFO.default_max_tokens
    for version, lines in (("1", v1), ("2", v2)):
        floor = (INFO.ttft_ms[version] + (n - 1) * INFO.per_token_ms[version]) / 1000
        assert events(lines)[-1][0] >= floor * 0.95, version


def test_generate_answers_once_with_the_whole_text(triton) -> None:
    resp = httpx.post(
        url(triton, "generate"), json={"text_input": "a b", "max_tokens": 3, "stream": False}, timeout=60
    )
    assert resp.status_code == 200
    assert resp.json() == {"model_name": MODEL, "model_version": "2", "text_output": "a b a "}
    # The same in one streamed event.
    _, _, lines = sse(triton, {"text_input": "a b", "max_tokens": 3, "stream": False})
    assert [e["text_output"] for _, e in events(lines)] == ["a b a "]
    # A request that streams, sent to generate: Triton 2.51 answers 200 with an error body.
    resp = httpx.post(url(triton, "generate"), json={"text_input": "a b", "max_tokens": 3}, timeout=60)
    assert resp.status_code == 200 and "exactly 1 response" in resp.json()["error"], resp.text
    # One token needs no "stream": false.
    resp = httpx.post(url(triton, "generate"), json={"text_input": "a", "max_tokens": 1}, timeout=60)
    assert resp.json()["text_output"] == "a "


@pytest.mark.parametrize("empty_final", [False, True])
def test_grpc_stream_one_response_per_token_and_the_empty_final_response(triton, empty_final: bool) -> None:
    got = grpc_stream(triton, "one two", 4, empty_final, version="1")
    tokens = [(toks, final) for _, toks, final, _ in got]
    want = [(["one "], False), (["two "], False), (["one "], False), (["two "], False)]
    # The model ends with a flag-only send: Triton turns it into an empty response flagged
    # triton_final_response only when the client asks for one.
    assert tokens == want + ([(None, True)] if empty_final else [])
    assert got[0][0] >= INFO.ttft_ms["1"] / 1000 * 0.9


def test_streams_overlap(triton, clean_faults: Path) -> None:
    """Each request streams from its own thread, as an LLM server batches continuously."""
    faults.set_fault(MODEL, "1", ttft_ms=50, per_token_ms=50, state_dir=clean_faults)
    body = {"text_input": "x", "max_tokens": 10}
    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: sse(triton, body, version="1"), range(8)))
    elapsed = time.monotonic() - t0
    assert all(len(events(lines)) == 10 for _, _, lines in results)
    one = 0.5  # 50 ms to the first token, then 9 more 50 ms apart
    assert elapsed < 8 * one / 2, f"8 streams took {elapsed:.2f} s, one alone takes {one:.2f} s"


def test_fault_pace_knobs_change_the_stream(triton, clean_faults: Path) -> None:
    faults.set_fault(MODEL, "1", ttft_ms=300, per_token_ms=60, state_dir=clean_faults)
    got = events(sse(triton, {"text_input": "x", "max_tokens": 4}, version="1")[2])
    assert len(got) == 4
    assert got[0][0] >= 0.29 and got[-1][0] >= 0.29 + 3 * 0.06
    faults.set_fault(MODEL, "1", ttft_ms=0, per_token_ms=0, extra_latency_ms=250, state_dir=clean_faults)
    got = events(sse(triton, {"text_input": "x", "max_tokens": 4}, version="1")[2])
    assert got[0][0] >= 0.24  # extra latency adds to the time to first token
    faults.clear(MODEL, state_dir=clean_faults)
    # Cleared: the model's own pace comes back.
    got = events(sse(triton, {"text_input": "x", "max_tokens": 2}, version="1")[2])
    assert got[0][0] < 0.24


def test_a_client_that_leaves_stops_the_stream(triton, clean_faults: Path) -> None:
    """Triton cancels the request when the HTTP client disconnects or the gRPC stream is
    cancelled; the model sees it between two tokens, stops, and says so in Triton's log."""
    faults.set_fault(MODEL, "1", ttft_ms=0, per_token_ms=100, state_dir=clean_faults)
    line = f"{MODEL} version 1: cancelled after"
    before = triton.log_path.read_text().count(line)
    with httpx.stream(
        "POST", url(triton, "generate_stream", "1"), json={"text_input": "a", "max_tokens": 100}
    ) as r:
        next(r.iter_lines())  # the first token, then leave
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put(result))
    inputs = [
        grpcclient.InferInput("text_input", [1], "BYTES"),
        grpcclient.InferInput("max_tokens", [1], "INT32"),
    ]
    inputs[0].set_data_from_numpy(np.array([b"a"], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([100], np.int32))
    client.async_stream_infer(MODEL, inputs, model_version="1")
    got.get(timeout=30)
    client.stop_stream(cancel_requests=True)
    client.close()
    deadline = time.monotonic() + 10  # 100 tokens would take 10 s; a cancelled stream stops within 0.1 s
    while triton.log_path.read_text().count(line) < before + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert triton.log_path.read_text().count(line) == before + 2


def test_error_after_n_tokens_over_sse(triton, clean_faults: Path) -> None:
    before = triton_metrics.scrape(triton.metrics_url)
    faults.set_fault(MODEL, error_after_tokens=3, state_dir=clean_faults)
    status, ctype, lines = sse(triton, {"text_input": "a b", "max_tokens": 8})
    # The status went out with the first token: 200, then three token events, then one error event.
    assert status == 200 and ctype.startswith("text/event-stream")
    got = events(lines)
    assert [e.get("text_output") for _, e in got[:3]] == ["a ", "b ", "a "]
    assert got[3][1] == {"error": f"{faults.INJECTED} {MODEL} version 2 (error after 3 tokens)"}
    assert len(got) == 4 and [line for _, line in lines][-1] == ""
    # Before any token, the error decides the status: 400 with the same event.
    faults.set_fault(MODEL, error_after_tokens=0, state_dir=clean_faults)
    status, ctype, lines = sse(triton, {"text_input": "a b", "max_tokens": 8})
    assert status == 400 and ctype.startswith("text/event-stream")
    assert [e for _, e in events(lines)] == [
        {"error": f"{faults.INJECTED} {MODEL} version 2 (error after 0 tokens)"}
    ]
    # Not streamed ("stream": false on generate): 400 and the error as the JSON body.
    faults.set_fault(MODEL, error_after_tokens=2, state_dir=clean_faults)
    resp = httpx.post(
        url(triton, "generate"), json={"text_input": "a", "max_tokens": 5, "stream": False}, timeout=60
    )
    assert resp.status_code == 400 and resp.json()["error"].startswith(faults.INJECTED)
    # Triton counts a decoupled model's error responses as successes: only a proxy sees them.
    after = triton_metrics.scrape(triton.metrics_url)
    ok, fail = contract.TRITON_REQUEST_SUCCESS.name, contract.TRITON_REQUEST_FAILURE.name
    assert triton_metrics.delta(before, after, fail, MODEL, "2") == 0
    assert triton_metrics.delta(before, after, ok, MODEL, "2") == 3


@pytest.mark.parametrize("empty_final", [False, True])
def test_error_after_n_tokens_over_grpc(triton, clean_faults: Path, empty_final: bool) -> None:
    faults.set_fault(MODEL, "1", error_after_tokens=2, state_dir=clean_faults)
    got = grpc_stream(triton, "a b c", 6, empty_final, version="1")
    assert [toks for _, toks, _, _ in got] == [["a "], ["b "], None]
    assert got[-1][3] == f"{faults.INJECTED} {MODEL} version 1 (error after 2 tokens)"
    # No empty final response follows the error, asked for or not (the loop would have read it).


@pytest.mark.parametrize("version", ["1", ""])
def test_grpc_error_on_the_wire(triton, clean_faults: Path, version: str) -> None:
    """Raw ModelStreamInfer: the error is a message inside the stream, not a gRPC status."""
    faults.set_fault(MODEL, error_after_tokens=1, state_dir=clean_faults)
    stop = threading.Event()

    def request(rid: str) -> service_pb2.ModelInferRequest:
        r = service_pb2.ModelInferRequest(model_name=MODEL, model_version=version, id=rid)
        t = r.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        t.contents.bytes_contents.append(b"a b")
        m = r.inputs.add(name="max_tokens", datatype="INT32", shape=[1])
        m.contents.int_contents.append(3)
        r.parameters["triton_enable_empty_final_response"].bool_param = True
        return r

    def requests():
        yield request("x1")
        next_one.wait(30)  # the second request goes on the same stream after the error
        yield request("x2")
        stop.wait(30)  # keep the stream open until the answers are read, as a client does

    next_one = threading.Event()
    with grpc.insecure_channel(triton.grpc_url) as channel:
        call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests())
        first, error = next(call), next(call)
        next_one.set()
        second = [next(call), next(call)]
        stop.set()
        rest = list(call)
        code = call.code()
    assert [r.infer_response.id for r in second] == ["x2", "x2"] and second[1].error_message
    served = version or "2"
    assert first.error_message == "" and first.infer_response.model_version == served
    assert not first.infer_response.parameters["triton_final_response"].bool_param
    assert error.error_message == f"{faults.INJECTED} {MODEL} version {served} (error after 1 tokens)"
    r = error.infer_response
    # The error response repeats the request's version (empty when it named none), not the served one.
    assert (r.model_name, r.model_version, r.id, len(r.outputs)) == (MODEL, version, "x1", 0)
    assert r.parameters["triton_final_response"].bool_param
    assert rest == [] and code == grpc.StatusCode.OK  # the RPC itself ends well


def test_bad_inputs_get_a_clear_error(triton) -> None:
    cases = (
        ({"max_tokens": 4}, "text_input is required"),
        (
            {"text_input": "x", "max_tokens": -1},
            f"max_tokens must be between 1 and {INFO.max_tokens_limit}, got -1",
        ),
        ({"text_input": "x", "max_tokens": 0}, "got 0"),
        ({"text_input": "x", "max_tokens": INFO.max_tokens_limit + 1}, "max_tokens must be between"),
    )
    for body, words in cases:
        status, _, lines = sse(triton, body)
        assert status == 400 and len(events(lines)) == 1, (body, lines)
        assert words in events(lines)[0][1]["error"], (body, lines)
        resp = httpx.post(url(triton, "generate"), json={**body, "stream": False}, timeout=60)
        assert resp.status_code == 400 and words in resp.json()["error"], (body, resp.text)
    got = grpc_stream(triton, "x", -1, True)
    assert len(got) == 1 and "max_tokens must be between 1" in got[0][3]
    # Triton's own parser refuses a max_tokens that is not a number (500, its message).
    resp = httpx.post(url(triton, "generate_stream"), json={"text_input": "x", "max_tokens": "a"}, timeout=60)
    assert resp.status_code >= 400 and "Unable to parse" in resp.json()["error"], resp.text
    # KServe infer cannot reach a decoupled model: 501.
    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["x"]}]}
    resp = httpx.post(url(triton, "infer"), json=body, timeout=60)
    assert resp.status_code == 501 and "decoupled" in resp.json()["error"], resp.text
    assert httpx.get(f"http://{triton.http_url}/v2/health/ready").status_code == 200


def test_the_models_read_the_fault_kinds_the_table_writes() -> None:
    """reference_models.py cannot import inferwatch (it runs in the official container too), so
    its typed copy of a fault file (Faults) is held against faults.KNOBS here."""
    source = (catalog.MODEL_REPOSITORY / "reference_models.py").read_text()
    model_side = next(
        node for node in ast.parse(source).body if isinstance(node, ast.ClassDef) and node.name == "Faults"
    )
    fields = [
        (n.target.id, ast.unparse(n.annotation)) for n in model_side.body if isinstance(n, ast.AnnAssign)
    ]
    table = [
        (k.field, k.type.__name__ if not k.streaming else f"{k.type.__name__} | None") for k in faults.KNOBS
    ]
    assert fields == table
    assert tuple(f for f, _ in fields) == tuple(faults.Fault.__dataclass_fields__)
    assert f'INJECTED = "{faults.INJECTED}"' in source
    assert INFO.max_tokens_limit == faults.MAX_TOKENS


def test_streaming_fault_cli(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = cli.main(
        ["fault", "set", "--model", MODEL, "--version", "2", "--ttft-ms", "250", "--per-token-ms", "40",
         "--error-after-tokens", "5", "--state-dir", str(tmp_path)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "time to first token 250 ms, 40 ms per token, error after 5 tokens" in out
    written = json.loads((tmp_path / "faults" / f"{MODEL}@2.json").read_text())
    assert written == {
        "error_rate": 0.0, "extra_latency_ms": 0.0, "ttft_ms": 250.0, "per_token_ms": 40.0,
        "error_after_tokens": 5,
    }  # fmt: skip
    assert faults.active(tmp_path) == {f"{MODEL}@2": faults.Fault(0.0, 0.0, 250.0, 40.0, 5)}
    assert cli.main(["fault", "list", "--state-dir", str(tmp_path)]) == 0
    assert "error after 5 tokens" in capsys.readouterr().out
    for args, words in (
        (["--model", "ranker", "--ttft-ms", "5"], "--ttft-ms: only token-streaming models"),
        (["--model", MODEL, "--error-after-tokens", "2.5"], "whole number"),
        (["--model", MODEL, "--error-after-tokens", "-1"], "--error-after-tokens must be between 0"),
        (["--model", MODEL, "--per-token-ms", "-1"], "--per-token-ms must be between 0"),
        (["--model", MODEL, "--ttft-ms", "nan"], "--ttft-ms must be a number"),
        (["--model", MODEL], "--error-after-tokens"),
    ):
        code = cli.main(["fault", "set", *args, "--state-dir", str(tmp_path / "refused")])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("inferwatch: error:") and words in err, (args, err)
        assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "refused").exists()
    # A file written by hand with an unknown kind is left out of the list, not misread.
    (tmp_path / "faults" / "ranker.json").write_text('{"error_rate": 0.1, "typo_ms": 3}')
    assert set(faults.active(tmp_path)) == {f"{MODEL}@2"}
