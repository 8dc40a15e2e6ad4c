"""Admission: whether the sidecar takes one more request, the same decision for every protocol.

One ``Admission`` per process, shared by the HTTP proxy and the gRPC side (both engines), so
``--max-in-flight`` is the total across protocols, as the README says::

    refusal = admission.acquire(model)   # None: admitted; hold it until release()
    if refusal is not None:
        ...the protocol's fixed overload answer (HTTP 503, gRPC RESOURCE_EXHAUSTED), counted...
    ...
    admission.release(model)             # exactly once per admitted request

``acquire`` takes the model so per-model limits (token buckets, queue caps) have their place
here, behind the same two calls; today there is one global limit and the model is not read. A
caller that cannot know the model yet (the gRPC relay admits a call on its header block, before
the message that names it) passes ``MODEL_NONE``. A refusal is one of a few prebuilt values, so
refusing allocates nothing: under overload the answer stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request was refused: ``reason`` is a short stable key (logs, a future label),
    ``message`` the text for the client's overload answer."""

    reason: str
    message: str


IN_FLIGHT = "in_flight"  # the global limit of concurrent requests


class Admission:
    """The global limit of requests in flight (0: none). Not thread-safe: every proxy runs on
    the sidecar's one event loop."""

    __slots__ = ("_full", "active", "limit")

    def __init__(self, max_in_flight: int) -> None:
        self.limit = max_in_flight
        self.active = 0
        self._full = Refusal(IN_FLIGHT, f"inferwatch sidecar: more than {max_in_flight} requests in flight")

    def acquire(self, model: str = "") -> Refusal | None:
        """Admit one request (None) or say why not; an admitted request is released once."""
        if self.limit and self.active >= self.limit:
            return self._full
        self.active += 1
        return None

    def release(self, model: str = "") -> None:
        self.active -= 1
