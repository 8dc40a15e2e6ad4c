"""Token timing for ``ModelStreamInfer``: a decoupled model (an LLM on Triton) answers one request
with many responses, one per token, and the relay records them as the HTTP side records an SSE
stream, through the same hooks (``sidecar.apis.hooks``) and the same LLM telemetry.

Per request message on the stream (its observation from ``Telemetry.begin``), ``TokenStream``:

- each response carrying generated text (``grpc_wire.response_has_text``: a non-empty
  ``text_output``) is one token: the first gives the TTFT (from the request message's arrival),
  each later one an inter-token gap;
- when the request is closed (its final response, its in-stream error, or the stream's end), the
  generation tokens are counted and TPOT observed (``hooks.Stream``'s arithmetic);
- a mid-stream error is already the request's outcome (``server_error``, from its code); the
  tokens sent before it are counted.

``streams`` is the LLM telemetry (``sidecar.core.streams.StreamTelemetry``); this module needs only its
``series(telemetry_series)``, the pre-resolved children ``ttft``, ``itl``, ``tpot`` and
``generation`` of a request's series. Unary calls never reach this module.
"""

from __future__ import annotations

import time
from typing import Any

from sidecar.apis.hooks import Stream, StreamEnd
from sidecar.protocols.grpc_wire import response_has_text


class TokenStream:
    """The hooks of one request of a stream, and its ``hooks.Stream`` (TTFT, gaps, TPOT)."""

    __slots__ = ("req", "stream", "streams")

    def __init__(self, streams: Any, req: Any) -> None:
        self.streams = streams
        self.req = req
        self.stream = Stream(self)

    def token(self, t: float) -> None:
        """A response with generated text passed at ``t`` (``time.perf_counter()``)."""
        self.stream.content(t, 1)

    def close(self, truncated: bool) -> StreamEnd:
        """The request is over (once): tokens and TPOT are recorded."""
        return self.stream.close(truncated)

    # -- sidecar.apis.hooks.Hooks
    def on_model(self, model: str, version: str) -> None:
        pass  # the request message named them: the observation has them already

    def on_first_token(self, t: float, n: int) -> None:
        req = self.req
        ttft = self.streams.series(req.series).ttft
        span = req.span
        if span is not None:
            ctx = span.get_span_context()
            if ctx.trace_flags.sampled:
                ttft.observe(t - req.start, {"trace_id": format(ctx.trace_id, "032x")})
                return
        ttft.observe(t - req.start)

    def on_token(self, t: float, n: int, gap: float) -> None:
        self.streams.series(self.req.series).itl.observe(gap)

    def on_end(self, end: StreamEnd) -> None:
        req = self.req
        s = self.streams.series(req.series)
        if end.completion_tokens:
            s.generation.inc(end.completion_tokens)
        if end.tpot is not None:
            s.tpot.observe(end.tpot)
        span = req.span
        if span is not None and end.completion_tokens is not None:
            span.set_attribute("gen_ai.usage.output_tokens", end.completion_tokens)


class StreamTokens:
    """The token streams of one ``ModelStreamInfer`` call's open requests (both engines).

    Fed each response before the stream matcher closes anything (``response``), and each
    request as the matcher hands it back (``closed``)."""

    __slots__ = ("open", "streams")

    def __init__(self, streams: Any) -> None:
        self.streams = streams
        self.open: dict[Any, TokenStream] = {}  # observation -> its tokens, while it has any

    def response(self, matcher: Any, head: bytes, rid: str, error: str) -> None:
        """A response (or its head): with text, a token of the oldest open request of ``rid``."""
        if error or not response_has_text(head):
            return
        obs = matcher.peek(rid)
        if obs is None:
            return
        ts = self.open.get(obs)
        if ts is None:
            ts = self.open[obs] = TokenStream(self.streams, obs)
        ts.token(time.perf_counter())

    def closed(self, obs: Any, truncated: bool = False) -> None:
        """The request ``obs`` is over: record its tokens (before its observation ends)."""
        ts = self.open.pop(obs, None)
        if ts is not None:
            ts.close(truncated)
