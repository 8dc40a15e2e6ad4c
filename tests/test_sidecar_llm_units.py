"""The LLM plumbing without sockets: which API a path speaks, the body's model relabelling a
request (in-flight gauge included), served names, the hooks into the contract's series, and the
outcomes of a stream that errs, is cut, or whose client leaves before or after ``[DONE]``."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics

from inferwatch import contract as c
from inferwatch.spec import load_spec
from sidecar.apis import routes
from sidecar.config import SidecarConfig
from sidecar.core.streams import StreamTelemetry
from sidecar.core.telemetry import Telemetry

ROOT = Path(__file__).resolve().parents[1]
STREAMS = ROOT / "tests" / "fixtures" / "llm_streams"
SSE = b"text/event-stream; charset=utf-8"


@pytest.mark.parametrize(
    ("path", "route", "operation"),
    [
        (b"/v1/chat/completions", "/v1/chat/completions", "chat"),
        (b"/v1/chat/completions/", "/v1/chat/completions", "chat"),
        (b"/v1/completions", "/v1/completions", "text_completion"),
        (b"/v1/embeddings", "/v1/embeddings", "embeddings"),
        (b"/v1/models", "/v1/models", ""),
        (b"/v2/models/tiny_stream/generate", "/v2/models/{model}/generate", "generate"),
        (
            b"/v2/models/m/versions/2/generate_stream",
            "/v2/models/{model}/versions/{version}/generate_stream",
            "generate",
        ),
    ],
)
def test_classify(path: bytes, route: str, operation: str) -> None:
    api = routes.classify(path)
    assert api is not None and (api.route, api.operation) == (route, operation)


@pytest.mark.parametrize(
    "path", [b"/v2/models/ranker/infer", b"/v2/health/ready", b"/v1/other", b"/metrics", b"/"]
)
def test_classify_leaves_other_paths_alone(path: bytes) -> None:
    assert routes.classify(path) is None


def _parts() -> tuple[CollectorRegistry, Telemetry, StreamTelemetry]:
    config = SidecarConfig(spec=load_spec(ROOT / "fleet.yaml"))
    registry = CollectorRegistry()
    tel = Telemetry(registry, config)
    streams = StreamTelemetry(registry, config, tel, routes.classify)
    tel.update_models(streams.served_models(["tiny-llm", "tiny-llm-canary"]))
    return registry, tel, streams


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def _begin(tel: Telemetry, streams: StreamTelemetry, path: bytes = b"/v1/chat/completions"):
    req = tel.begin("", "", c.PROTOCOL_HTTP)
    req.start = time.perf_counter()
    return req, streams.begin(routes.classify(path), req)


def test_served_names_and_sla_gauges() -> None:
    registry, _, streams = _parts()
    assert streams.served_models(["tiny-llm", "tiny-llm-canary", "other"]) == {
        "tiny-llm": ["1", "2"],
        "other": [],
    }
    assert _value(registry, c.MODEL_TTFT_SLA.name, model="tiny-llm") == 0.2
    assert _value(registry, c.MODEL_TPOT_SLA.name, model="tiny-llm") == 0.05
    assert _value(registry, c.MODEL_TTFT_SLA.name, model="ranker") == 0.0  # not an LLM


def test_the_body_model_relabels_the_request_in_flight() -> None:
    registry, tel, streams = _parts()
    req, st = _begin(tel, streams)
    assert _value(registry, c.REQUESTS_IN_FLIGHT.name, model="") == 1
    st.request_body(b'{"messages": [{"role": "user", "content": "x"}], "mo')
    st.request_body(b'del": "tiny-llm-canary", "max_tokens": 3}')
    assert _value(registry, c.REQUESTS_IN_FLIGHT.name, model="") == 0
    assert _value(registry, c.REQUESTS_IN_FLIGHT.name, model="tiny-llm") == 1
    assert (req.series.model, req.series.version) == ("tiny-llm", "2")


def test_an_unknown_model_is_other() -> None:
    _, tel, streams = _parts()
    req, st = _begin(tel, streams)
    st.request_body(b'{"model": "nope"}')
    assert req.series.model == c.MODEL_OVERFLOW


def test_a_recorded_vllm_stream_is_measured() -> None:
    registry, tel, streams = _parts()
    _, st = _begin(tel, streams)
    st.request_body(b'{"model": "tiny-llm"}')
    st.response_head(200, [(b"Content-Type", SSE)])
    data = (STREAMS / "vllm_chat_stream_continuous_usage.sse").read_bytes()
    for i in range(0, len(data), 97):
        st.response_body(data[i : i + 97])
    assert st.answered()
    assert st.close(True) is None
    hist = {"model": "tiny-llm", "version": "1"}  # no protocol label on the histograms
    assert _value(registry, c.TIME_TO_FIRST_TOKEN.name + "_count", **hist) == 1
    assert _value(registry, c.TIME_PER_OUTPUT_TOKEN.name + "_count", **hist) == 1
    labels = {**hist, "protocol": c.PROTOCOL_HTTP}
    assert _value(registry, c.TOKENS_TOTAL.name, type=c.TOKEN_GENERATION, **labels) == 5
    assert _value(registry, c.TOKENS_TOTAL.name, type=c.TOKEN_PROMPT, **labels) > 0


def test_an_error_event_in_a_200_stream_is_a_server_error() -> None:
    _, tel, streams = _parts()
    _, st = _begin(tel, streams)
    st.request_body(b'{"model": "tiny-llm"}')
    st.response_head(200, [(b"content-type", SSE)])
    st.response_body((STREAMS / "vllm_chat_stream_engine_killed.sse").read_bytes())
    assert st.close(True) == c.OUTCOME_SERVER_ERROR


def test_a_cut_stream_and_a_client_that_leaves() -> None:
    head = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    _, tel, streams = _parts()
    _, st = _begin(tel, streams)
    st.response_head(200, [(b"content-type", SSE)])
    st.response_body(head)
    assert not st.answered()
    assert st.close(True) == c.OUTCOME_SERVER_ERROR  # the body ended without [DONE]
    _, st = _begin(tel, streams)
    st.response_head(200, [(b"content-type", SSE)])
    st.response_body(head)
    assert st.close(False, client_left=True) is None  # the 499 stands
    # After [DONE] the client had the whole answer (the openai client closes right there).
    _, st = _begin(tel, streams)
    st.response_head(200, [(b"content-type", SSE)])
    st.response_body(head + b"data: [DONE]\n\n")
    assert st.answered() and st.close(True) is None


def test_triton_streams_have_no_end_marker_and_name_their_version() -> None:
    _, tel, streams = _parts()
    tel.update_models({"tiny_stream": ["1", "2"]})
    req = tel.begin("tiny_stream", "", c.PROTOCOL_HTTP)
    st = streams.begin(routes.classify(b"/v2/models/tiny_stream/generate_stream"), req)
    st.response_head(200, [(b"content-type", SSE)])
    st.response_body(b'data: {"model_name":"tiny_stream","model_version":"2","text_output":"a "}\n\n')
    assert not st.answered()
    assert (req.series.model, req.series.version) == ("tiny_stream", "2")
    assert st.close(True) is None


def test_no_observer_for_error_statuses_or_the_model_list() -> None:
    _, tel, streams = _parts()
    _, st = _begin(tel, streams)
    st.response_head(404, [(b"content-type", b"application/json")])
    st.response_body(b'{"error": {"message": "no such model", "code": 404}}')
    assert st.close(True) is None
    assert streams.begin(routes.MODELS, tel.begin("", "", c.PROTOCOL_HTTP)) is None


def test_the_inter_token_histogram_exposes_what_prometheus_clients_would() -> None:
    # The gaps' histogram keeps plain numbers (sidecar.core.streams.GapHistograms): its scrape must
    # read as prometheus_client's Histogram with the same buckets and observations, in both formats.
    registry, tel, streams = _parts()
    reference = CollectorRegistry()
    m = c.INTER_TOKEN_LATENCY
    buckets = streams.itl.bounds
    hist = Histogram(m.name, m.help, m.labels, registry=reference, buckets=buckets, unit=m.unit)
    gaps = [0.0, buckets[0], buckets[0] * 1.5, buckets[3], 0.04, 0.04, 7.0, 1e9]
    tel.update_models({"tiny_stream": ["1"]})
    req = tel.begin("tiny_stream", "1", c.PROTOCOL_HTTP)
    st = streams.begin(routes.classify(b"/v2/models/tiny_stream/versions/1/generate_stream"), req)
    assert st is not None
    t = 100.0
    st.on_first_token(t, 1)
    for i, gap in enumerate(gaps):
        t += gap
        st.on_token(t, 1, gap)
        hist.labels("tiny_stream", "1").observe(gap)
        # Each gap counts at once, not at the stream's end.
        assert _value(registry, m.name + "_count", model="tiny_stream", version="1") == i + 1
    hist.labels("tiny-llm", "1")  # a label set with nothing observed yet shows too
    streams.series(tel.begin("tiny-llm", "1", c.PROTOCOL_HTTP).series)
    for fmt in (generate_latest, openmetrics.generate_latest):
        ours = [ln for ln in fmt(registry).decode().splitlines() if m.name in ln]
        want = [ln for ln in fmt(reference).decode().splitlines() if m.name in ln and "_created" not in ln]
        assert ours == want
