"""The sidecar's HTTP proxy against the real Triton: what clients get through it equals what
they get directly, its counters equal what the clients saw, and bad or slow clients get
their answers while the sidecar stays healthy."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
import uuid
from collections import Counter

import httpx
import numpy as np
import pytest
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

from inferwatch import contract
from inferwatch.spec import load_spec
from reference_server.catalog import example_input
from tests.fixtures.net import inferwatch_cmd
from tests.fixtures.sidecar import FLEET

pytestmark = pytest.mark.integration

REQUESTS = contract.REQUESTS_TOTAL.name
KEYS = ("model", "version", "code", "outcome")


def http_counts(sidecar) -> Counter:
    out: Counter = Counter()
    for labels, value in sidecar.samples(REQUESTS):
        if labels["protocol"] == contract.PROTOCOL_HTTP:
            out[tuple(labels[k] for k in KEYS)] += value
    return out


def delta(after: Counter, before: Counter) -> Counter:
    return Counter({k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)})


def infer_inputs(model: str, binary: bool, batch: int = 1, seed: int = 3) -> list[thttp.InferInput]:
    inputs = []
    for name, array in example_input(model, batch, seed=seed).items():
        inp = thttp.InferInput(name, list(array.shape), "FP32")
        inp.set_data_from_numpy(array, binary_data=binary)
        inputs.append(inp)
    return inputs


def raw_exchange(
    port: int, data: bytes, pause_after: float = 0.0, more: bytes = b"", timeout: float = 10.0
) -> bytes:
    """Send raw bytes (optionally pause, then send more) and read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except OSError:
            pass  # the server answered early and stopped reading; its answer is still readable
        if pause_after:
            time.sleep(pause_after)
        if more:
            try:
                s.sendall(more)
            except OSError:
                pass
        chunks = []
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
        except (TimeoutError, ConnectionResetError):
            pass
        return b"".join(chunks)


# --------------------------------------------------------------------------------------------
def test_tritonclient_results_identical_through_the_sidecar(triton, sidecar) -> None:
    direct = thttp.InferenceServerClient(triton.http_url)
    proxied = thttp.InferenceServerClient(sidecar.http_url)
    cases = [
        ("ranker", "1", False, 1),
        ("ranker", "1", True, 3),
        ("ranker", "2", True, 2),
        ("dense_batched", "", True, 2),  # binary tensor extension, 32 KiB per row
        ("dense_unbatched", "", False, 1),  # 4096 floats as JSON
    ]
    for model, version, binary, batch in cases:
        results = []
        for client in (direct, proxied):
            r = client.infer(model, infer_inputs(model, binary, batch), model_version=version)
            out = r.get_response()["outputs"][0]["name"]
            results.append(r.as_numpy(out))
        assert results[0].shape == results[1].shape
        assert np.array_equal(results[0], results[1]), (model, version, binary)
    for call in ("get_model_metadata", "get_model_config"):
        assert getattr(direct, call)("ranker") == getattr(proxied, call)("ranker")
    assert direct.get_model_repository_index() == proxied.get_model_repository_index()
    assert proxied.is_server_ready() and proxied.is_model_ready("ranker", "2")
    with pytest.raises(InferenceServerException) as d_err:
        direct.infer("no_such_model", infer_inputs("ranker", False))
    with pytest.raises(InferenceServerException) as p_err:
        proxied.infer("no_such_model", infer_inputs("ranker", False))
    assert str(d_err.value) == str(p_err.value)


def test_bodies_pass_byte_for_byte_chunked_and_binary(triton, sidecar) -> None:
    """A chunked request body, and Triton's binary tensor answer, arrive unchanged."""
    x = example_input("ranker", 2, seed=11)["FEATURES"]
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "FEATURES",
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "outputs": [{"name": "SCORES", "parameters": {"binary_data": True}}],
        }
    ).encode()
    body = header + x.tobytes()
    headers = {
        "Inference-Header-Content-Length": str(len(header)),
        "Content-Type": "application/octet-stream",
    }
    url = "/v2/models/ranker/versions/1/infer"
    direct = httpx.post(f"http://{triton.http_url}{url}", content=body, headers=headers)
    via_len = httpx.post(f"{sidecar.base_url}{url}", content=body, headers=headers)

    def pieces():
        for i in range(0, len(body), 1000):  # no Content-Length: httpx sends it chunked
            yield body[i : i + 1000]

    via_chunked = httpx.post(f"{sidecar.base_url}{url}", content=pieces(), headers=headers)
    assert direct.status_code == via_len.status_code == via_chunked.status_code == 200
    assert direct.content == via_len.content == via_chunked.content
    assert (
        direct.headers["inference-header-content-length"]
        == via_len.headers["inference-header-content-length"]
    )
    assert "1.1 inferwatch" in via_len.headers["via"]


def test_counters_equal_what_the_client_saw(triton, sidecar) -> None:
    """Known traffic: successes, injected server errors, unknown models, bad requests."""
    seen: Counter = Counter()
    good = {"inputs": [{"name": "FEATURES", "shape": [1, 16, 32], "datatype": "FP32", "data": [0.5] * 512}]}
    bad = {"inputs": [{"name": "FEATURES", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}
    before = http_counts(sidecar)

    def send(client: httpx.Client, model: str, version: str, body: dict, label: str) -> None:
        path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
        r = client.post(path, json=body)
        code = str(r.status_code)
        outcome = (
            "success" if r.status_code < 400 else "server_error" if r.status_code >= 500 else "client_error"
        )
        seen[(label, version if label != contract.MODEL_OVERFLOW else "", code, outcome)] += 1

    with httpx.Client(base_url=sidecar.base_url, timeout=30) as client:
        for _ in range(12):
            send(client, "ranker", "1", good, "ranker")
        for _ in range(5):
            send(client, "ranker", "1", bad, "ranker")
        for i in range(4):
            send(client, f"not_served_{i}", "", good, contract.MODEL_OVERFLOW)
        cli = inferwatch_cmd(
            "fault",
            "set",
            "--model",
            "ranker",
            "--version",
            "1",
            "--error-rate",
            "1",
            "--state-dir",
            str(triton.state_dir),
        )
        subprocess.run(cli, check=True, capture_output=True)
        try:
            for _ in range(6):
                send(client, "ranker", "1", good, "ranker")
        finally:
            subprocess.run(
                inferwatch_cmd("fault", "clear", "--model", "ranker", "--state-dir", str(triton.state_dir)),
                check=True,
                capture_output=True,
            )
    assert seen[("ranker", "1", "200", "success")] == 12
    assert seen[("ranker", "1", "500", "server_error")] == 6
    assert seen[("ranker", "1", "400", "client_error")] == 5
    assert seen[(contract.MODEL_OVERFLOW, "", "404", "client_error")] == 4
    assert delta(http_counts(sidecar), before) == seen


def test_random_model_names_keep_series_bounded(triton, sidecar) -> None:
    """10,000 requests for random model names land in the one overflow value."""
    n_conns, per_conn = 10, 1000
    before = http_counts(sidecar)

    async def worker() -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", sidecar.http_port)
        done = 0
        for _ in range(per_conn):
            name = uuid.uuid4().hex
            writer.write(
                f"POST /v2/models/{name}/versions/{done % 97}/infer HTTP/1.1\r\nHost: x\r\n"
                "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}".encode()
            )
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            assert head.startswith(b"HTTP/1.1 404"), head
            done += 1
        writer.close()
        return done

    async def main() -> int:
        return sum(await asyncio.gather(*(worker() for _ in range(n_conns))))

    assert asyncio.run(main()) == 10_000
    grown = delta(http_counts(sidecar), before)
    assert grown == {(contract.MODEL_OVERFLOW, contract.MODEL_OVERFLOW, "404", "client_error"): 10_000}
    text = httpx.get(sidecar.metrics_url).text
    models = {line.split('model="')[1].split('"')[0] for line in text.splitlines() if 'model="' in line}
    served = {m["name"] for m in httpx.post(f"http://{triton.http_url}/v2/repository/index").json()}
    listed = {m.name for m in load_spec(FLEET).models}  # the spec's models have labels from the start
    assert models <= served | listed | {contract.MODEL_OVERFLOW, contract.MODEL_NONE}
    assert len(text.splitlines()) < 3000  # a fixed handful of series, not one per name
    assert "_created" not in text  # unused by Prometheus 2.x: no series spent on it


def test_malformed_oversized_and_slow_clients_get_answers(sidecar) -> None:
    port = sidecar.http_port
    before = http_counts(sidecar)

    def status(raw: bytes) -> int:
        return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.") else 0

    # Malformed request line: 400, then the connection closes.
    assert status(raw_exchange(port, b"THIS IS NOT HTTP\r\n\r\n")) == 400
    assert status(raw_exchange(port, b"GET / HTTP/1.1\r\nBad Header Without Colon\r\n\r\n")) == 400
    # Head over --max-header-bytes (16 KiB): 431, in one piece or trickled.
    big = b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n"
    assert status(raw_exchange(port, big)) == 431
    assert status(raw_exchange(port, big[:10000], 0.2, big[10000:])) == 431
    # Body over --max-body-bytes (4 MiB): 413 from the Content-Length, and mid-stream when chunked.
    head = b"POST /v2/models/ranker/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (5 << 20)
    assert status(raw_exchange(port, head)) == 413
    chunk = b"100000\r\n" + b"x" * 0x100000 + b"\r\n"
    chunked = b"POST /v2/models/ranker/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert status(raw_exchange(port, chunked + chunk * 5 + b"0\r\n\r\n")) == 413
    # Slow clients (--header-timeout / --body-timeout 2 s): 408 and close.
    started = time.monotonic()
    assert status(raw_exchange(port, b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n")) == 408
    assert (
        status(raw_exchange(port, b"POST /v2/models/ranker/infer HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"))
        == 408
    )
    assert time.monotonic() - started < 10
    # A connection that never sends a byte is closed without an answer.
    assert raw_exchange(port, b"") == b""

    grown = delta(http_counts(sidecar), before)
    assert grown[("", "", "400", "client_error")] == 2
    assert grown[("", "", "431", "client_error")] == 2
    assert grown[("ranker", "", "413", "client_error")] == 2
    assert grown[("", "", "408", "client_error")] == 1
    assert grown[("ranker", "", "408", "client_error")] == 1
    assert sum(grown.values()) == 8
    # Still healthy, still proxying, nothing left in flight.
    assert httpx.get(sidecar.health_url).status_code == 200
    assert httpx.get(f"{sidecar.base_url}/v2/health/ready").status_code == 200
    in_flight = sidecar.samples(contract.REQUESTS_IN_FLIGHT.name)
    assert all(v == 0 for _, v in in_flight)


def test_pipelined_requests_answered_in_order(sidecar) -> None:
    """Pipelined requests on one connection are answered in order; only the last one closes it."""
    reqs = (
        b"".join(
            b"GET /v2/models/ranker/versions/%d HTTP/1.1\r\nHost: x\r\nKeep-Alive: timeout=5\r\n"
            b"Connection: keep-alive, X-Hop\r\nX-Hop: secret\r\n\r\n" % v
            for v in (1, 2, 1)
        )
        + b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    raw = raw_exchange(sidecar.http_port, reqs)
    assert raw.count(b"HTTP/1.1 200 OK") == 4
    bodies = [
        json.loads(part.split(b"\r\n\r\n", 1)[1].split(b"HTTP/1.1")[0])
        for part in raw.split(b"HTTP/1.1 200 OK")[1:4]
    ]
    assert [b["versions"] for b in bodies] in ([["1", "2"]] * 3, [["1"], ["2"], ["1"]])
    assert raw.lower().count(b"connection: close") == 1
    assert raw.lower().rindex(b"connection: close") > raw.rindex(b"HTTP/1.1 200 OK")


def test_tracing_continues_the_client_trace_and_marks_exemplars(triton, tmp_path) -> None:
    """Two sidecars in a chain (tracing on, console exporter): the second one's span is a child
    of the first one's, so the traceparent was continued and forwarded; exemplars carry it."""
    from tests.fixtures.sidecar import launch_sidecar

    env = {"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with (
        launch_sidecar(
            triton.http_url,
            triton.grpc_url,
            tmp_path,
            "--trace-sample-ratio",
            "1",
            "--grpc-port",
            "0",
            env=env,
            name="inner",
        ) as inner,
        launch_sidecar(
            inner.http_url,
            triton.grpc_url,
            tmp_path,
            "--trace-sample-ratio",
            "1",
            "--grpc-port",
            "0",
            env=env,
            name="outer",
        ) as outer,
    ):
        path = "/v2/models/ranker/versions/1"
        r = httpx.get(
            f"{outer.base_url}{path}",
            headers={"traceparent": f"00-{trace_id}-{parent}-01"},
        )
        assert r.status_code == 200
        text = httpx.get(outer.metrics_url, headers={"Accept": "application/openmetrics-text"}).text
        assert f'trace_id="{trace_id}"' in text
        deadline = time.monotonic() + 10
        spans: dict[str, dict] = {}
        while time.monotonic() < deadline and len(spans) < 2:
            for name, info in (("outer", outer), ("inner", inner)):
                for line in info.log().splitlines():
                    if line.startswith("{") and '"trace_id"' in line and "context" in line:
                        span = json.loads(line)
                        # Only this request's span: the inner sidecar also serves the outer
                        # one's model-index reads, each a trace of its own.
                        if span["attributes"].get("url.path") == path:
                            spans[name] = span
            time.sleep(0.2)
    assert set(spans) == {"outer", "inner"}
    o, i = spans["outer"], spans["inner"]
    assert o["context"]["trace_id"] == i["context"]["trace_id"] == "0x" + trace_id
    assert o["parent_id"] == "0x" + parent
    assert i["parent_id"] == o["context"]["span_id"]
    assert o["kind"] == "SpanKind.SERVER"
    assert o["name"] == "GET /v2/models/{model}/versions/{version}"
    assert o["attributes"]["http.request.method"] == "GET"
    assert o["attributes"]["http.response.status_code"] == 200
    assert o["attributes"]["inferwatch.model"] == "ranker"
    assert o["attributes"]["inferwatch.model_version"] == "1"


def test_expect_continue_and_head(triton, sidecar) -> None:
    """``Expect: 100-continue`` is answered by the sidecar; a HEAD answer has no body and the
    connection stays usable."""
    body = json.dumps(
        {"inputs": [{"name": "FEATURES", "shape": [1, 16, 32], "datatype": "FP32", "data": [0.5] * 512}]}
    ).encode()
    with socket.create_connection(("127.0.0.1", sidecar.http_port), timeout=10) as s:
        s.sendall(
            b"POST /v2/models/ranker/versions/1/infer HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n"
            % len(body)
        )
        assert s.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(body)
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(65536)
        assert head.startswith(b"HTTP/1.1 200 OK"), head
    direct = httpx.head(f"http://{triton.http_url}/v2/health/ready")
    with httpx.Client(base_url=sidecar.base_url) as client:
        first = client.head("/v2/health/ready")
        second = client.get("/v2/models/ranker/versions/1")
    assert first.status_code == direct.status_code and first.content == b""
    assert second.status_code == 200 and second.json()["name"] == "ranker"


def test_random_garbage_leaves_the_sidecar_healthy(sidecar) -> None:
    """Fuzz: mangled requests (random bytes, truncated and corrupted valid requests) each get an
    answer or a close, never an internal error, and nothing stays in flight."""
    import random

    rng = random.Random(1234)
    valid = (
        b"POST /v2/models/ranker/versions/1/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 2\r\n\r\n{}"
    )
    cases = []
    for _ in range(60):
        cases.append(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))))
        cut = valid[: rng.randrange(1, len(valid))]
        cases.append(cut + b"\r\n\r\n")
        mangled = bytearray(valid)
        for _ in range(rng.randrange(1, 6)):
            mangled[rng.randrange(len(mangled))] = rng.randrange(256)
        cases.append(bytes(mangled) + b"\r\n\r\n")
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(30) as pool:  # truncated ones wait out the 2 s slow-client timeouts
        answers = list(pool.map(lambda data: raw_exchange(sidecar.http_port, data, timeout=8), cases))
    for data, raw in zip(cases, answers, strict=True):
        assert raw == b"" or raw.startswith(b"HTTP/1.1 "), raw[:100]
        assert b" 502 " not in raw[:20], (data, raw[:200])
    assert httpx.get(sidecar.health_url).status_code == 200
    assert httpx.get(f"{sidecar.base_url}/v2/health/ready").status_code == 200
    assert "internal error" not in sidecar.log() and "Traceback" not in sidecar.log()
    deadline = time.monotonic() + 10
    while (
        any(v for _, v in sidecar.samples(contract.REQUESTS_IN_FLIGHT.name)) and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert all(v == 0 for _, v in sidecar.samples(contract.REQUESTS_IN_FLIGHT.name))
