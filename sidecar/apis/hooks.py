"""What every generative API module hands to telemetry: the same few events, whatever the engine.

An API module (``openai.py``, ``triton_generate.py``) is fed the answer's body as it passes, with
the time each chunk passed (the caller's clock, so tests pass their own), and calls, in order:

- ``on_model(model, version)``: at most once, when the answer names them (Triton's events carry
  the served version; OpenAI answers do not: there the request's body names the model);
- ``on_first_token(t, n)``: the first event that carries generated content (not vLLM's role-only
  first event), ``n`` tokens in it;
- ``on_token(t, n, gap)``: each later content event, ``gap`` the seconds since the previous one
  (the inter-token latency, one observation per event);
- ``on_end(end)``: once, from ``finish()``, with a ``StreamEnd``.

``Stream`` holds the timing arithmetic the modules share; ``loads`` reads one event's JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

# The most of a one-body answer (not a stream) an observer reads for its usage, finish reasons
# or error: a larger body still passes to the client whole, recorded as unreadable.
MAX_ANSWER_BODY = 4 * 1024 * 1024

# The C scanner behind json.loads, with json.loads's default settings.
_scan = json.JSONDecoder().scan_once


def loads(data: bytes) -> Any:
    """``json.loads(data)``, the same result or error, without its per-call Python layers
    (encoding detection, whitespace regexes) for the usual event: a UTF-8 object with nothing
    around it. Anything else goes to ``json.loads`` itself."""
    if data[:1] == b"{" and data[1:2] != b"\0":  # an object, in what json reads as UTF-8
        try:
            text = data.decode("utf-8", "surrogatepass")
            obj, end = _scan(text, 0)
            if end == len(text):
                return obj
        except Exception:  # json.loads below raises what json raises
            pass
    return json.loads(data)


@dataclass(slots=True)
class StreamEnd:
    """How an answer ended, and what it held.

    - ``prompt_tokens``, ``completion_tokens``: from the answer's ``usage`` when it has one
      (``usage_reported``), else ``completion_tokens`` is ``counted_tokens`` and ``prompt_tokens``
      is None; None when nothing could be counted (a non-streamed answer without usage).
    - ``counted_tokens``: tokens counted from the content events (one per content choice in an
      event); see README.md for how close that is to ``usage``.
    - ``finish_reasons``: one per choice that finished (``stop``, ``length``, ...), in order.
    - ``error``: the message of an error the answer carried (an error event inside a stream, or
      an error body); ``error_code`` its code when it gave one (vLLM: 500 when the engine died).
      Inside a 200 stream, the sidecar counts it as a ``server_error`` whatever the code.
    - ``truncated``: the body ended before the protocol's own end (``data: [DONE]``, or the
      caller said the body was cut): the upstream died or the client left mid-stream.
    - ``parse_error``: the sidecar could not read the answer (an over-long SSE line, a body that
      is not the API's JSON); the figures above are then partial. Not the upstream's fault.
    - ``first_token_t``, ``last_token_t``, ``tpot``: times of the first and last content events
      and (last - first) / (completion_tokens - 1), None with fewer than two tokens.
    """

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    usage_reported: bool = False
    finish_reasons: tuple[str, ...] = ()
    error: str | None = None
    error_code: int | None = None
    truncated: bool = False
    parse_error: str | None = None
    counted_tokens: int = 0
    events: int = 0
    content_events: int = 0
    first_token_t: float | None = None
    last_token_t: float | None = None
    tpot: float | None = None
    streamed: bool = True


class Hooks(Protocol):
    """What telemetry implements; see the module docstring for the order of calls."""

    def on_model(self, model: str, version: str) -> None: ...

    def on_first_token(self, t: float, n: int) -> None: ...

    def on_token(self, t: float, n: int, gap: float) -> None: ...

    def on_end(self, end: StreamEnd) -> None: ...


class NoHooks:
    """Hooks that do nothing: subclass it and override what you need."""

    def on_model(self, model: str, version: str) -> None:
        pass

    def on_first_token(self, t: float, n: int) -> None:
        pass

    def on_token(self, t: float, n: int, gap: float) -> None:
        pass

    def on_end(self, end: StreamEnd) -> None:
        pass


class Stream:
    """Token timing shared by the API modules: first token, gaps, TPOT, the end called once."""

    __slots__ = ("_ended", "end", "hooks")

    def __init__(self, hooks: Hooks, streamed: bool = True) -> None:
        self.hooks = hooks
        self.end = StreamEnd(streamed=streamed)
        self._ended = False

    def content(self, t: float, n: int) -> None:
        """A content event carrying ``n`` tokens passed at ``t``."""
        end = self.end
        end.content_events += 1
        end.counted_tokens += n
        last = end.last_token_t
        end.last_token_t = t
        if last is None:
            end.first_token_t = t
            self.hooks.on_first_token(t, n)
        else:
            self.hooks.on_token(t, n, t - last)

    def close(self, truncated: bool) -> StreamEnd:
        """Settle TPOT and call ``on_end`` (once; later calls return the same end)."""
        end = self.end
        if self._ended:
            return end
        self._ended = True
        end.truncated = end.truncated or truncated
        if not end.usage_reported and end.streamed:
            end.completion_tokens = end.counted_tokens
        tokens = end.completion_tokens
        if tokens is not None and tokens > 1 and end.content_events > 1:
            end.tpot = (end.last_token_t - end.first_token_t) / (tokens - 1)
        self.hooks.on_end(end)
        return end
