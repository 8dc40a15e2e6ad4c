"""Triton's generate extension (``POST /v2/models/{m}[/versions/{v}]/generate`` and
``generate_stream``), measured like the OpenAI API: the same hooks, the same ``StreamEnd``.

``TritonGenerateAnswer(hooks, streamed)`` is fed the answer body with the time each chunk passed,
then ``finish(t, complete)``; ``streamed`` is true for ``generate_stream`` (its answer is
``text/event-stream``, also when Triton refuses the request: see below).

``generate_stream`` sends one SSE event per response of the (decoupled) model, each a JSON object
of the model's outputs plus ``model_name`` and ``model_version``:
``data: {"model_name":"tiny_stream","model_version":"1","text_output":"a "}``. An event with a
non-empty ``text_output`` is a content event of one token (a token-streaming model sends one
response per token; TensorRT-LLM's ensemble does too). The first event's name and version (the
version Triton picked when the URL named none) go to ``on_model``. There is no end marker: the
stream ends with the HTTP body, so ``truncated`` is what the caller says (``complete=False``).

Errors, as Triton 2.51 sends them (``tests/test_reference_stream.py`` checks these on the real
server): an error after the status went out (with the first token) is one event
``data: {"error": "<message>"}`` in the 200 stream, and the stream ends; an error before any
token is the same single event with status 400. Non-streamed ``generate`` answers one JSON object
(the outputs, or ``{"error": "<message>"}`` with status 400).

Triton reports no usage and no finish reason: ``completion_tokens`` is the count of content
events when streamed, None when not; ``prompt_tokens`` is None.
"""

from __future__ import annotations

import json

from .hooks import MAX_ANSWER_BODY, Hooks, Stream, StreamEnd, loads
from .sse import SSEParser

TEXT_OUTPUT = "text_output"
_NOT_OBJECT = "an answer that is not a JSON object"


class TritonGenerateAnswer:
    """Observer of one ``generate`` or ``generate_stream`` answer; see the module docstring."""

    __slots__ = ("_body", "_end", "_max_body", "_named", "_sse", "_stream", "streamed")

    def __init__(
        self, hooks: Hooks, streamed: bool, max_body: int = MAX_ANSWER_BODY, sse: SSEParser | None = None
    ) -> None:
        self.streamed = streamed
        self._stream = Stream(hooks, streamed)
        self._end = self._stream.end
        self._sse = sse or SSEParser()
        self._named = False
        self._body: bytearray | None = None if streamed else bytearray()
        self._max_body = max_body

    @property
    def end(self) -> StreamEnd:
        return self._end

    @property
    def ended(self) -> bool:
        """Never before the body's end: Triton's stream has no end marker of its own."""
        return False

    def feed(self, chunk: bytes, t: float) -> None:
        """The next bytes of the answer body, passed at ``t`` (seconds, the caller's clock)."""
        if not self.streamed:
            body = self._body
            if body is not None:
                if len(body) + len(chunk) > self._max_body:
                    self._body = None
                    self.end.parse_error = f"answer longer than {self._max_body} bytes"
                else:
                    body += chunk
            return
        sse = self._sse
        errors = sse.errors
        end = self._end
        for data in sse.feed_data(chunk):
            end.events += 1
            try:  # _object, inline: once per token
                obj = loads(data)
            except (ValueError, RecursionError):
                obj = None
            if type(obj) is not dict:
                end.parse_error = _NOT_OBJECT
                continue
            if obj.get("error") is not None:
                self._error(obj)
                continue
            if not self._named:
                self._name(obj)
            if obj.get(TEXT_OUTPUT):
                self._stream.content(t, 1)
        if sse.errors != errors:
            end.parse_error = sse.error

    def _object(self, data: bytes) -> dict | None:
        try:
            obj = loads(data)
        except (ValueError, RecursionError):  # RecursionError: nested too deep for json
            obj = None
        if not isinstance(obj, dict):
            self.end.parse_error = _NOT_OBJECT
            return None
        return obj

    def _error(self, obj: dict) -> bool:
        err = obj.get("error")
        if err is None:
            return False
        self.end.error = err if isinstance(err, str) else json.dumps(err)
        return True

    def _name(self, obj: dict) -> None:
        if self._named:
            return
        name, version = obj.get("model_name"), obj.get("model_version")
        if isinstance(name, str):
            self._named = True
            self._stream.hooks.on_model(name, version if isinstance(version, str) else "")

    def finish(self, t: float, complete: bool = True) -> StreamEnd:
        """The body ended at ``t``; ``complete`` False when it was cut (upstream died, client left).
        Calls ``on_end`` once and returns the same ``StreamEnd``."""
        if not self.streamed and self._body is not None and complete:
            obj = self._object(bytes(self._body))
            if obj is not None and not self._error(obj):
                self._name(obj)
        self._body = None
        return self._stream.close(truncated=not complete)
