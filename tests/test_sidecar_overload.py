"""Per-model limits in the ``inferwatch sidecar`` process, in front of the real Triton.

A burst over a request bucket gets exactly the bucket's capacity admitted and the rest 429 with
``Retry-After`` (HTTP) or RESOURCE_EXHAUSTED (gRPC, both engines), the shed counter and the
requests counter match what the client saw, and Triton's own count shows the shed requests never
reached it. The concurrency cap's queue: a request waits for a slot and gets it when one frees,
waits too long (``queue_timeout``), or finds the queue full (``queue_full``). Requests are held
in flight with the token-streaming model (tiny_stream), as in test_sidecar_admission.py.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tritonclient.grpc as tgrpc
import yaml

from inferwatch import contract
from reference_server.catalog import example_input
from tests.fixtures.sidecar import launch_sidecar
from tests.test_sidecar_grpc import TRACEPARENT, InProcessProxy, infer_inputs, served_models, wait_for
from tests.test_sidecar_grpc import (
    loop as loop,  # the module's event-loop thread fixture
)

REQUESTS = contract.REQUESTS_TOTAL.name
SHED = contract.REQUESTS_SHED.name
STREAM_MODEL = "tiny_stream"
BURST = 12
CAPACITY = 5

pytestmark = pytest.mark.integration


def write_spec(tmp_path: Path, limits: dict[str, dict], name: str = "fleet.yaml") -> Path:
    models = [{"name": m, "latency_sla_ms": 500, "limits": lim} for m, lim in limits.items()]
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"models": models}))
    return path


def ranker_body() -> dict:
    x = example_input("ranker", batch=1)["FEATURES"]
    return {
        "inputs": [
            {"name": "FEATURES", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}
        ]
    }


def triton_success_count(triton, model: str) -> float:
    """Triton's own count of the model's successful inferences (nv_inference_request_success)."""
    text = httpx.get(triton.metrics_url, timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("nv_inference_request_success{") and f'model="{model}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def shed_counts(sc) -> dict[tuple[str, ...], float]:
    return sc.counts(SHED, "model", "reason")


def delta(after: dict, before: dict, key: tuple[str, ...]) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


# --------------------------------------------------------------------------- request bucket


def test_http_burst_over_the_bucket_gets_exactly_capacity_admitted(triton, tmp_path) -> None:
    # fill_rate 0.01/s: not one token comes back during the burst, so the split is exact.
    spec = write_spec(tmp_path, {"ranker": {"requests": {"capacity": CAPACITY, "fill_rate": 0.01}}})
    with launch_sidecar(triton.http_url, triton.grpc_url, tmp_path, "--spec", str(spec)) as sc:
        before_req = sc.counts(REQUESTS, "model", "protocol", "code")
        before_triton = triton_success_count(triton, "ranker")
        body = ranker_body()
        answers = []
        with httpx.Client(base_url=sc.base_url, timeout=30) as client:
            for _ in range(BURST):
                answers.append(client.post("/v2/models/ranker/versions/1/infer", json=body))
            other = client.post("/v2/models/dense_batched/infer", json=other_body())
        codes = [r.status_code for r in answers]
        assert codes == [200] * CAPACITY + [429] * (BURST - CAPACITY)
        for r in answers[CAPACITY:]:
            assert r.headers["retry-after"] == "100"  # 1 / fill_rate, whole seconds
            assert r.json()["reason"] == "requests"
        assert other.status_code == 200  # another model has no limits
        after_req = sc.counts(REQUESTS, "model", "protocol", "code")
        shed = shed_counts(sc)
        after_triton = triton_success_count(triton, "ranker")

    assert shed.get(("ranker", "requests")) == BURST - CAPACITY
    assert delta(after_req, before_req, ("ranker", "http", "429")) == BURST - CAPACITY
    assert delta(after_req, before_req, ("ranker", "http", "200")) == CAPACITY
    assert after_triton - before_triton == CAPACITY  # the shed requests cost the server nothing


def other_body() -> dict:
    x = example_input("dense_batched", batch=1)
    name, arr = next(iter(x.items()))
    return {
        "inputs": [{"name": name, "shape": list(arr.shape), "datatype": "FP32", "data": arr.ravel().tolist()}]
    }


@pytest.mark.parametrize("engine", ["relay", "aio"])
def test_grpc_burst_over_the_bucket_gets_exactly_capacity_admitted(triton, tmp_path, engine) -> None:
    spec = write_spec(tmp_path, {"ranker": {"requests": {"capacity": CAPACITY, "fill_rate": 0.01}}})
    with launch_sidecar(
        triton.http_url, triton.grpc_url, tmp_path, "--spec", str(spec), "--grpc-engine", engine
    ) as sc:
        before_req = sc.counts(REQUESTS, "model", "protocol", "code")
        before_triton = triton_success_count(triton, "ranker")
        client = tgrpc.InferenceServerClient(sc.grpc_url)
        x = example_input("ranker", batch=1)["FEATURES"]
        inp = tgrpc.InferInput("FEATURES", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        codes = []
        details = []
        for _ in range(BURST):
            try:
                client.infer("ranker", [inp], model_version="1")
                codes.append("OK")
            except Exception as exc:  # tritonclient wraps the RpcError
                status = getattr(exc, "status", lambda: None)()
                codes.append(str(status))
                details.append(str(exc))
        assert client.is_server_live()  # no model: not limited
        client.close()
        after_req = sc.counts(REQUESTS, "model", "protocol", "code")
        shed = shed_counts(sc)
        after_triton = triton_success_count(triton, "ranker")

    assert codes == ["OK"] * CAPACITY + ["StatusCode.RESOURCE_EXHAUSTED"] * (BURST - CAPACITY), details
    assert all("requests/s" in d for d in details)
    assert shed.get(("ranker", "requests")) == BURST - CAPACITY
    assert delta(after_req, before_req, ("ranker", "grpc", "RESOURCE_EXHAUSTED")) == BURST - CAPACITY
    assert delta(after_req, before_req, ("ranker", "grpc", "OK")) == CAPACITY
    assert after_triton - before_triton == CAPACITY


# --------------------------------------------------------------------------- tokens bucket


def generate_body(max_tokens: int | None) -> bytes:
    """A generate body (one answer: ``stream`` false) with or without max_tokens, compact."""
    body: dict = {"text_input": "a b", "stream": False}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return json.dumps(body, separators=(",", ":")).encode()


def test_http_tokens_bucket_charges_max_tokens_and_sheds_the_next_burst_request(triton, tmp_path) -> None:
    """The body is read before admission: a bucket of 5 requests' worth of tokens (each request's
    charge: ceil(body bytes / 4) + max_tokens) admits 5 of a burst and sheds the 6th on, reason
    ``tokens``; a request without max_tokens is charged the documented default."""
    m = 40
    body = generate_body(m)
    cost = -(-len(body) // 4) + m
    capacity = 5 * cost
    spec = write_spec(tmp_path, {STREAM_MODEL: {"tokens": {"capacity": capacity, "fill_rate": 0.01}}})
    path = f"/v2/models/{STREAM_MODEL}/versions/1/generate"
    headers = {"content-type": "application/json"}
    with launch_sidecar(triton.http_url, triton.grpc_url, tmp_path, "--spec", str(spec)) as sc:
        before_req = sc.counts(REQUESTS, "model", "protocol", "code")
        before_triton = triton_success_count(triton, STREAM_MODEL)
        with httpx.Client(base_url=sc.base_url, timeout=30) as client:
            answers = [client.post(path, content=body, headers=headers) for _ in range(8)]
            # max_tokens stays charged for a chunked body too (no Content-Length)
            chunked = client.post(path, content=iter([body[:10], body[10:]]), headers=headers)
        after_req = sc.counts(REQUESTS, "model", "protocol", "code")
        shed = shed_counts(sc)
        after_triton = triton_success_count(triton, STREAM_MODEL)
        in_flight = sc.counts(contract.REQUESTS_IN_FLIGHT.name, "model")

    codes = [r.status_code for r in answers]
    assert codes == [200] * 5 + [429] * 3, [r.text for r in answers]
    assert len(answers[0].json()["text_output"].split()) == m  # admitted requests are served whole
    for r in answers[5:]:
        assert r.headers["retry-after"] == "100"  # 1 / fill_rate
        assert r.json()["reason"] == "tokens"
        assert "tokens/s" in r.json()["error"]
    assert chunked.status_code == 429 and chunked.json()["reason"] == "tokens"
    assert shed.get((STREAM_MODEL, "tokens")) == 4
    assert delta(after_req, before_req, (STREAM_MODEL, "http", "429")) == 4
    assert delta(after_req, before_req, (STREAM_MODEL, "http", "200")) == 5
    assert after_triton - before_triton == 5  # the shed requests never reached Triton
    assert all(v == 0 for v in in_flight.values()), in_flight


def test_http_tokens_bucket_charges_the_default_without_max_tokens(triton, tmp_path) -> None:
    from sidecar.apis.charge import DEFAULT_MAX_TOKENS

    body = generate_body(None)
    cost = -(-len(body) // 4) + DEFAULT_MAX_TOKENS
    spec = write_spec(tmp_path, {STREAM_MODEL: {"tokens": {"capacity": 2 * cost, "fill_rate": 0.01}}})
    path = f"/v2/models/{STREAM_MODEL}/versions/1/generate"
    with launch_sidecar(triton.http_url, triton.grpc_url, tmp_path, "--spec", str(spec)) as sc:
        with httpx.Client(base_url=sc.base_url, timeout=30) as client:
            codes = [client.post(path, content=body).status_code for _ in range(3)]
        shed = shed_counts(sc)
    assert codes == [200, 200, 429]
    assert shed.get((STREAM_MODEL, "tokens")) == 1


def test_http_held_bodies_bad_input_gets_todays_answers_and_leaks_nothing(triton, tmp_path) -> None:
    """With a tokens bucket the body is held before admission. Malformed JSON, a body over
    --max-body-bytes (declared or sent), a client that stalls mid-body (408) or leaves mid-body,
    and a body over the hold window (decided at the window, not stuck behind backpressure) each
    get today's answer; after them the one global slot and the model's one slot are free."""
    from sidecar.apis.charge import WINDOW

    spec = write_spec(
        tmp_path,
        {STREAM_MODEL: {"tokens": {"capacity": 10**9, "fill_rate": 10**9}, "concurrency": 1, "queue": 0}},
    )
    path = f"/v2/models/{STREAM_MODEL}/versions/1/generate"
    max_body = 2 * WINDOW
    args = (
        "--spec",
        str(spec),
        "--body-timeout",
        "1",
        "--max-in-flight",
        "1",
        "--max-body-bytes",
        str(max_body),
    )
    malformed = b'{"text_input": "a", "stream": false, "max_tokens": 2'
    direct = httpx.post(f"http://{triton.http_url}{path}", content=malformed, timeout=30)
    with launch_sidecar(triton.http_url, triton.grpc_url, tmp_path, *args) as sc:
        bad = httpx.post(sc.base_url + path, content=malformed, timeout=30)
        too_big = httpx.post(sc.base_url + path, content=b"x" * (max_body + 1), timeout=30)
        head = b"POST %b HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{" % path.encode()
        with socket.create_connection(("127.0.0.1", sc.http_port), timeout=10) as conn:
            conn.sendall(head)
            stalled = conn.recv(4096)
        with socket.create_connection(("127.0.0.1", sc.http_port), timeout=10) as conn:
            conn.sendall(head)
            time.sleep(0.3)
        # Past the window before max_tokens: decided at the window, the rest streams upstream.
        words = "a " * ((WINDOW + 65536) // 2)
        big = httpx.post(
            sc.base_url + path, json={"text_input": words, "stream": False, "max_tokens": 3}, timeout=60
        )
        time.sleep(0.3)
        ok = httpx.post(sc.base_url + path, content=generate_body(2), timeout=30)
        in_flight = sc.counts(contract.REQUESTS_IN_FLIGHT.name, "model")
        log = sc.log()

    assert (bad.status_code, bad.content) == (direct.status_code, direct.content), bad.text
    assert direct.status_code >= 400  # Triton refuses it (500 for a cut body, as it answers directly)
    assert too_big.status_code == 413
    assert stalled.startswith(b"HTTP/1.1 408"), stalled
    assert big.status_code == 200 and len(big.json()["text_output"].split()) == 3, big.text
    assert ok.status_code == 200, ok.text  # no global slot, model slot or queue entry leaked
    assert all(v == 0 for v in in_flight.values()), in_flight
    assert "internal error" not in log and "Traceback" not in log


def read_answers(conn: socket.socket, n: int) -> list[tuple[int, bytes]]:
    """``n`` HTTP/1.1 answers (any framing) from a raw connection: (status, body); 1xx skipped."""
    import httptools

    out: list[tuple[int, bytes]] = []
    body: list[bytes] = []

    class Parser:
        def on_body(self, data: bytes) -> None:
            body.append(data)

        def on_message_complete(self) -> None:
            status = parser.get_status_code()
            if status >= 200:
                out.append((status, b"".join(body)))
            body.clear()

    parser = httptools.HttpResponseParser(Parser())
    while len(out) < n:
        chunk = conn.recv(65536)
        assert chunk, out
        parser.feed_data(chunk)
    return out


def test_http_held_bodies_pipelined_and_expect_continue(triton, tmp_path) -> None:
    """Two held requests pipelined in one write are answered in order; a client that waits for
    100-continue gets it (the body is needed before admission), then its answer."""
    spec = write_spec(tmp_path, {STREAM_MODEL: {"tokens": {"capacity": 10**6, "fill_rate": 10**6}}})
    path = f"/v2/models/{STREAM_MODEL}/versions/1/generate".encode()

    def request(max_tokens: int, extra: bytes = b"") -> tuple[bytes, bytes]:
        body = generate_body(max_tokens)
        head = b"POST %b HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n%b\r\n" % (path, len(body), extra)
        return head, body

    with launch_sidecar(triton.http_url, triton.grpc_url, tmp_path, "--spec", str(spec)) as sc:
        with socket.create_connection(("127.0.0.1", sc.http_port), timeout=30) as conn:
            conn.sendall(b"".join(request(2)) + b"".join(request(3)))
            pipelined = read_answers(conn, 2)
            head, body = request(4, b"expect: 100-continue\r\n")
            conn.sendall(head)
            assert conn.recv(4096).startswith(b"HTTP/1.1 100 Continue")
            conn.sendall(body)
            expected = read_answers(conn, 1)
        in_flight = sc.counts(contract.REQUESTS_IN_FLIGHT.name, "model")

    assert [(s, len(json.loads(b)["text_output"].split())) for s, b in pipelined] == [(200, 2), (200, 3)]
    assert expected[0][0] == 200 and len(json.loads(expected[0][1])["text_output"].split()) == 4
    assert all(v == 0 for v in in_flight.values()), in_flight


# --------------------------------------------------------------------------- concurrency and queue


@contextlib.contextmanager
def held_stream(client: httpx.Client) -> Iterator[None]:
    """One generate_stream request whose first token arrived and whose end is far away."""
    with client.stream(
        "POST",
        f"/v2/models/{STREAM_MODEL}/versions/1/generate_stream",
        json={"text_input": "a b", "max_tokens": 4096},
    ) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        next(lines)
        yield


def short_generate(base_url: str, out: list) -> None:
    t0 = time.monotonic()
    r = httpx.post(
        f"{base_url}/v2/models/{STREAM_MODEL}/versions/1/generate",
        json={"text_input": "a", "max_tokens": 1},
        timeout=30,
    )
    out.append((r.status_code, r.headers.get("retry-after"), r.text, time.monotonic() - t0))


def test_http_queue_waits_for_a_slot_times_out_and_fills(triton, tmp_path) -> None:
    limits = {"concurrency": 1, "queue": 1, "queue_timeout_ms": 1500}
    spec = write_spec(tmp_path, {STREAM_MODEL: limits})
    with launch_sidecar(triton.http_url, triton.grpc_url, tmp_path, "--spec", str(spec)) as sc:
        before = sc.counts(REQUESTS, "model", "code")
        with httpx.Client(base_url=sc.base_url, timeout=30) as client:
            # 1. The slot frees while a request waits: it is served.
            waited: list = []
            with held_stream(client):
                t = threading.Thread(target=short_generate, args=(sc.base_url, waited))
                t.start()
                time.sleep(0.5)
                assert not waited  # queued, not answered
            t.join(30)
            assert waited and waited[0][0] == 200, waited

            # 2. The slot stays taken: the waiter is shed after queue_timeout_ms, and a third
            # request meanwhile finds the queue full.
            timed_out: list = []
            full: list = []
            with held_stream(client):
                t = threading.Thread(target=short_generate, args=(sc.base_url, timed_out))
                t.start()
                time.sleep(0.5)
                short_generate(sc.base_url, full)
                t.join(30)
        after = sc.counts(REQUESTS, "model", "code")
        shed = shed_counts(sc)

    status, retry, text, _ = full[0]
    assert status == 429 and retry == "1" and "queue_full" in text
    status, retry, text, elapsed = timed_out[0]
    assert status == 429 and retry == "1" and "queue_timeout" in text
    assert elapsed >= 1.4
    assert shed.get((STREAM_MODEL, "queue_full")) == 1
    assert shed.get((STREAM_MODEL, "queue_timeout")) == 1
    assert delta(after, before, (STREAM_MODEL, "429")) == 2
    assert delta(after, before, (STREAM_MODEL, "200")) == 1  # the waiter that got its slot
    assert delta(after, before, (STREAM_MODEL, "499")) == 2  # the held streams, left by the client


# --------------------------------------------------------------------------- SIGHUP


def burst(base_url: str, n: int) -> list[int]:
    body = ranker_body()
    with httpx.Client(base_url=base_url, timeout=30) as client:
        return [client.post("/v2/models/ranker/versions/1/infer", json=body).status_code for _ in range(n)]


def test_sighup_changes_limits_under_load_and_a_bad_spec_keeps_them(triton, tmp_path) -> None:
    generous = {"ranker": {"requests": {"capacity": 100000, "fill_rate": 100000}}}
    strict = {"ranker": {"requests": {"capacity": 2, "fill_rate": 0.01}}}
    spec = write_spec(tmp_path, generous)
    with launch_sidecar(triton.http_url, triton.grpc_url, tmp_path, "--spec", str(spec)) as sc:
        stop = threading.Event()
        seen: list[object] = []

        def http_load() -> None:
            body = ranker_body()
            with httpx.Client(base_url=sc.base_url, timeout=30) as client:
                while not stop.is_set():
                    try:
                        seen.append(client.post("/v2/models/ranker/versions/1/infer", json=body).status_code)
                    except httpx.HTTPError as exc:
                        seen.append(repr(exc))

        def grpc_load() -> None:
            client = tgrpc.InferenceServerClient(sc.grpc_url)  # one channel across the reloads
            x = example_input("ranker", batch=1)["FEATURES"]
            inp = tgrpc.InferInput("FEATURES", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            while not stop.is_set():
                try:
                    client.infer("ranker", [inp], model_version="1")
                    seen.append("OK")
                except Exception as exc:  # tritonclient wraps the RpcError
                    status = getattr(exc, "status", None)
                    seen.append(str(status()) if status else repr(exc))
            client.close()

        threads = [threading.Thread(target=f) for f in (http_load, grpc_load)]
        # A stream of a model without limits, open across both reloads.
        with (
            httpx.Client(base_url=sc.base_url, timeout=60) as held_client,
            held_client.stream(
                "POST",
                f"/v2/models/{STREAM_MODEL}/versions/1/generate_stream",
                json={"text_input": "a b", "max_tokens": 4096},
            ) as held,
        ):
            lines = held.iter_lines()
            next(lines)
            for t in threads:
                t.start()
            time.sleep(1.0)
            assert set(seen) == {200, "OK"}, set(seen)  # generous: everything admitted

            write_spec(tmp_path, strict)
            sc.proc.send_signal(signal.SIGHUP)
            wait_for_log(sc, "spec reloaded", 1)
            time.sleep(1.0)
            strict_seen = len(seen)
            time.sleep(1.0)
            after_strict = set(seen[strict_seen:])
            # The bucket is empty under this load: every request is shed now.
            assert after_strict and after_strict <= {429, "StatusCode.RESOURCE_EXHAUSTED"}, after_strict

            (tmp_path / "fleet.yaml").write_text(
                yaml.safe_dump(
                    {"models": [{"name": "ranker", "latency_sla_ms": 500, "limits": {"queue": 3}}]}
                )
            )
            sc.proc.send_signal(signal.SIGHUP)
            wait_for_log(sc, "spec reload refused", 1)
            bad_seen = len(seen)
            time.sleep(1.0)
            stop.set()
            for t in threads:
                t.join(30)
            after_bad = set(seen[bad_seen:])
            assert after_bad and after_bad <= {429, "StatusCode.RESOURCE_EXHAUSTED"}, after_bad
            assert burst(sc.base_url, 3) == [429] * 3  # the strict limits stayed
            for _ in range(3):
                next(lines)  # the held stream still flows
        log = sc.log()

    # Nothing but answers: no admitted request failed and no connection broke.
    assert set(seen) <= {200, "OK", 429, "StatusCode.RESOURCE_EXHAUSTED"}, set(seen)
    assert "models[0].limits.queue: a queue waits for a concurrency slot" in log


def wait_for_log(sc, text: str, count: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while sc.log().count(text) < count:
        assert time.monotonic() < deadline, f"no {text!r} in the sidecar's log:\n{sc.log()[-2000:]}"
        time.sleep(0.05)


# --------------------------------------------------------------------------- relay with tracing


def test_relay_with_tracing_holds_for_the_model_and_traces_admitted_and_shed_calls(loop, triton) -> None:
    """The relay's two reasons to hold a header block at once: tracing and per-model limits. An
    admitted call carries the proxy's span context upstream (its span is a child of the
    client's); a shed call's span ends RESOURCE_EXHAUSTED; the split is exact."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from inferwatch.spec import parse_spec
    from sidecar.core.admission import Admission

    spec = parse_spec(
        {
            "models": [
                {
                    "name": "ranker",
                    "latency_sla_ms": 100,
                    "limits": {"requests": {"capacity": 3, "fill_rate": 0.01}},
                }
            ]
        }
    )
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    p = InProcessProxy(loop, "relay", triton.grpc_url, tracer=provider.get_tracer("test"))
    p.proxy.admission = Admission(0, spec.limits_for, p.telemetry.model_label, p.registry)
    p.serve_models(served_models(triton.grpc_url))
    try:
        client = tgrpc.InferenceServerClient(p.url)
        assert client.is_server_live()
        time.sleep(0.2)  # the served models reach the telemetry's catalog
        exporter.clear()
        codes = []
        for _ in range(6):
            try:
                client.infer(
                    "ranker", infer_inputs("ranker"), model_version="1", headers={"traceparent": TRACEPARENT}
                )
                codes.append("OK")
            except Exception as exc:
                codes.append(str(exc.status()))  # type: ignore[attr-defined]
        client.close()
        spans = wait_for(lambda: (s := exporter.get_finished_spans()) and len(s) >= 6 and s, what="six spans")
    finally:
        p.close()
        provider.shutdown()

    assert codes == ["OK"] * 3 + ["StatusCode.RESOURCE_EXHAUSTED"] * 3
    statuses = [s.attributes["rpc.grpc.status_code"] for s in spans]
    assert statuses == [0] * 3 + [8] * 3  # 8: RESOURCE_EXHAUSTED
    assert all(format(s.context.trace_id, "032x") == TRACEPARENT.split("-")[1] for s in spans)
    assert p.count("ranker", "RESOURCE_EXHAUSTED", "server_error", "1") == 3
    assert p.registry.get_sample_value(SHED, {"model": "ranker", "reason": "requests"}) == 3
