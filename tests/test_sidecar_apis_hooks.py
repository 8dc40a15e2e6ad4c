"""``hooks.loads``, the observers' JSON reader: json.loads's result or error for every input, on
its short path (UTF-8 starting with a bracket, nothing after the value) and off it."""

from __future__ import annotations

import json

import pytest

from sidecar.apis import hooks

DEEP = b"[" * 100_000 + b"]" * 100_000

INPUTS = [
    b'{"model_name":"tiny_stream","model_version":"1","text_output":"a "}',
    b'{"choices":[{"index":0,"delta":{"content":"\\u00e9\\ud83d\\ude00"}}]}',
    '{"text_output": "é€😀"}'.encode(),
    b"[1, 2.5, true, null]",
    b'{"a": 1} ',  # whitespace after the value: json.loads's own path
    b' {"a": 1}',
    b'{"a": 1}\n',
    b'{"a": 1}{"b": 2}',  # extra data
    b'{"a": 1',  # cut
    b"{not json",
    b"{",
    b"[",
    b"[]",
    b"{}",
    b"[DONE]",
    b"1",
    b'"text"',
    b"",
    b'{"a": "\xff"}',  # invalid UTF-8
    b'{"a": "\\ud800"}',  # a lone surrogate escape: json accepts it
    '{"a": "\ud800"}'.encode("utf-8", "surrogatepass"),  # a raw one: json reads it too
    '{"a": 1}'.encode("utf-16-le"),
    '{"a": 1}'.encode("utf-16"),
    '{"a": 1}'.encode("utf-32"),
    b'\xef\xbb\xbf{"a": 1}',
    b'{"a": NaN, "b": -Infinity}',
    b'{"a": 1, "a": 2}',  # the last duplicate wins, as in json
    DEEP,
]


def outcome(f, data: bytes):
    try:
        return "ok", f(data)
    except RecursionError:
        return "error", RecursionError
    except ValueError as exc:
        return "error", type(exc)


@pytest.mark.parametrize("data", INPUTS, ids=lambda d: repr(d[:30]))
def test_loads_is_json_loads(data: bytes) -> None:
    got, want = outcome(hooks.loads, data), outcome(json.loads, data)
    if want[0] == "ok" and want[1] != want[1]:  # NaN
        assert repr(got) == repr(want)
    else:
        assert got == want
