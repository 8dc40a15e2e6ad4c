"""The SSE parser fed raw bytes split at every position: the same events must come out whatever
the split, with LF, CRLF or CR line ends, comments, multi-line data, event names and ids."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.apis.sse import Event, SSEParser

FIXTURES = Path(__file__).parent / "fixtures" / "llm_streams"


def parse(chunks: list[bytes], **limits: int) -> tuple[list[Event], SSEParser]:
    parser = SSEParser(**limits)
    events: list[Event] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return events, parser


def splits(raw: bytes, pairs: bool = False):
    """The stream whole, byte by byte, cut once at every position, and (pairs) twice."""
    yield [raw]
    yield [raw[i : i + 1] for i in range(len(raw))]
    for i in range(len(raw) + 1):
        yield [raw[:i], raw[i:]]
    if pairs:
        for i in range(len(raw) + 1):
            for j in range(i, len(raw) + 1):
                yield [raw[:i], raw[i:j], raw[j:]]


def line_ends(raw: bytes):
    """The stream written with LF, CRLF and CR line ends."""
    yield raw
    yield raw.replace(b"\n", b"\r\n")
    yield raw.replace(b"\n", b"\r")


CASES = [
    pytest.param(b"data: a\n\n", [Event(b"a")], id="one"),
    pytest.param(b"data:a\n\ndata:  b\n\n", [Event(b"a"), Event(b" b")], id="one-space-stripped"),
    pytest.param(b"data: a\ndata: b\n\n", [Event(b"a\nb")], id="multi-line"),
    pytest.param(b"data\n\ndata:\n\n", [Event(b""), Event(b"")], id="empty-data"),
    pytest.param(b": keep-alive\n\n:x\ndata: a\n: mid\ndata: b\n\n", [Event(b"a\nb")], id="comments"),
    pytest.param(
        b"event: delta\ndata: {}\n\nevent: ping\n\ndata: x\n\n",
        [Event(b"{}", "delta"), Event(b"x")],
        id="event-field-and-reset",
    ),
    pytest.param(
        b"id: 7\ndata: a\n\ndata: b\n\nid: 8\0\ndata: c\n\nid\ndata: d\n\n",
        [Event(b"a", id="7"), Event(b"b", id="7"), Event(b"c", id="7"), Event(b"d", id="")],
        id="id-persists-nul-ignored",
    ),
    pytest.param(b"retry: 10\nfoo: bar\ndata: a\n\n", [Event(b"a")], id="retry-and-unknown-ignored"),
    pytest.param(b"\xef\xbb\xbfdata: a\n\n", [Event(b"a")], id="bom"),
    pytest.param(b"data: a\n\n\xef\xbb\xbfdata: b\n\n", [Event(b"a")], id="bom-only-first"),
    pytest.param(b"data: a\n\ndata: b\n", [Event(b"a")], id="unfinished-event-dropped"),
    pytest.param(b"data: a: b:c\n\n", [Event(b"a: b:c")], id="colons-in-value"),
    pytest.param("data: é€😀\n\n".encode(), [Event("é€😀".encode())], id="utf8"),
    pytest.param(
        b'data: {"choices":[]}\n\ndata: [DONE]\n\n',
        [Event(b'{"choices":[]}'), Event(b"[DONE]")],
        id="openai-end",
    ),
]


@pytest.mark.parametrize(("raw", "expected"), CASES)
def test_same_events_at_every_split_and_line_end(raw: bytes, expected: list[Event]) -> None:
    for stream in line_ends(raw):
        for chunks in splits(stream, pairs=len(stream) < 60):
            events, parser = parse(chunks)
            assert events == expected, (stream, chunks)
            assert parser.errors == 0


def test_mixed_line_ends_and_a_cr_before_a_lf_in_the_next_chunk() -> None:
    raw = b"data: a\r\ndata: b\rdata: c\n\r\ndata: d\r\r"
    for chunks in splits(raw, pairs=True):
        assert parse(chunks)[0] == [Event(b"a\nb\nc"), Event(b"d")], chunks
    # A CR then a LF arriving later is one line end, not two (which would dispatch early).
    assert parse([b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n"])[0] == [Event(b"a\nb")]


def test_the_parser_holds_only_the_current_line() -> None:
    parser = SSEParser()
    parser.feed(b"data: " + b"x" * 1000 + b"\n\ndata: partial")
    assert parser._line == b"data: partial"
    assert parser._data == []


@pytest.mark.parametrize("line_end", [b"\n", b"\r\n", b"\r"])
def test_an_over_long_line_drops_its_event_counts_an_error_and_parsing_goes_on(line_end: bytes) -> None:
    raw = (b"data: a\n\ndata: " + b"y" * 40 + b"\ndata: tail\n\ndata: b\n\n").replace(b"\n", line_end)
    for chunks in splits(raw):
        events, parser = parse(chunks, max_line=32)
        assert events == [Event(b"a"), Event(b"b")], chunks
        assert parser.errors == 1
        assert parser.error == "line longer than 32 bytes"
        assert len(parser._line) <= 32


def test_an_over_long_event_is_dropped_the_same_way() -> None:
    raw = b"data: 0123456789\ndata: 0123456789\ndata: 0123456789\n\ndata: ok\n\n"
    for chunks in splits(raw):
        events, parser = parse(chunks, max_event=25)
        assert events == [Event(b"ok")]
        assert (parser.errors, parser.error) == (1, "event longer than 25 bytes")


def test_lines_at_the_limit_pass() -> None:
    line = b"data: " + b"z" * 26
    assert len(line) == 32
    for chunks in splits(line + b"\n\n"):
        events, parser = parse(chunks, max_line=32)
        assert events == [Event(b"z" * 26)] and parser.errors == 0


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.sse")), ids=lambda p: p.stem)
def test_recorded_vllm_streams_byte_by_byte(path: Path) -> None:
    raw = path.read_bytes()
    whole, _ = parse([raw])
    # Every recorded event is one "data: " line followed by a blank line.
    assert [b"data: " + e.data for e in whole] == [x for x in raw.split(b"\n") if x]
    assert parse([raw[i : i + 1] for i in range(len(raw))])[0] == whole
    for cut in range(0, len(raw), 7):
        assert parse([raw[:cut], raw[cut:]])[0] == whole
    assert parse([raw.replace(b"\n", b"\r\n")])[0] == whole


# Whole "data: X" events after the stream's first line take the parser's short path: each must
# give what the line by line path gives for the same bytes.
AFTER_FIRST = [
    b"data: a\n\n",
    b"data: a\n\ndata: b\n\ndata: {}\n\n",  # several events in one read (vLLM bursts)
    b"data: \n\n",
    b"data:a\n\n",  # no space: not the short path's shape
    b"data: a\ndata: b\n\n",
    b"data: a\n\n\n\n",
    b"data: a\n\n: ping\n\n",
    b"\n\n",
    b"data: a\r\n\r\n",
    b"data: a\n\ndata: b\r\n\r\n",
    b"event: delta\ndata: a\n\n",
    b"id: 9\ndata: a\n\n",
    b"data: \xef\xbb\xbfa\n\n",  # a byte order mark past the first line is data
    "data: é€😀\n\n".encode(),
]


@pytest.mark.parametrize("raw", AFTER_FIRST)
@pytest.mark.parametrize("before", [b"data: w\n\n", b"id: 7\n\n", b"event: e\n", b"data: w\n", b"data: w\r"])
def test_whole_events_after_the_first_line_match_the_line_by_line_path(raw: bytes, before: bytes) -> None:
    stream = b": first\n" + before + raw
    want, _ = parse([stream[i : i + 1] for i in range(len(stream))])  # the line by line path
    events, parser = parse([b": first\n", before, raw])
    assert events == want and parser.errors == 0
    parser = SSEParser()
    data = [d for chunk in (b": first\n", before, raw) for d in parser.feed_data(chunk)]
    assert data == [e.data for e in want]


def test_the_short_path_keeps_the_limits() -> None:
    event = b"data: " + b"z" * 26 + b"\n\n"
    for max_line, max_event, errors in ((32, 1024, 0), (31, 1024, 2), (1024, 27, 0), (1024, 26, 2)):
        events, parser = parse([b": first\n", event + event], max_line=max_line, max_event=max_event)
        assert parser.errors == errors, (max_line, max_event)
        assert events == ([] if errors else [Event(b"z" * 26)] * 2)
