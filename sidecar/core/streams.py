"""Token-stream telemetry: what the generative API modules report, turned into the contract's
LLM metrics (``inferwatch/contract.py``) and the span's GenAI attributes.

The transport knows only this module's entry points and the per-request object's few
calls, never an API's format::

    streams = StreamTelemetry(registry, config, telemetry, classify)  # once; classify: sidecar.apis.routes
    api = streams.classify(path)            # once per distinct path (the proxy caches it); None: KServe
    st = streams.begin(api, req)            # per generative request (req: telemetry.Request)
    hooks = streams.token_stream(req)       # or: a transport that counts the tokens (gRPC streams)
    st.request_body(chunk)                  # each body chunk as it goes upstream: the model, when in the body
    st.request_end()
    feed = st.response_head(status, headers)    # picks the answer's observer (2xx only), or None
    feed(chunk, time.perf_counter())        # each answer chunk as it goes to the client (or
    st.response_body(chunk)                 #   this, which reads the clock itself)
    outcome = st.close(complete, client_left)   # before telemetry.end: None, or server_error

Per request, ``StreamExchange`` is the API module's hooks (``sidecar.apis.hooks``): TTFT at the
first content event (from the request's first byte in), one inter-token observation per content
event, TPOT and the prompt/generation tokens at the end, all on the request's pre-resolved
series. The inter-token histogram, the one metric observed per token, is ``GapHistogram``: its
buckets and sum are plain numbers that a collector reads at scrape time, so a token costs a
bisect and two additions (prometheus_client's ``observe`` takes a lock per bucket and for the
sum: a hundred bytecodes, paid in a cold cache since a stream wakes the process once per token).
The model label of an OpenAI request comes from its body (``relabel`` when the scanner reads it);
a served name the fleet spec maps (``served_names``) becomes its model and version.

Outcomes beyond the status code: an error event in a 2xx answer, or a stream cut by the
upstream (an OpenAI stream without ``data: [DONE]``), is a ``server_error``; a client that left
keeps its 499 (``client_error``) with the tokens it received counted.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from inferwatch import contract
from inferwatch.spec import token_latency_buckets
from sidecar.apis.hooks import StreamEnd

if TYPE_CHECKING:
    from sidecar.config import SidecarConfig
    from sidecar.core.telemetry import Request, Telemetry, _Series

_SERVER = contract.OUTCOME_SERVER_ERROR
_NO_LABEL = (contract.MODEL_OVERFLOW, contract.MODEL_NONE)


class GapHistogram:
    """One label set of ``GapHistograms``: what prometheus_client's histogram child keeps (a count
    per bucket, the sum), as plain numbers. Only the event loop's thread writes them."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds  # upper bounds, +Inf last
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """As ``Histogram.observe``: the first bucket whose bound is >= ``value``."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class GapHistograms:
    """A histogram metric whose children are ``GapHistogram``: the same exposition as
    ``prometheus_client.Histogram`` (buckets, ``_count``, ``_sum``), built at each scrape."""

    def __init__(
        self, metric: contract.Metric, buckets: tuple[float, ...], registry: CollectorRegistry
    ) -> None:
        self.metric = metric
        bounds = tuple(sorted(float(b) for b in buckets))
        self.bounds = bounds if bounds and bounds[-1] == math.inf else (*bounds, math.inf)
        self.les = tuple(floatToGoString(b) for b in self.bounds)
        self.children: dict[tuple[str, ...], GapHistogram] = {}
        registry.register(self)

    def labels(self, *values: str) -> GapHistogram:
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = GapHistogram(self.bounds)
        return child

    def _family(self) -> HistogramMetricFamily:
        m = self.metric
        return HistogramMetricFamily(m.name, m.help, labels=m.labels, unit=m.unit or "")

    def describe(self) -> list[HistogramMetricFamily]:
        return [self._family()]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = self._family()
        for values, child in list(self.children.items()):  # the loop thread may add one meanwhile
            counts = list(child.counts)
            total = 0
            buckets = []
            for le, n in zip(self.les, counts, strict=True):
                total += n
                buckets.append((le, float(total)))
            family.add_metric(values, buckets, child.sum)
        yield family


class _LLMSeries:
    """The pre-resolved LLM children of one (model, version, protocol) series."""

    __slots__ = ("generation", "itl", "prompt", "tpot", "ttft")

    def __init__(self, st: StreamTelemetry, s: _Series) -> None:
        # The histograms are per (model, version): no protocol label (the series budget).
        self.ttft = st.ttft.labels(s.model, s.version)
        self.tpot = st.tpot.labels(s.model, s.version)
        self.itl = st.itl.labels(s.model, s.version)
        labels = (s.model, s.version, s.protocol)
        self.prompt = st.tokens.labels(*labels, contract.TOKEN_PROMPT)
        self.generation = st.tokens.labels(*labels, contract.TOKEN_GENERATION)


class StreamTelemetry:
    def __init__(
        self,
        registry: CollectorRegistry,
        config: SidecarConfig,
        telemetry: Telemetry,
        classify: Callable[[bytes], Any],
    ) -> None:
        c = contract
        spec = config.spec
        self.spec = spec
        self.telemetry = telemetry
        self.classify = classify
        self.served = spec.served_names()
        ttft_buckets = token_latency_buckets(spec, "ttft")
        tpot_buckets = token_latency_buckets(spec, "tpot")

        def hist(m: contract.Metric, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(m.name, m.help, m.labels, registry=registry, buckets=buckets, unit=m.unit)

        self.ttft = hist(c.TIME_TO_FIRST_TOKEN, ttft_buckets)
        self.tpot = hist(c.TIME_PER_OUTPUT_TOKEN, tpot_buckets)
        self.itl = GapHistograms(c.INTER_TOKEN_LATENCY, tpot_buckets, registry)
        self.tokens = Counter(
            c.TOKENS_TOTAL.name, c.TOKENS_TOTAL.help, c.TOKENS_TOTAL.labels, registry=registry
        )
        self.ttft_sla = Gauge(
            c.MODEL_TTFT_SLA.name,
            c.MODEL_TTFT_SLA.help,
            c.MODEL_TTFT_SLA.labels,
            registry=registry,
            unit="seconds",
        )
        self.tpot_sla = Gauge(
            c.MODEL_TPOT_SLA.name,
            c.MODEL_TPOT_SLA.help,
            c.MODEL_TPOT_SLA.labels,
            registry=registry,
            unit="seconds",
        )
        self._sla_set: set[str] = set()
        # The spec's LLM models (a token SLA or served names) have their gauges from the start;
        # any other model gets them with its first generative request.
        for m in spec.models:
            if m.ttft_sla_ms is not None or m.tpot_sla_ms is not None or m.served_names:
                self._set_sla(m.name)

    def _set_sla(self, model: str) -> None:
        self._sla_set.add(model)
        self.ttft_sla.labels(model).set(self.spec.ttft_sla_seconds(model))
        self.tpot_sla.labels(model).set(self.spec.tpot_sla_seconds(model))

    def served_name(self, name: str) -> tuple[str, str]:
        """(model, version) of a name a client asked for: the spec's mapping, else itself."""
        return self.served.get(name) or (name, "")

    def served_models(self, names: list[str]) -> dict[str, list[str]]:
        """An OpenAI server's ``/v1/models`` ids as the catalog's index: model -> versions."""
        out: dict[str, list[str]] = {}
        for name in names:
            model, version = self.served_name(name)
            versions = out.setdefault(model, [])
            if version:
                versions.append(version)
        return out

    def series(self, s: _Series) -> _LLMSeries:
        llm = s.llm
        if llm is None:
            llm = s.llm = _LLMSeries(self, s)
            if s.model not in self._sla_set and s.model not in _NO_LABEL:
                self._set_sla(s.model)
        return llm

    def begin(self, api: Any, req: Request) -> StreamExchange | None:
        """The per-request observer of a generative route; None where there is nothing to watch."""
        if not api.operation:
            return None
        if req.span is not None:
            req.span.set_attribute("gen_ai.operation.name", api.operation)
        return StreamExchange(self, api, req)

    def token_stream(self, req: Request) -> StreamExchange:
        """The hooks of a generative request whose tokens the transport counts itself (gRPC
        ``ModelStreamInfer``: one response per token, ``sidecar.protocols.grpc_tokens``): the
        same recording as an HTTP stream's, with no body to read."""
        return StreamExchange(self, None, req)


class StreamExchange:
    """One generative request: the API module's hooks and what the transport feeds it."""

    __slots__ = ("answer", "api", "client_left", "end", "req", "scan", "st")

    def __init__(self, st: StreamTelemetry, api: Any, req: Request) -> None:
        self.st = st
        self.api = api
        self.req = req
        self.scan = api.model_scan() if api is not None else None
        self.answer: Any = None
        self.end: StreamEnd | None = None  # the answer's figures once closed (the tokens refund)
        self.client_left = False

    # -- fed by the transport
    def request_body(self, chunk: bytes) -> None:
        scan = self.scan
        if scan is not None:
            name = scan.feed(chunk)
            if name is not None:
                self.scan = None
                self._named(name)

    def request_end(self) -> None:
        scan = self.scan
        if scan is not None:
            self.scan = None
            why = scan.finish()
            if why and self.req.span is not None:
                self.req.span.set_attribute("inferwatch.request.model_unread", why)

    def _named(self, name: str) -> None:
        req = self.req
        model, version = self.st.served_name(name)
        self.st.telemetry.relabel(req, model, version)
        if req.span is not None:
            req.span.set_attribute("gen_ai.request.model", name)

    def response_head(
        self, status: int, headers: list[tuple[bytes, bytes]]
    ) -> Callable[[bytes, float], None] | None:
        """Pick the answer's observer; returns its ``feed(chunk, t)`` for the transport to call
        per body chunk (one call less per token than ``response_body``), or None."""
        if not 200 <= status < 300:
            return None  # the status tells the outcome; an error body has no tokens
        ctype = ""
        for name, value in headers:
            if len(name) == 12 and name.lower() == b"content-type":
                ctype = value.decode("latin-1")
                break
        self.answer = answer = self.api.answer(self, ctype)
        return answer.feed if answer is not None else None

    def response_body(self, chunk: bytes) -> None:
        answer = self.answer
        if answer is not None:
            answer.feed(chunk, time.perf_counter())

    def answered(self) -> bool:
        """The answer's own end marker passed (a client leaving now had the whole answer)."""
        return self.answer is not None and self.answer.ended

    def close(self, complete: bool, client_left: bool = False) -> str | None:
        """The exchange ended: settle the answer (calls ``on_end``). ``server_error`` when a
        2xx answer carried an error or the upstream cut it; else None (the status decides)."""
        self.request_end()
        answer = self.answer
        if answer is None:
            return None
        self.answer = None
        self.client_left = client_left
        end = self.end = answer.finish(time.perf_counter(), complete)
        if end.error is not None or (end.truncated and not client_left):
            return _SERVER
        return None

    # -- hooks (sidecar.apis.hooks.Hooks), called by the API module
    def on_model(self, model: str, version: str) -> None:
        req = self.req
        if version and req.series.version == "" and req.series.model == model:
            self.st.telemetry.relabel(req, model, version)

    def on_first_token(self, t: float, n: int) -> None:
        req = self.req
        ttft = self.st.series(req.series).ttft
        span = req.span
        if span is not None:
            ctx = span.get_span_context()
            if ctx.trace_flags.sampled:
                ttft.observe(t - req.start, {"trace_id": format(ctx.trace_id, "032x")})
                return
        ttft.observe(t - req.start)

    def on_token(self, t: float, n: int, gap: float) -> None:
        series = self.req.series
        llm = series.llm
        if llm is None:  # relabelled since the first token
            llm = self.st.series(series)
        itl = llm.itl  # GapHistogram.observe, inline: once per token
        itl.counts[bisect_left(itl.bounds, gap)] += 1
        itl.sum += gap

    def on_end(self, end: StreamEnd) -> None:
        req = self.req
        s = self.st.series(req.series)
        if end.prompt_tokens:
            s.prompt.inc(end.prompt_tokens)
        if end.completion_tokens:
            s.generation.inc(end.completion_tokens)
        if end.tpot is not None:
            s.tpot.observe(end.tpot)
        span = req.span
        if span is not None:
            if end.prompt_tokens is not None:
                span.set_attribute("gen_ai.usage.input_tokens", end.prompt_tokens)
            if end.completion_tokens is not None:
                span.set_attribute("gen_ai.usage.output_tokens", end.completion_tokens)
            if end.finish_reasons:
                span.set_attribute("gen_ai.response.finish_reasons", list(end.finish_reasons))
            if end.first_token_t is not None:
                span.set_attribute("inferwatch.time_to_first_token_s", end.first_token_t - req.start)
            if end.error is not None:
                span.set_attribute("error.type", "stream_error")
                span.set_attribute("inferwatch.stream.error", end.error[:500])
            elif end.truncated:
                span.set_attribute("error.type", "client_left" if self.client_left else "stream_truncated")
