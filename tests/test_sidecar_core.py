"""The sidecar's telemetry and configuration, in-process: labels stay bounded, outcomes
follow sidecar/README.md's split, buckets hold each SLA, exemplars carry the trace id, spans follow the
semantic conventions, and bad configuration is one line."""

from __future__ import annotations

import argparse

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics

from inferwatch import contract
from sidecar import config as cfg
from sidecar.core.telemetry import Telemetry, outcome_for_grpc, outcome_for_http

FLEET = "fleet.yaml"


def make_config(*argv: str, env: dict[str, str] | None = None) -> cfg.SidecarConfig:
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser)
    return cfg.from_args(parser.parse_args(list(argv)), env or {})


def sample(registry: CollectorRegistry, name: str, labels: dict[str, str]) -> float | None:
    return registry.get_sample_value(name, labels)


def test_outcomes_follow_the_design() -> None:
    assert outcome_for_http(200) == contract.OUTCOME_SUCCESS
    assert outcome_for_http(304) == contract.OUTCOME_SUCCESS
    assert outcome_for_http(400) == contract.OUTCOME_CLIENT_ERROR
    assert outcome_for_http(404) == contract.OUTCOME_CLIENT_ERROR
    assert outcome_for_http(429) == contract.OUTCOME_SERVER_ERROR
    assert outcome_for_http(500) == contract.OUTCOME_SERVER_ERROR
    assert outcome_for_http(503) == contract.OUTCOME_SERVER_ERROR
    assert outcome_for_grpc("OK") == contract.OUTCOME_SUCCESS
    for code in ("UNAVAILABLE", "INTERNAL", "UNKNOWN", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"):
        assert outcome_for_grpc(code) == contract.OUTCOME_SERVER_ERROR
    for code in ("INVALID_ARGUMENT", "NOT_FOUND", "CANCELLED", "UNAUTHENTICATED"):
        assert outcome_for_grpc(code) == contract.OUTCOME_CLIENT_ERROR


def test_buckets_hold_each_sla_and_twice_it() -> None:
    tel = Telemetry(CollectorRegistry(), make_config("--spec", FLEET, "--sla", "custom=37"))
    for sla in (0.25, 1.0, 0.1, 0.037, 0.5):  # fleet.yaml's models, the override, the default
        assert sla in tel.buckets and 2 * sla in tel.buckets, sla


def test_sla_gauge_and_known_models() -> None:
    reg = CollectorRegistry()
    tel = Telemetry(reg, make_config("--spec", FLEET, "--sla", "ranker=80"))
    name = contract.MODEL_LATENCY_SLA.name
    assert sample(reg, name, {"model": "dense_batched"}) == 0.25
    assert sample(reg, name, {"model": "ranker"}) == 0.08
    tel.update_models({"served_only": ["1"]})
    assert tel.model_label("served_only") == "served_only"
    assert sample(reg, name, {"model": "served_only"}) == 0.5  # the spec's default


def test_model_label_is_bounded_by_served_models_and_the_cap() -> None:
    reg = CollectorRegistry()
    tel = Telemetry(reg, make_config())
    misses = []
    tel.on_unknown_model = lambda: misses.append(1)
    tel.update_models({"a": ["1", "2"], "b": []})
    assert tel.model_label("a") == "a"
    assert tel.model_label("nope") == contract.MODEL_OVERFLOW
    assert misses
    for i in range(10_000):
        req = tel.begin(f"random-{i}", str(i), contract.PROTOCOL_HTTP)
        tel.end(req, "404", contract.OUTCOME_CLIENT_ERROR)
    models = {s.labels["model"] for m in reg.collect() for s in m.samples if "model" in s.labels}
    assert models <= {"a", "b", contract.MODEL_OVERFLOW}
    total = sample(
        reg,
        contract.REQUESTS_TOTAL.name,
        {
            "model": contract.MODEL_OVERFLOW,
            "version": contract.MODEL_OVERFLOW,
            "protocol": "http",
            "code": "404",
            "outcome": "client_error",
        },
    )
    assert total == 10_000
    # Versions of a listed model are bounded by the listing.
    assert tel.version_label("a", "2") == "2"
    assert tel.version_label("a", "99") == contract.MODEL_OVERFLOW


def test_a_successful_answer_admits_its_model_within_the_cap() -> None:
    """Before the index is read (or while it is stale), a request that the upstream answers
    with success is counted under its own model: the answer proves the model exists."""
    reg = CollectorRegistry()
    config = make_config()
    config = cfg.SidecarConfig(
        spec=config.spec.model_copy(
            update={"sidecar": config.spec.sidecar.model_copy(update={"max_models": 2})}
        )
    )
    tel = Telemetry(reg, config)

    def total(model: str, version: str, code: str) -> float | None:
        outcome = outcome_for_grpc(code) if code.isalpha() else outcome_for_http(int(code))
        labels = {"model": model, "version": version, "code": code, "outcome": outcome}
        return sample(reg, contract.REQUESTS_TOTAL.name, {**labels, "protocol": "http"}) or sample(
            reg, contract.REQUESTS_TOTAL.name, {**labels, "protocol": "grpc"}
        )

    def one(model: str, version: str, code: str, protocol: str = contract.PROTOCOL_HTTP) -> None:
        req = tel.begin(model, version, protocol)
        outcome = outcome_for_grpc(code) if code.isalpha() else outcome_for_http(int(code))
        tel.end(req, code, outcome)

    one("unknown", "", "400")  # a failure proves nothing
    assert total(contract.MODEL_OVERFLOW, "", "400") == 1
    assert tel.model_label("unknown") == contract.MODEL_OVERFLOW
    one("ranker", "1", "200")  # Triton answered: ranker version 1 exists
    assert total("ranker", "1", "200") == 1
    assert total(contract.MODEL_OVERFLOW, contract.MODEL_OVERFLOW, "200") is None
    assert tel.model_label("ranker") == "ranker" and tel.version_label("ranker", "1") == "1"
    assert sample(reg, contract.MODEL_LATENCY_SLA.name, {"model": "ranker"}) == 0.5
    one("dense", "", "OK", contract.PROTOCOL_GRPC)  # gRPC OK proves it too
    assert total("dense", "", "OK") == 1
    one("third", "", "200")  # past the cap (2): stays in the overflow label
    assert total(contract.MODEL_OVERFLOW, "", "200") == 1
    assert tel.model_label("third") == contract.MODEL_OVERFLOW
    # In flight was taken back where it was counted.
    for model in ("ranker", "dense", contract.MODEL_OVERFLOW):
        assert sample(reg, contract.REQUESTS_IN_FLIGHT.name, {"model": model}) == 0, model
    # A version the index does not list, once proven, gets its label too (the index was stale).
    tel2 = Telemetry(CollectorRegistry(), make_config())
    tel2.update_models({"ranker": ["1"]})
    assert tel2.version_label("ranker", "2") == contract.MODEL_OVERFLOW
    tel2.end(tel2.begin("ranker", "2", contract.PROTOCOL_HTTP), "200", contract.OUTCOME_SUCCESS)
    assert tel2.version_label("ranker", "2") == "2"


def test_unlisting_upstream_admits_first_come_up_to_the_cap() -> None:
    reg = CollectorRegistry()
    config = make_config()
    config = cfg.SidecarConfig(
        spec=config.spec.model_copy(
            update={"sidecar": config.spec.sidecar.model_copy(update={"max_models": 3})}
        )
    )
    tel = Telemetry(reg, config)
    tel.update_models(None, supported=False)
    labels = [tel.model_label(f"m{i}") for i in range(5)]
    assert labels == ["m0", "m1", "m2", contract.MODEL_OVERFLOW, contract.MODEL_OVERFLOW]


def test_counters_bytes_in_flight_and_exemplars() -> None:
    reg = CollectorRegistry()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tel = Telemetry(reg, make_config("--spec", FLEET), tracer=provider.get_tracer("test"))
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    req = tel.begin("dense_batched", "1", contract.PROTOCOL_HTTP, parent, "POST /v2/models/{model}/infer")
    assert sample(reg, contract.REQUESTS_IN_FLIGHT.name, {"model": "dense_batched"}) == 1
    assert req.traceparent and req.traceparent.startswith("00-0af7651916cd43dd8448eb211c80319c-")
    assert not req.traceparent.endswith("b7ad6b7169203331-01")  # our span is the new parent
    tel.end(req, "200", contract.OUTCOME_SUCCESS, 120, 340)
    tel.end(req, "200", contract.OUTCOME_SUCCESS, 120, 340)  # a second end is ignored
    assert sample(reg, contract.REQUESTS_IN_FLIGHT.name, {"model": "dense_batched"}) == 0
    labels = {"model": "dense_batched", "version": "1", "protocol": "http"}
    assert sample(reg, contract.REQUESTS_TOTAL.name, {**labels, "code": "200", "outcome": "success"}) == 1
    assert sample(reg, contract.REQUEST_BYTES.name, {"model": "dense_batched", "protocol": "http"}) == 120
    assert sample(reg, contract.RESPONSE_BYTES.name, {"model": "dense_batched", "protocol": "http"}) == 340
    text = openmetrics(reg).decode()
    assert 'trace_id="0af7651916cd43dd8448eb211c80319c"' in text
    (span,) = exporter.get_finished_spans()
    assert span.name == "POST /v2/models/{model}/infer"
    assert span.kind.name == "SERVER"
    assert span.attributes["http.response.status_code"] == 200
    assert span.attributes["inferwatch.model"] == "dense_batched"
    assert format(span.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"


def test_config_env_and_flags() -> None:
    c = make_config(
        "--http-port", "9001", env={"INFERWATCH_HTTP_PORT": "9002", "INFERWATCH_METRICS_PORT": "9003"}
    )
    assert c.http_port == 9001 and c.metrics_port == 9003
    c = make_config(env={"INFERWATCH_SLA": "a=10,b=20", "INFERWATCH_UPSTREAM_HTTP": "10.0.0.1:8000"})
    assert c.sla_overrides == {"a": 0.01, "b": 0.02} and c.upstream_http == ("10.0.0.1", 8000)
    assert make_config().drain_delay == 0.0
    assert make_config(env={"INFERWATCH_DRAIN_DELAY": "7.5"}).drain_delay == 7.5
    assert make_config("--drain-delay", "0", env={"INFERWATCH_DRAIN_DELAY": "7.5"}).drain_delay == 0.0


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--http-port", "70000"], {}, "--http-port: 70000 is not a TCP port"),
        (["--request-timeout", "abc"], {}, "--request-timeout: 'abc' is not a number"),
        (
            [],
            {"INFERWATCH_UPSTREAM_HTTP": "nohostport"},
            "INFERWATCH_UPSTREAM_HTTP: 'nohostport' is not HOST:PORT",
        ),
        (["--sla", "m=-1"], {}, "--sla: 'm=-1': the SLA must be a positive number of milliseconds"),
        (["--route", "^/v1/(.*)"], {}, "--route: '^/v1/(.*)' has no (?P<model>...) group"),
        (["--spec", "/nonexistent.yaml"], {}, "/nonexistent.yaml: no such file"),
        (["--trace-sample-ratio", "2"], {}, "--trace-sample-ratio: '2' must be between 0 and 1"),
        (["--drain-delay", "-1"], {}, "--drain-delay: '-1' must be a number of seconds, 0 or more"),
        ([], {"INFERWATCH_DRAIN_DELAY": "soon"}, "INFERWATCH_DRAIN_DELAY: 'soon' is not a number"),
    ],
)
def test_bad_config_is_one_line(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(cfg.ConfigError) as err:
        make_config(*argv, env=env)
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_cli_refuses_bad_configuration_in_one_line() -> None:
    import subprocess

    from tests.fixtures.net import inferwatch_cmd

    for argv, message in (
        (["--http-port", "70000"], "inferwatch: error: --http-port: 70000 is not a TCP port"),
        (["--spec", "/nonexistent/fleet.yaml"], "inferwatch: error: /nonexistent/fleet.yaml: no such file"),
    ):
        proc = subprocess.run(inferwatch_cmd("sidecar", *argv), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().startswith(message), proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_cli_help_names_every_flag_and_its_variable() -> None:
    import subprocess

    from tests.fixtures.net import inferwatch_cmd

    out = subprocess.run(
        inferwatch_cmd("sidecar", "--help"), capture_output=True, text=True, timeout=60
    ).stdout
    for flag, env in (
        ("--upstream-http", "INFERWATCH_UPSTREAM_HTTP"),
        ("--max-body-bytes", "INFERWATCH_MAX_BODY_BYTES"),
        ("--drain-delay", "INFERWATCH_DRAIN_DELAY"),
    ):
        assert flag in out and env in out


def test_cli_port_in_use_is_one_line() -> None:
    import socket
    import subprocess

    from tests.fixtures.net import free_port, inferwatch_cmd

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = ["--host", "127.0.0.1", "--http-port", str(port), "--grpc-port", "0"]
        argv += ["--metrics-port", str(free_port()), "--upstream-http", f"127.0.0.1:{free_port()}"]
        proc = subprocess.run(inferwatch_cmd("sidecar", *argv), capture_output=True, text=True, timeout=60)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("inferwatch: error:")]
    assert proc.returncode == 1
    assert len(errors) == 1 and str(port) in errors[0] and "in use" in errors[0], proc.stderr


# Every code the proxies pass on or produce themselves, on both protocols: the series budget
# holds whatever outcomes occur (deploy/SCALING.md, issue 17).
HTTP_CODES = ("200", "400", "404", "413", "429", "500", "502", "503", "504")
GRPC_CODES = ("OK", "INVALID_ARGUMENT", "NOT_FOUND", "INTERNAL", "UNAVAILABLE", "DEADLINE_EXCEEDED")


# What requests naming no model (health, repository index, metadata) and unknown models (a
# success would prove the name: it then counts as a model of its own) are answered.
NO_MODEL_CODES = (("200", "400", "404", "503"), ("OK", "NOT_FOUND", "UNAVAILABLE"))
UNKNOWN_CODES = (("400", "404", "502"), ("INVALID_ARGUMENT", "NOT_FOUND", "UNAVAILABLE"))


def _every_outcome(
    tel: Telemetry, model: str, version: str, codes: tuple[tuple[str, ...], ...] = (HTTP_CODES, GRPC_CODES)
) -> None:
    for protocol, proto_codes, outcome_of in (
        (contract.PROTOCOL_HTTP, codes[0], lambda code: outcome_for_http(int(code))),
        (contract.PROTOCOL_GRPC, codes[1], outcome_for_grpc),
    ):
        for code in proto_codes:
            tel.end(tel.begin(model, version, protocol), code, outcome_of(code), 10, 20)


def _series_of(reg: CollectorRegistry, model: str) -> int:
    """Samples labelled with ``model`` (``*_created`` left out: the sidecar turns them off)."""
    return sum(
        1
        for fam in reg.collect()
        for s in fam.samples
        if s.labels.get("model") == model and not s.name.endswith("_created")
    )


def test_series_budget_per_model_version_and_per_pod() -> None:
    from sidecar.core.streams import StreamTelemetry

    reg = CollectorRegistry()
    config = make_config("--spec", FLEET)
    tel = Telemetry(reg, config)
    llm = StreamTelemetry(reg, config, tel, lambda _chunk: None)
    tel.update_models({"dense_batched": ["1"], "tiny-llm": ["1"]})
    _every_outcome(tel, "dense_batched", "1")
    # An LLM version: every outcome, and token timings on both protocols.
    _every_outcome(tel, "tiny-llm", "1")
    for protocol in (contract.PROTOCOL_HTTP, contract.PROTOCOL_GRPC):
        s = llm.series(tel.begin("tiny-llm", "1", protocol).series)
        s.ttft.observe(0.1)
        s.tpot.observe(0.01)
        s.itl.observe(0.01)
        s.prompt.inc(5)
        s.generation.inc(7)
    # Requests naming no model and unknown models, as they are answered.
    tel.set_upstream_up("http", True)
    tel.set_upstream_up("grpc", True)
    _every_outcome(tel, "", "", NO_MODEL_CODES)
    _every_outcome(tel, "no_such_model", "", UNKNOWN_CODES)
    per_version = _series_of(reg, "dense_batched")
    per_llm_version = _series_of(reg, "tiny-llm")
    fixed = sum(_series_of(reg, m) for m in (contract.MODEL_NONE, contract.MODEL_OVERFLOW))
    fixed += sum(1 for fam in reg.collect() for s in fam.samples if "model" not in s.labels)
    assert per_version <= 120, per_version
    assert per_llm_version <= 180, per_llm_version
    assert fixed <= 30, fixed
    # The latency histogram still has every outcome for a model, with a bucket at each SLA
    # and 2x it; it is not split by protocol.
    bucket = contract.REQUEST_DURATION.name + "_bucket"
    for outcome in contract.OUTCOMES:
        labels = {"model": "dense_batched", "version": "1", "outcome": outcome}
        assert sample(reg, bucket, {**labels, "le": "0.25"}) is not None
        assert sample(reg, bucket, {**labels, "le": "0.5"}) is not None
    assert sample(reg, contract.REQUEST_DURATION.name + "_count", {**labels}) == 8  # 5 HTTP 5xx/429 + 3 gRPC
