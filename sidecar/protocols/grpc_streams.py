"""The one stream matcher: requests of a ``ModelStreamInfer`` stream waiting for their response.

Both gRPC engines count a stream as one request per message. A response (or an in-stream
error) closes the oldest open request with the same ``id`` (Triton echoes the id, errors
included); an error whose id matches nothing closes the oldest open request of all; a decoupled
model's response flagged ``triton_final_response=false`` closes nothing. What is still open when
the stream ends is closed with the stream's status (``drain``).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any


class StreamMatcher:
    """Open requests of one stream, by request id, oldest first. Entries are (observation,
    request bytes); ``take`` and ``drain`` hand them back for the caller to close."""

    __slots__ = ("open", "pending", "seq")

    def __init__(self) -> None:
        # id -> deque of (sequence number, observation, request bytes), oldest first.
        self.pending: dict[str, collections.deque] = {}
        self.open = 0
        self.seq = 0

    def __len__(self) -> int:
        return self.open

    def add(self, rid: str, tel: Any, size: int) -> None:
        queue = self.pending.get(rid)
        if queue is None:
            queue = self.pending[rid] = collections.deque()
        self.seq += 1
        queue.append((self.seq, tel, size))
        self.open += 1

    def take(self, rid: str, error: bool, final: bool | None) -> tuple[Any, int] | None:
        """The request a response closes: see the module docstring. None when it closes none."""
        if final is False or not self.open:
            return None
        queue = self.pending.get(rid)
        if not queue:
            if not error:
                return None
            # An error that names no open request: the oldest open request failed.
            rid = min(self.pending, key=lambda k: self.pending[k][0][0])
            queue = self.pending[rid]
        _, tel, size = queue.popleft()
        if not queue:
            del self.pending[rid]
        self.open -= 1
        return tel, size

    def peek(self, rid: str) -> Any:
        """The observation a response that closes nothing belongs to (a decoupled model's token):
        the oldest open request with ``rid``, None when none is open under it."""
        queue = self.pending.get(rid)
        return queue[0][1] if queue else None

    def drain(self) -> Iterator[tuple[Any, int]]:
        """Every open request, oldest first; the matcher is empty afterwards."""
        entries = sorted(e for q in self.pending.values() for e in q)
        self.pending.clear()
        self.open = 0
        for _, tel, size in entries:
            yield tel, size
