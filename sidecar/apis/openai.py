"""The OpenAI-compatible API's answers (``/v1/chat/completions``, ``/v1/completions``), measured the
same way for every engine that speaks it (vLLM, SGLang, TGI, NIM, ...).

``OpenAIAnswer(hooks, streamed)`` is fed the answer body chunk by chunk with the time each chunk
passed (``feed(chunk, t)``), then ``finish(t, complete)`` once. ``streamed`` comes from the answer's
content type (``text/event-stream``: ``is_event_stream``).

A streamed answer is server-sent events, one JSON object per event, ended by ``data: [DONE]``:

- a **content event** has a choice with generated text: ``delta.content`` (chat),
  ``delta.reasoning_content``/``reasoning`` and ``delta.tool_calls`` (chat), or ``text``
  (completions). vLLM's first chat event carries only ``{"role": "assistant", "content": ""}``:
  no content, no token. TTFT and the gaps are taken at content events only;
- tokens are counted per choice (see ``_tokens``): one each, or the ``token_ids``/``logprobs``
  it lists; an empty ``content`` (vLLM holding back a partial UTF-8 character) is a token too;
- ``finish_reason`` of each choice, ``usage`` (the last one wins: with
  ``stream_options.continuous_usage_stats`` every event has one);
- an **error event** (vLLM when its engine dies: ``{"error": {"message": ..., "code": 500}}``, and
  the older ``{"object": "error", "message": ..., "code": ...}``) sets ``error``/``error_code``.

A stream that ends without ``[DONE]`` (or that the caller says was cut) is ``truncated``.

A non-streamed answer is one JSON object (a completion, or an error body), read whole at the end
up to ``max_body`` bytes: its ``usage``, ``finish_reason`` of each choice, or its ``error``. It has
no token timing (the whole answer arrives at once, so no TTFT and no gaps are reported).
"""

from __future__ import annotations

import json

from .hooks import MAX_ANSWER_BODY, Hooks, Stream, StreamEnd, loads
from .sse import SSEParser

_DONE = b"[DONE]"


def is_event_stream(content_type: str) -> bool:
    return content_type.split(";", 1)[0].strip().lower() == "text/event-stream"


def _tokens(choice: dict) -> tuple[int, bool]:
    """(tokens in one streamed choice, whether it carries generated content).

    A choice of an event is one token (vLLM sends one per token), or as many as it lists
    (``token_ids``, or ``logprobs`` when the request asked for them). A chat delta with
    ``"content": ""`` is a token whose text was held back (it ends inside a UTF-8 character): it
    counts, but is no content. The role-only first delta and an empty ``{}`` delta are not tokens.
    """
    delta = choice.get("delta")
    if delta is None:  # /v1/completions
        text = choice.get("text")
        if text is None:
            return 0, False
        generated = bool(text)
    elif isinstance(delta, dict):
        generated = bool(
            delta.get("content")
            or delta.get("reasoning_content")
            or delta.get("reasoning")
            or delta.get("tool_calls")
        )
        if not generated and ("role" in delta or "content" not in delta):
            return 0, False
    else:
        return 0, False
    listed = choice.get("token_ids")
    if not isinstance(listed, list):
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            listed = logprobs.get("content") if delta is not None else logprobs.get("tokens")
    return (len(listed) if isinstance(listed, list) and listed else 1), generated


class OpenAIAnswer:
    """Observer of one OpenAI-compatible answer; see the module docstring."""

    __slots__ = ("_body", "_done", "_end", "_max_body", "_sse", "_stream", "streamed")

    def __init__(
        self, hooks: Hooks, streamed: bool, max_body: int = MAX_ANSWER_BODY, sse: SSEParser | None = None
    ) -> None:
        self.streamed = streamed
        self._stream = Stream(hooks, streamed)
        self._end = self._stream.end
        self._sse = sse or SSEParser()
        self._done = False
        self._body: bytearray | None = None if streamed else bytearray()
        self._max_body = max_body

    @property
    def end(self) -> StreamEnd:
        """The figures so far (final after ``finish``)."""
        return self._end

    @property
    def ended(self) -> bool:
        """The stream's own end (``data: [DONE]``) has passed: a client that leaves now had it
        all (the official client closes at ``[DONE]``, often before the HTTP body's end)."""
        return self._done

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
        if self._done:
            return
        sse = self._sse
        errors = sse.errors
        for data in sse.feed_data(chunk):
            self._event(data, t)
            if self._done:
                break
        if sse.errors != errors:
            self._end.parse_error = sse.error

    def _event(self, data: bytes, t: float) -> None:
        end = self._end
        end.events += 1
        if data == _DONE:
            self._done = True
            return
        try:
            obj = loads(data)
        except (ValueError, RecursionError):  # RecursionError: nested too deep for json
            end.parse_error = "an event that is not JSON"
            return
        if not isinstance(obj, dict):
            end.parse_error = "an event that is not a JSON object"
            return
        if ("error" in obj or obj.get("object") == "error") and self._error(obj):
            return
        choices = obj.get("choices")
        if choices:
            content = held = 0
            for choice in choices:
                if not isinstance(choice, dict):
                    continue
                tokens, generated = _tokens(choice)
                if generated:
                    content += tokens
                else:
                    held += tokens
                reason = choice.get("finish_reason")
                if reason:
                    end.finish_reasons += (str(reason),)
            end.counted_tokens += held
            if content:
                self._stream.content(t, content)
        usage = obj.get("usage")
        if usage:
            self._usage(usage)

    def _usage(self, usage: object) -> None:
        if not isinstance(usage, dict):
            return
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        end = self._end
        if type(prompt) is int:  # not bool
            end.prompt_tokens = prompt
        if type(completion) is int:
            end.completion_tokens = completion
            end.usage_reported = True

    def _error(self, obj: dict) -> bool:
        """Record the error an object carries; True when it was one."""
        err = obj.get("error")
        if isinstance(err, dict):
            message, code = err.get("message"), err.get("code")
        elif isinstance(err, str):  # some servers send a bare message
            message, code = err, obj.get("code")
        elif obj.get("object") == "error":
            message, code = obj.get("message"), obj.get("code")
        else:
            return False
        end = self._end
        end.error = str(message) if message is not None else "error"
        if isinstance(code, int):
            end.error_code = code
        elif isinstance(code, str) and code.isdigit():
            end.error_code = int(code)
        return True

    def finish(self, t: float, complete: bool = True) -> StreamEnd:
        """The body ended at ``t``; ``complete`` False when it was cut (upstream died, client left).
        Calls ``on_end`` once and returns the same ``StreamEnd``."""
        if not self.streamed:
            if self._body is not None and complete:
                self._whole(bytes(self._body))
            self._body = None
            return self._stream.close(truncated=not complete)
        return self._stream.close(truncated=not (complete and self._done))

    def _whole(self, body: bytes) -> None:
        end = self.end
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: nested too deep for json
            end.parse_error = "an answer that is not JSON"
            return
        if not isinstance(obj, dict):
            end.parse_error = "an answer that is not a JSON object"
            return
        if self._error(obj):
            return
        for choice in obj.get("choices") or ():
            if isinstance(choice, dict) and choice.get("finish_reason"):
                end.finish_reasons += (str(choice["finish_reason"]),)
        self._usage(obj.get("usage"))
