"""Per-request observation for both proxies: the contract's metrics and the server span.

The HTTP proxy (``sidecar.protocols.http1``) and the gRPC proxy (``sidecar.protocols.grpc_aio``) share
one ``Telemetry``; everything a request costs is two calls::

    tel = Telemetry(registry, config, tracer=None)      # builds every metric family once
    req = tel.begin(model, version, PROTOCOL_HTTP, traceparent, "POST /v2/models/{model}/infer")
    upstream_headers["traceparent"] = req.traceparent or client_traceparent   # forward it
    ...proxy...
    tel.end(req, "200", tel.outcome_for_http(200), req_bytes, resp_bytes)

- ``begin(model, version, protocol, traceparent=None, span_name="", attributes=None)``
  resolves the bounded labels, increments in-flight and starts the span when a tracer is
  given. ``model``/``version`` are the raw names from the request ("" when none).
  Returns a ``Request``; ``req.traceparent`` is the W3C header to send upstream (``None``
  when tracing is off: forward the client's own header unchanged then).
- ``end(req, code, outcome, req_bytes=0, resp_bytes=0)`` exactly once per ``begin``
  (later calls are ignored): one histogram observation on a pre-resolved labelled child
  (exemplar ``{"trace_id": ...}`` when the span is sampled), the counters, in-flight
  decrement, the span's status code attribute and end. ``code`` is the HTTP status ("200")
  or the gRPC code name ("UNAVAILABLE").
- ``outcome_for_http(status: int)`` / ``outcome_for_grpc(code_name: str)``: the split
  sidecar/README.md states: 5xx (and 429), the gRPC codes in ``GRPC_SERVER_ERRORS``, and failures the
  sidecar saw itself (HTTP 502/503/504; gRPC UNAVAILABLE/DEADLINE_EXCEEDED) are
  ``server_error``; other 4xx / gRPC codes are ``client_error``.
- ``relabel(req, model, version)``: the model became known after ``begin`` (an OpenAI
  request names it in its body): the request moves to that series before ``end``.
- ``set_upstream_up(upstream, up)`` with ``UPSTREAM_HTTP`` or ``UPSTREAM_GRPC``.
- ``model_label(name)``: the name itself when the upstream serves it (its repository
  index, given through ``update_models``), the spec lists it, or the upstream already
  answered a request for it with success, up to ``spec.sidecar.max_models`` names; anything
  else is ``contract.MODEL_OVERFLOW`` (``sidecar.core.catalog.ModelCatalog`` decides). A request
  that began under the overflow label and ends with success (HTTP 2xx, gRPC OK) is counted
  under its own name (within the cap), so the first requests after the upstream turns ready
  are attributed before the index is read. A miss calls ``on_unknown_model`` (the
  refresher's wake-up, rate-limited by the refresher) so a newly loaded model is picked up
  quickly.

Histogram buckets are a fixed ladder plus every configured SLA, 2x it and the latency
alert's factor x it (and the same for the spec's default), so "slower than the SLA" is
an exact bucket boundary. The series budget (deploy/SCALING.md): the latency histogram has
no protocol label, its outcome children appear when that outcome first occurs, and
requests naming no model or an unknown one (``MODEL_NONE``, ``MODEL_OVERFLOW``) are only
counted, never timed, so a pod's fixed series stay a few dozen. The SLA gauge is set at
construction for each configured model and when a served model is first admitted.

Nothing here sees a payload: labels come from model/version names only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from inferwatch import contract
from sidecar.core.catalog import ModelCatalog

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

    from sidecar.config import SidecarConfig

UPSTREAM_HTTP = "http"
UPSTREAM_GRPC = "grpc"

BASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# gRPC codes meaning the server (or the path to it) failed.
GRPC_SERVER_ERRORS = frozenset(
    {
        "UNAVAILABLE",
        "INTERNAL",
        "UNKNOWN",
        "DEADLINE_EXCEEDED",
        "RESOURCE_EXHAUSTED",
        "DATA_LOSS",
        "UNIMPLEMENTED",
    }
)
GRPC_CODES = {
    "OK": 0,
    "CANCELLED": 1,
    "UNKNOWN": 2,
    "INVALID_ARGUMENT": 3,
    "DEADLINE_EXCEEDED": 4,
    "NOT_FOUND": 5,
    "ALREADY_EXISTS": 6,
    "PERMISSION_DENIED": 7,
    "RESOURCE_EXHAUSTED": 8,
    "FAILED_PRECONDITION": 9,
    "ABORTED": 10,
    "OUT_OF_RANGE": 11,
    "UNIMPLEMENTED": 12,
    "INTERNAL": 13,
    "UNAVAILABLE": 14,
    "DATA_LOSS": 15,
    "UNAUTHENTICATED": 16,
}
_OK, _CLIENT, _SERVER = contract.OUTCOME_SUCCESS, contract.OUTCOME_CLIENT_ERROR, contract.OUTCOME_SERVER_ERROR
# Label values counted but not timed: requests naming no model, or one outside the labels.
_UNTIMED = frozenset({contract.MODEL_NONE, contract.MODEL_OVERFLOW})
# Built once: status -> outcome for every HTTP status.
_HTTP_OUTCOMES = tuple(_SERVER if s >= 500 or s == 429 else _CLIENT if s >= 400 else _OK for s in range(1000))


def outcome_for_http(status: int) -> str:
    return _HTTP_OUTCOMES[status] if 0 <= status < 1000 else _SERVER


def outcome_for_grpc(code_name: str) -> str:
    if code_name == "OK":
        return _OK
    return _SERVER if code_name in GRPC_SERVER_ERRORS else _CLIENT


def histogram_buckets(config: SidecarConfig) -> tuple[float, ...]:
    """The fixed ladder plus each configured SLA (and the default), 2x and factor x it."""
    factor = config.spec.alerts.latency.sla_factor
    slas = [*config.configured_slas().values(), config.spec.defaults.latency_sla_ms / 1000.0]
    bounds = set(BASE_BUCKETS)
    for sla in slas:
        bounds.update((round(sla, 6), round(2 * sla, 6), round(factor * sla, 6)))
    return tuple(sorted(bounds))


class _Series:
    """The pre-resolved children of one (model, version) label pair."""

    __slots__ = (
        "bytes_in",
        "bytes_out",
        "counters",
        "durations",
        "in_flight",
        "llm",
        "model",
        "protocol",
        "version",
    )

    def __init__(self, tel: Telemetry, model: str, version: str, protocol: str) -> None:
        self.model = model
        self.version = version
        self.protocol = protocol
        self.in_flight = tel.in_flight.labels(model)
        # outcome -> histogram child, made on first use; None: this label pair is not timed.
        self.durations: dict[str, Any] | None = None if model in _UNTIMED else {}
        self.bytes_in = tel.req_bytes.labels(model, protocol)
        self.bytes_out = tel.resp_bytes.labels(model, protocol)
        # (code, outcome) -> counter child, filled as codes appear (bounded: codes are few).
        self.counters: dict[tuple[str, str], Any] = {}
        self.llm: Any = None  # sidecar.core.streams's children, made on the first generative request


def family(kind: type, metric: contract.Metric, registry: CollectorRegistry, **options: Any) -> Any:
    """A prometheus_client metric (``kind``: Counter, Gauge, Histogram) named, described and
    labelled by its row in ``inferwatch.contract``; ``options`` (buckets, unit) go as they are."""
    return kind(metric.name, metric.help, metric.labels, registry=registry, **options)


class Request:
    """One request's state between ``begin`` and ``end``."""

    __slots__ = ("claim", "done", "series", "span", "start", "traceparent")

    def __init__(self, series: _Series, start: float, span: Span | None, traceparent: str | None) -> None:
        self.series = series
        self.start = start
        self.span = span
        self.traceparent = traceparent
        self.done = False
        # (model, version) as the client named them, when their labels are not yet their own:
        # a successful answer proves them (ModelCatalog.prove) and the request counts under them.
        self.claim: tuple[str, str] | None = None


class Telemetry:
    def __init__(
        self,
        registry: CollectorRegistry,
        config: SidecarConfig,
        tracer: Tracer | None = None,
    ) -> None:
        self.config = config
        self.tracer = tracer
        self.max_models = config.spec.sidecar.max_models
        self.buckets = histogram_buckets(config)
        c = contract
        self.requests = family(Counter, c.REQUESTS_TOTAL, registry)
        self.duration = family(
            Histogram, c.REQUEST_DURATION, registry, buckets=self.buckets, unit=c.REQUEST_DURATION.unit
        )
        self.in_flight = family(Gauge, c.REQUESTS_IN_FLIGHT, registry)
        self.req_bytes = family(Counter, c.REQUEST_BYTES, registry)
        self.resp_bytes = family(Counter, c.RESPONSE_BYTES, registry)
        self.sla = family(Gauge, c.MODEL_LATENCY_SLA, registry, unit=c.MODEL_LATENCY_SLA.unit)
        self.upstream_up = family(Gauge, c.UPSTREAM_UP, registry)

        self._configured = config.configured_slas()
        for name, sla in self._configured.items():
            self.sla.labels(name).set(sla)
        self.catalog = ModelCatalog(self.max_models, self._configured, self._on_admit)
        self._series: dict[tuple[str, str, str], _Series] = {}

    # ------------------------------------------------------------------ labels
    def _on_admit(self, name: str) -> None:
        if name not in self._configured:
            self.sla.labels(name).set(self.config.latency_sla_seconds(name))

    @property
    def on_unknown_model(self) -> Callable[[], None] | None:
        return self.catalog.on_unknown

    @on_unknown_model.setter
    def on_unknown_model(self, callback: Callable[[], None] | None) -> None:
        self.catalog.on_unknown = callback

    def update_models(self, served: Mapping[str, Iterable[str]] | None, supported: bool = True) -> None:
        """The upstream's repository index (name -> versions); ``ModelCatalog.update``."""
        self.catalog.update(served, supported)

    def model_label(self, name: str) -> str:
        return self.catalog.model_label(name)

    def version_label(self, model_label: str, version: str) -> str:
        return self.catalog.version_label(model_label, version)

    def _resolve(self, model: str, version: str, protocol: str) -> _Series:
        key = (model, version, protocol)
        series = self._series.get(key)
        if series is not None:
            return series
        m = self.catalog.model_label(model)
        v = self.catalog.version_label(m, version)
        lkey = (m, v, protocol)
        series = self._series.get(lkey)
        if series is None:
            series = _Series(self, m, v, protocol)
            self._series[lkey] = series
        if m == model and v == version:
            self._series[key] = series  # cache only admitted names: the cache stays bounded
        return series

    # ------------------------------------------------------------------ requests
    def begin(
        self,
        model: str,
        version: str,
        protocol: str,
        traceparent: str | None = None,
        span_name: str = "",
        attributes: dict[str, Any] | None = None,
    ) -> Request:
        series = self._series.get((model, version, protocol))
        claim = None
        if series is None:
            series = self._resolve(model, version, protocol)
            if series.model != model or series.version != version:
                claim = (model, version)
        series.in_flight.inc()
        span = None
        out_tp = None
        if self.tracer is not None:
            span, out_tp = self._start_span(series, protocol, traceparent, span_name, attributes)
        req = Request(series, time.perf_counter(), span, out_tp)
        if claim is not None:
            req.claim = claim
        return req

    def relabel(self, req: Request, model: str, version: str) -> None:
        """The request's model became known after ``begin`` (an OpenAI body's ``model``, the
        version a Triton answer names): move it, in-flight gauge included, to that series."""
        if req.done:
            return
        old = req.series
        series = self._series.get((model, version, old.protocol))
        if series is None:
            series = self._resolve(model, version, old.protocol)
        req.claim = None if series.model == model and series.version == version else (model, version)
        if series is old:
            return
        old.in_flight.dec()
        series.in_flight.inc()
        req.series = series
        if req.span is not None:
            req.span.set_attribute("inferwatch.model", series.model)
            req.span.set_attribute("inferwatch.model_version", series.version)

    def end(self, req: Request, code: str, outcome: str, req_bytes: int = 0, resp_bytes: int = 0) -> None:
        if req.done:
            return
        req.done = True
        elapsed = time.perf_counter() - req.start
        s = req.series
        s.in_flight.dec()
        if req.claim is not None and outcome == _OK and (code == "OK" or code[0] == "2"):
            s = self._proven(req, s)
        counter = s.counters.get((code, outcome))
        if counter is None:
            counter = self.requests.labels(s.model, s.version, s.protocol, code, outcome)
            s.counters[(code, outcome)] = counter
        counter.inc()
        if req_bytes:
            s.bytes_in.inc(req_bytes)
        if resp_bytes:
            s.bytes_out.inc(resp_bytes)
        span = req.span
        durations = s.durations
        hist = None
        if durations is not None:
            hist = durations.get(outcome)
            if hist is None:
                hist = durations[outcome] = self.duration.labels(s.model, s.version, outcome)
        if span is None:
            if hist is not None:
                hist.observe(elapsed)
            return
        if hist is not None:
            ctx = span.get_span_context()
            if ctx.trace_flags.sampled:
                hist.observe(elapsed, {"trace_id": format(ctx.trace_id, "032x")})
            else:
                hist.observe(elapsed)
        self._end_span(span, s, code, outcome)

    def _proven(self, req: Request, s: _Series) -> _Series:
        """The upstream answered with success for names outside the labels: admit them (within
        the caps) and count this request under them; else it stays where it began."""
        model, version = req.claim  # type: ignore[misc]
        if not self.catalog.prove(model, version):
            return s
        series = self._resolve(model, version, s.protocol)
        if req.span is not None:
            req.span.set_attribute("inferwatch.model", series.model)
            req.span.set_attribute("inferwatch.model_version", series.version)
        return series

    def set_upstream_up(self, upstream: str, up: bool) -> None:
        self.upstream_up.labels(upstream).set(1 if up else 0)

    outcome_for_http = staticmethod(outcome_for_http)
    outcome_for_grpc = staticmethod(outcome_for_grpc)

    # ------------------------------------------------------------------ tracing
    def _start_span(
        self,
        series: _Series,
        protocol: str,
        traceparent: str | None,
        span_name: str,
        attributes: dict[str, Any] | None,
    ) -> tuple[Span, str]:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        ctx = TraceContextTextMapPropagator().extract({"traceparent": traceparent}) if traceparent else None
        attrs = {"inferwatch.model": series.model, "inferwatch.model_version": series.version}
        if protocol == contract.PROTOCOL_GRPC:
            attrs["rpc.system"] = "grpc"
        if attributes:
            attrs.update(attributes)
        assert self.tracer is not None
        span = self.tracer.start_span(
            span_name or protocol, context=ctx, kind=trace.SpanKind.SERVER, attributes=attrs
        )
        sc = span.get_span_context()
        out = f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"
        return span, out

    def _end_span(self, span: Span, series: _Series, code: str, outcome: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        if code.isdigit():
            span.set_attribute("http.response.status_code", int(code))
        elif code in GRPC_CODES:
            span.set_attribute("rpc.grpc.status_code", GRPC_CODES[code])
        if outcome == _SERVER:
            span.set_status(Status(StatusCode.ERROR))
        span.end()
