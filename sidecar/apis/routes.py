"""Which generative API a request path speaks, and what the transport feeds for it.

``classify(path)`` (a request path, query removed) returns an ``Api`` or None (KServe v2
inference and anything else: nothing to observe beyond the request). The transport asks once
per distinct path and caches the answer, so a KServe request pays nothing here. An ``Api``
gives the transport, per request:

- ``model_scan()``: a ``ModelScan`` fed the request body as it streams upstream (``feed(chunk)``
  returns the body's ``model`` the moment it is read, then None; ``finish()`` at the body's end),
  or None when the model comes from the path;
- ``answer(hooks, content_type)``: the answer's observer (``feed(chunk, t)``, ``finish(t,
  complete)``), which reports through ``hooks`` (``hooks.Hooks``);
- ``charge()``: a ``charge.Charge`` that reads the body's token cost (and model) before the
  request is admitted, when per-model limits are on; None for a route with no body to charge.

Imports point from here to the API modules; the transport sees only these few methods.
"""

from __future__ import annotations

from .charge import Charge
from .hooks import Hooks
from .json_scan import BodyScanner, Outcome
from .openai import OpenAIAnswer, is_event_stream
from .triton_generate import TritonGenerateAnswer

# A model name longer than this (as sent) is not a name any server lists: no label.
MAX_MODEL_BYTES = 256


class ModelScan:
    """The OpenAI body's top-level ``model``, read as the body passes (``json_scan``)."""

    __slots__ = ("_scan",)

    def __init__(self) -> None:
        self._scan = BodyScanner(max_value=MAX_MODEL_BYTES)

    def feed(self, chunk: bytes) -> str | None:
        """The model, on the chunk that completes it; else None (also once decided)."""
        scan = self._scan
        if scan.done:
            return None
        scan.feed(chunk)
        return scan.value if scan.outcome is Outcome.FOUND else None

    def finish(self) -> str:
        """At the body's end: why no model was found ("absent", "malformed", "too_long"), or ""."""
        scan = self._scan
        return "" if scan.outcome is Outcome.FOUND else scan.finish().value


class Api:
    """One generative route: its name for spans, and the per-request parts."""

    __slots__ = ("operation", "route", "scans_body", "streams")

    def __init__(self, route: str, operation: str, scans_body: bool, streams: bool | None) -> None:
        self.route = route  # the http.route template
        self.operation = operation  # gen_ai.operation.name
        self.scans_body = scans_body  # the model is in the body, not the path
        self.streams = streams  # True: always SSE (generate_stream); None: the content type says

    def model_scan(self) -> ModelScan | None:
        return ModelScan() if self.scans_body else None

    def charge(self) -> Charge | None:
        """The request's token cost, read from its body (embeddings: the prompt estimate only)."""
        if not self.operation:
            return None
        return Charge(self.operation != "embeddings", MAX_MODEL_BYTES)

    def answer(self, hooks: Hooks, content_type: str) -> OpenAIAnswer | TritonGenerateAnswer | None:
        streamed = is_event_stream(content_type)
        if self.scans_body:
            return OpenAIAnswer(hooks, streamed) if self.operation else None
        return TritonGenerateAnswer(hooks, streamed)


CHAT = Api("/v1/chat/completions", "chat", True, None)
COMPLETIONS = Api("/v1/completions", "text_completion", True, None)
EMBEDDINGS = Api("/v1/embeddings", "embeddings", True, None)
MODELS = Api("/v1/models", "", False, None)  # a listing: nothing to measure but the request
GENERATE = "/v2/models/{model}/generate"
GENERATE_STREAM = "/v2/models/{model}/generate_stream"
TRITON_GENERATE = Api(GENERATE, "generate", False, False)
TRITON_GENERATE_STREAM = Api(GENERATE_STREAM, "generate", False, True)
_VERSIONED = "/v2/models/{model}/versions/{version}/"
TRITON_GENERATE_V = Api(_VERSIONED + "generate", "generate", False, False)
TRITON_GENERATE_STREAM_V = Api(_VERSIONED + "generate_stream", "generate", False, True)

_OPENAI = {
    b"/v1/chat/completions": CHAT,
    b"/v1/completions": COMPLETIONS,
    b"/v1/embeddings": EMBEDDINGS,
    b"/v1/models": MODELS,
}


def classify(path: bytes) -> Api | None:
    """The generative API of a request path, or None."""
    if path.startswith(b"/v2/models/"):
        versioned = b"/versions/" in path
        if path.endswith(b"/generate"):
            return TRITON_GENERATE_V if versioned else TRITON_GENERATE
        if path.endswith(b"/generate_stream"):
            return TRITON_GENERATE_STREAM_V if versioned else TRITON_GENERATE_STREAM
        return None
    if path.startswith(b"/v1/"):
        return _OPENAI.get(path.rstrip(b"/") if path.endswith(b"/") else path)
    return None
