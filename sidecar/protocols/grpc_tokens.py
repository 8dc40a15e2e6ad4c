"""Token timing for ``ModelStreamInfer``: a decoupled model (an LLM on Triton) answers one request
with many responses, one per token. The relay counts the tokens; recording them is the one
path the HTTP streams take (``sidecar.core.streams``: the same hooks, series and span attributes).

Per request message on the stream (its observation from ``Telemetry.begin``), a
``hooks.Stream`` over ``StreamTelemetry.token_stream``:

- each response carrying generated text (``grpc_wire.response_has_text``: a non-empty
  ``text_output``) is one token: the first gives the TTFT (from the request message's arrival),
  each later one an inter-token gap;
- when the request is closed (its final response, its in-stream error, or the stream's end), the
  generation tokens are counted and TPOT observed (``hooks.Stream``'s arithmetic);
- a mid-stream error is already the request's outcome (``server_error``, from its code); the
  tokens sent before it are counted.
- ``generated`` totals the call's tokens, every request: a stream charged by a ``tokens``
  bucket is refunded against it at the call's end (``Admission.refund``).

``streams`` is the LLM telemetry (``sidecar.core.streams.StreamTelemetry``). Unary calls never
reach this module.
"""

from __future__ import annotations

import time
from typing import Any

from sidecar.apis.hooks import Stream
from sidecar.protocols.grpc_wire import response_has_text


class StreamTokens:
    """The token streams of one ``ModelStreamInfer`` call's open requests (both engines).

    Fed each response before the stream matcher closes anything (``response``), and each
    request as the matcher hands it back (``closed``)."""

    __slots__ = ("generated", "open", "streams")

    def __init__(self, streams: Any) -> None:
        self.streams = streams
        self.open: dict[Any, Stream] = {}  # observation -> its tokens, while it has any
        self.generated = 0  # the call's tokens so far, every request

    def response(self, matcher: Any, head: bytes, rid: str, error: str) -> None:
        """A response (or its head): with text, a token of the oldest open request of ``rid``."""
        if error or not response_has_text(head):
            return
        tel = matcher.peek(rid)
        if tel is None:
            return
        stream = self.open.get(tel)
        if stream is None:
            stream = self.open[tel] = Stream(self.streams.token_stream(tel))
        stream.content(time.perf_counter(), 1)
        self.generated += 1

    def closed(self, tel: Any, truncated: bool = False) -> None:
        """The request ``tel`` is over: record its tokens (before its observation ends)."""
        stream = self.open.pop(tel, None)
        if stream is not None:
            stream.close(truncated)
