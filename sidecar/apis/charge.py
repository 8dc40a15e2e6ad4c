"""What an LLM request costs the fleet spec's ``tokens`` bucket, read from its body before it goes
upstream (the HTTP proxy holds the body until this decides; sidecar/README.md, "Overload").

    charge = Charge(generates=True)   # one per request (routes.Api.charge())
    for chunk in body:                # while the transport holds the body
        if charge.feed(chunk): break  # True: nothing later in the body can change the charge
    charge.finish()                   # at the body's end (or when the hold window is full)
    charge.model                      # the body's top-level "model", or None
    charge.tokens(body_bytes)         # the cost: prompt estimate + n * max_tokens

The cost, as the spec says ("prompt estimate + max_tokens"):

- prompt estimate: the body's bytes / ``BYTES_PER_TOKEN`` (4, the usual figure for English text
  in BPE tokenizers), rounded up. The JSON around the prompt counts too, so it errs high; the
  sidecar cannot tokenize (no tokenizer, and it must not read the prompt into memory).
- generation: ``n`` (default 1) times ``max_completion_tokens`` or else ``max_tokens`` (OpenAI's
  newer name wins when both are sent). Neither sent: ``DEFAULT_MAX_TOKENS`` (256). The engine's
  own default is unknowable here (vLLM's is the rest of the context, Triton's a model parameter):
  charging nothing would let unbounded requests through free, charging a whole context would shed
  them outright, so an absent limit is charged as a moderate answer. Clients that set
  ``max_tokens`` are charged exactly.
- embeddings (``generates=False``): the prompt estimate only.

A negative or zero value is charged as 0 generated tokens (the upstream refuses it anyway).

The refund (``used``; the HTTP proxy calls ``Admission.refund`` once, at the exchange's end; a
gRPC stream is refunded by its own count, ``sidecar.protocols.grpc_tokens``):
the bucket gets back ``charged - used``, never negative (an answer longer than its charge is not
charged more afterwards), the bucket never above its capacity. What a request used:

- the answer's ``usage`` when it reported one: ``prompt_tokens + completion_tokens``;
- else the prompt estimate + the generation tokens counted from its content events (a stream
  that failed or was cut after 3 tokens used its prompt estimate + 3);
- no answer body read (an error status, a timeout or a broken connection before the answer, a
  client that left first): the prompt estimate, no tokens were delivered;
- unknown, so the whole charge: a one-body answer without ``usage`` (Triton's ``generate``:
  nothing to count) or an answer the observer could not read (``parse_error``).

A request that never reached the server (shed by the queue, its client gone while it waited or
connected, the connection refused) gets its whole charge back: it cost the server nothing.
"""

from __future__ import annotations

from .hooks import StreamEnd
from .json_scan import OPENAI_FIELDS, BodyScanner, Outcome

BYTES_PER_TOKEN = 4
DEFAULT_MAX_TOKENS = 256
# The most body bytes the transport holds while waiting for the fields. The official openai
# client sends `messages` first and `model` and `max_tokens` after it, so the window must hold a
# whole prompt: 1 MiB is a 128k-token context of English text with room to spare. Past it the
# transport decides with what it has read (see the README).
WINDOW = 1024 * 1024
_MAX_GENERATED = 1 << 31  # n * max_tokens above this is charged as this (the bucket clamps it anyway)


class Charge:
    """The token cost of one request, from its body's ``model``, ``max_tokens``,
    ``max_completion_tokens`` and ``n`` (``json_scan.BodyScanner``)."""

    __slots__ = ("_scan", "generates")

    def __init__(self, generates: bool, max_model_bytes: int = 256) -> None:
        self.generates = generates
        self._scan = BodyScanner(fields=OPENAI_FIELDS, max_value=max_model_bytes)

    def feed(self, chunk: bytes) -> bool:
        """Scan the next body bytes; True once every field is known or the body is not JSON
        (the scanner stopped): the transport may decide now."""
        scan = self._scan
        if not scan.done:
            scan.feed(chunk)
        return scan.done

    def finish(self) -> None:
        """The body ended (or the window is full): what was not met is absent."""
        if not self._scan.done:
            self._scan.finish()

    @property
    def model(self) -> str | None:
        """The body's top-level ``model`` (None: absent, malformed, too long, or not read yet)."""
        scan = self._scan
        return scan.value if scan.outcome is Outcome.FOUND else None

    def tokens(self, body_bytes: int) -> int:
        """The cost: ceil(body_bytes / 4) + n * max tokens (see the module doc)."""
        cost = prompt_estimate(body_bytes)
        if not self.generates:
            return cost
        fields = self._scan.fields
        limit = fields.get("max_completion_tokens")
        if limit is None:
            limit = fields.get("max_tokens", DEFAULT_MAX_TOKENS)
        n = fields.get("n", 1)
        return cost + min(_MAX_GENERATED, max(0, int(limit)) * max(1, int(n)))


def prompt_estimate(body_bytes: int) -> int:
    """The charge's prompt part: ceil(body_bytes / 4)."""
    return -(-body_bytes // BYTES_PER_TOKEN)


def used(charged: int, prompt: int, end: StreamEnd | None) -> int:
    """What an admitted request that reached the server used of its charge ``charged``
    (``prompt``: the charge's prompt estimate), from its answer's ``end`` (None: no answer body
    was read). See the module doc; the refund is ``charged - used``, at least 0."""
    if end is None:
        return prompt
    if end.parse_error is not None:
        return charged  # the counts are partial: keep the charge
    if end.usage_reported:
        return (prompt if end.prompt_tokens is None else end.prompt_tokens) + (end.completion_tokens or 0)
    if end.completion_tokens is None:
        return charged  # a one-body answer without usage: nothing was counted
    return prompt + end.completion_tokens
