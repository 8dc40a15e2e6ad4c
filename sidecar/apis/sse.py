"""Server-sent events (the WHATWG ``text/event-stream`` format), parsed as the bytes pass.

``SSEParser.feed(chunk)`` takes whatever bytes arrived, split anywhere (inside a field name, between
the CR and the LF of a CRLF, inside a UTF-8 character or the byte order mark), and returns the
events that chunk completed (``feed_data(chunk)``: only their data, which is all the observers
read). State between calls is the current line's bytes (capped at ``max_line``), the data lines
of the one event under construction (capped at ``max_event``), its event type and the last event
id: never the stream. Whole one-line ``data:`` events with LF ends, the shape of every engine's
token stream, take a short path with the same result.

Rules (https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation):
lines end with CRLF, LF or CR; a blank line dispatches the event; a line starting with ``:`` is a
comment; ``field: value`` loses one space after the colon; ``data`` lines are joined with LF;
an event with no ``data`` line is not dispatched; ``id`` persists across events; ``retry`` and
unknown fields are ignored (a proxy does not reconnect); a leading byte order mark is dropped; an
event the stream ends inside of is discarded.

An over-long line or event is not fatal: the event it belongs to is dropped (up to its blank line),
``errors`` is incremented and ``error`` says why, and parsing goes on with the next event.
"""

from __future__ import annotations

from typing import NamedTuple

_BOM = b"\xef\xbb\xbf"


class Event(NamedTuple):
    """One dispatched event. ``data`` is bytes (``json.loads`` takes them as they are)."""

    data: bytes
    event: str = "message"
    id: str | None = None


class SSEParser:
    """Incremental ``text/event-stream`` parser; see the module docstring."""

    __slots__ = (
        "_data",
        "_data_len",
        "_discard",
        "_event",
        "_fast_max",
        "_first",
        "_idle",
        "_last_id",
        "_line",
        "_long",
        "_skip_lf",
        "error",
        "errors",
        "max_event",
        "max_line",
    )

    def __init__(self, max_line: int = 256 * 1024, max_event: int = 1024 * 1024) -> None:
        self.max_line = max_line
        self.max_event = max_event
        self._line = b""  # the current line's bytes so far (no line end seen yet)
        self._long = False  # inside an over-long line: its bytes are skipped up to its end
        self._skip_lf = False  # the last chunk ended in CR: a LF starting the next one belongs to it
        self._first = True  # the stream's first line: may start with a byte order mark
        self._data: list[bytes] = []  # data lines of the event under construction
        self._data_len = 0
        self._event = ""
        self._last_id: str | None = None
        self._discard = False  # dropping an over-long event up to its blank line
        self._idle = False  # nothing of the above pending, the first line passed: the short path
        self.errors = 0
        self.error: str | None = None
        # The longest "data: ..." line the fast path takes: within both limits.
        self._fast_max = min(max_line, max_event + 5)

    def feed(self, chunk: bytes) -> list[Event]:
        """The events ``chunk`` completed (usually none or one), in order."""
        if self._idle and chunk[-2:] == b"\n\n" and b"\r" not in chunk:
            data = self._whole(chunk)
            if data is not None:
                last_id = self._last_id
                return [Event(d, "message", last_id) for d in data]
        return self._slow(chunk)

    def feed_data(self, chunk: bytes) -> list[bytes]:
        """The data of the events ``chunk`` completed: ``[e.data for e in feed(chunk)]``, for a
        reader that needs no event names or ids (the observers), without building the events."""
        if self._idle and chunk[-2:] == b"\n\n" and b"\r" not in chunk:
            # The short path, inline for the usual read: one whole event.
            if chunk.find(b"\n") == len(chunk) - 2:
                if chunk[:6] == b"data: " and len(chunk) - 2 <= self._fast_max:
                    return [chunk[6:-2]]
            else:
                data = self._whole(chunk)
                if data is not None:
                    return data
        return [e.data for e in self._slow(chunk)]

    def _whole(self, chunk: bytes) -> list[bytes] | None:
        """The short path, for the shape of every engine's token stream: with nothing pending
        (``_idle``), a ``chunk`` ending in a blank line and without CR that is whole one-line
        ``data: X`` events. Their data, the same as the line by line path gives with a tenth of
        its work; None when ``chunk`` is not so."""
        data = []
        limit = self._fast_max
        for piece in chunk[:-2].split(b"\n\n"):
            if piece[:6] != b"data: " or len(piece) > limit or b"\n" in piece:
                return None
            data.append(piece[6:])
        return data

    def _slow(self, chunk: bytes) -> list[Event]:
        events = self._lines(chunk)
        self._idle = not (
            self._line
            or self._data
            or self._event
            or self._skip_lf
            or self._first
            or self._long
            or self._discard
        )
        return events

    def _lines(self, chunk: bytes) -> list[Event]:
        if not chunk:
            return []
        if self._skip_lf:
            self._skip_lf = False
            if chunk[0] == 10:
                chunk = chunk[1:]
                if not chunk:
                    return []
        events: list[Event] = []
        # bytes.splitlines splits at exactly CRLF, LF and CR; keepends tells a complete line from
        # the unfinished tail.
        for piece in chunk.splitlines(True):
            last = piece[-1]
            if last != 10 and last != 13:  # the unfinished last line: keep it, capped
                if self._long:
                    continue
                if len(self._line) + len(piece) > self.max_line:
                    self._overflow(f"line longer than {self.max_line} bytes")
                    self._line = b""
                    self._long = True
                    continue
                self._line += piece
                continue
            end = 2 if piece.endswith(b"\r\n") else 1
            if self._long:  # the end of an over-long line, already counted
                self._long = False
                continue
            line = self._line + piece[:-end] if self._line else piece[:-end]
            self._line = b""
            if len(line) > self.max_line:
                self._overflow(f"line longer than {self.max_line} bytes")
            else:
                event = self._take_line(line)
                if event is not None:
                    events.append(event)
        if chunk[-1] == 13:  # a CR at the very end may be the first half of a CRLF
            self._skip_lf = True
        return events

    def _overflow(self, why: str) -> None:
        self.errors += 1
        self.error = why
        self._data = []
        self._data_len = 0
        self._event = ""
        self._discard = True

    def _take_line(self, line: bytes) -> Event | None:
        if self._first:
            self._first = False
            if line.startswith(_BOM):
                line = line[3:]
        if not line:
            if self._discard:
                self._discard = False
                return None
            if not self._data:
                self._event = ""
                return None
            event = Event(b"\n".join(self._data), self._event or "message", self._last_id)
            self._data = []
            self._data_len = 0
            self._event = ""
            return event
        if self._discard or line[0] == 58:  # ':' starts a comment
            return None
        field, colon, value = line.partition(b":")
        if colon and value[:1] == b" ":
            value = value[1:]
        if field == b"data":
            self._data_len += len(value) + 1
            if self._data_len > self.max_event:
                self._overflow(f"event longer than {self.max_event} bytes")
                return None
            self._data.append(value)
        elif field == b"event":
            self._event = value.decode("utf-8", "replace")
        elif field == b"id" and b"\0" not in value:
            self._last_id = value.decode("utf-8", "replace")
        return None
