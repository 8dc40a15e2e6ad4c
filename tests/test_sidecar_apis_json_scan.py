"""The streaming body scanner: the top-level `model` of an OpenAI request body found chunk by chunk,
split at every position, held against Python's own JSON parser."""

from __future__ import annotations

import json
import random

import pytest

from sidecar.apis.json_scan import OPENAI_FIELDS, BodyScanner, Outcome


def scan(chunks: list[bytes], **kw) -> BodyScanner:
    scanner = BodyScanner(fields=kw.pop("fields", OPENAI_FIELDS), **kw)
    for chunk in chunks:
        scanner.feed(chunk)
    scanner.finish()
    return scanner


def result(s: BodyScanner) -> tuple:
    return s.outcome, s.value, s.error, s.fields


def every_split(raw: bytes, pairs: bool = False):
    yield [raw]
    yield [raw[i : i + 1] for i in range(len(raw))]
    for i in range(len(raw) + 1):
        yield [raw[:i], raw[i:]]
    if pairs:
        for i in range(0, len(raw) + 1, 3):
            for j in range(i, len(raw) + 1, 2):
                yield [raw[:i], raw[i:j], raw[j:]]


def expected(raw: bytes) -> tuple[Outcome, str | None]:
    """What Python's json says the body's top-level model is (bodies here have no duplicate keys)."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return Outcome.MALFORMED, None
    if not isinstance(obj, dict):
        return Outcome.MALFORMED, None
    if "model" not in obj:
        return Outcome.ABSENT, None
    if not isinstance(obj["model"], str):
        return Outcome.MALFORMED, None
    return Outcome.FOUND, obj["model"]


def check_every_split(raw: bytes, outcome: Outcome, value: str | None = None, **kw) -> BodyScanner:
    whole = scan([raw], **kw)
    assert (whole.outcome, whole.value) == (outcome, value), (raw, whole.error)
    for chunks in every_split(raw, pairs=len(raw) < 80):
        assert result(scan(chunks, **kw)) == result(whole), chunks
    return whole


BODIES = [
    pytest.param(b'{"model":"tiny-llm","messages":[]}', Outcome.FOUND, "tiny-llm", id="first"),
    pytest.param(
        b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":8,"model":"m"}',
        Outcome.FOUND,
        "m",
        id="last",
    ),
    pytest.param(b' \n{ "model" :\t"a b" }\r\n', Outcome.FOUND, "a b", id="whitespace"),
    pytest.param(b"{}", Outcome.ABSENT, None, id="empty-object"),
    pytest.param(b'{"prompt":"x","n":2}', Outcome.ABSENT, None, id="absent"),
    pytest.param(
        b'{"messages":[{"model":"no","content":[{"model":"no"}]}],"metadata":{"model":"no"},"tools":[]}',
        Outcome.ABSENT,
        None,
        id="nested-model-keys-do-not-match",
    ),
    pytest.param(
        b'{"prompt":"{\\"model\\": \\"no\\"} ] } [","model":"yes"}',
        Outcome.FOUND,
        "yes",
        id="brackets-and-key-inside-a-string",
    ),
    pytest.param(b'{"prompt":"a\\\\","model":"b"}', Outcome.FOUND, "b", id="escaped-backslash-before-quote"),
    pytest.param(b'{"model":"a\\"b\\\\c\\/d\\n"}', Outcome.FOUND, 'a"b\\c/d\n', id="escapes-in-value"),
    pytest.param(
        b'{"model":"\\u00e9\\ud83d\\ude00"}', Outcome.FOUND, "é😀", id="unicode-escapes-surrogate-pair"
    ),
    pytest.param('{"model":"é😀"}'.encode(), Outcome.FOUND, "é😀", id="raw-utf8"),
    pytest.param(b'{"mod\\u0065l":"escaped-key"}', Outcome.FOUND, "escaped-key", id="escaped-key"),
    pytest.param(b'{"models":"x","mode":"y","Model":"z"}', Outcome.ABSENT, None, id="near-miss-keys"),
    pytest.param(b'{"a":[[[{"b":[1,2,{"c":"]"}]}]]],"model":"deep"}', Outcome.FOUND, "deep", id="nesting"),
    pytest.param(b'{"a":-1.5e+3,"b":true,"c":null,"d":false,"model":"m"}', Outcome.FOUND, "m", id="scalars"),
    pytest.param(b'{"model":""}', Outcome.FOUND, "", id="empty-string"),
    pytest.param(b'\xef\xbb\xbf{"model":"bom"}', Outcome.FOUND, "bom", id="byte-order-mark"),
]


@pytest.mark.parametrize(("raw", "outcome", "value"), BODIES)
def test_found_or_absent_at_every_split(raw: bytes, outcome: Outcome, value: str | None) -> None:
    assert expected(raw) == (outcome, value)
    check_every_split(raw, outcome, value)


MALFORMED = [
    pytest.param(b"", "empty body", id="empty"),
    pytest.param(b"  \n", "empty body", id="blank"),
    pytest.param(b'[{"model":"m"}]', "not a JSON object", id="array"),
    pytest.param(b'"model"', "not a JSON object", id="string"),
    pytest.param(b"model=m", "not a JSON object", id="form"),
    pytest.param(b"\xef\xbb{}", "not a JSON object", id="half-a-bom"),
    pytest.param(b" \xef\xbb\xbf{}", "not a JSON object", id="bom-not-first"),
    pytest.param(b'{"model":3}', "model is not a string", id="number"),
    pytest.param(b'{"model":null}', "model is not a string", id="null"),
    pytest.param(b'{"model":true}', "model is not a string", id="bool"),
    pytest.param(b'{"model":["a"]}', "model is not a string", id="array-value"),
    pytest.param(b'{"model":{"name":"a"}}', "model is not a string", id="object-value"),
    pytest.param(b'{"model":"\\x41"}', "model is not a valid string", id="bad-escape"),
    pytest.param(b'{"model":"a\tb"}', "model is not a valid string", id="control-character"),
    pytest.param(b'{"model":"\xff"}', "model is not a valid string", id="invalid-utf8"),
    pytest.param(b'{"a":[}', "mismatched bracket", id="mismatched"),
    pytest.param(b'{"a":1 "model":"m"}', "expected , or } after a value", id="missing-comma"),
    pytest.param(b'{"a":1,}', "expected a key", id="trailing-comma"),
    pytest.param(b'{"a" 1}', "expected : after a key", id="missing-colon"),
    pytest.param(b'{"a":}', "expected a value", id="missing-value"),
    pytest.param(b'{"a":tru,"model":"m"}', "invalid literal", id="bad-literal"),
    pytest.param(b'{"a":01,"model":"m"}', "invalid number", id="bad-number"),
    pytest.param(b"{} {}", "data after the JSON object", id="two-objects"),
    pytest.param(b'{"messages":[{"content":"x"}', "body ended inside the JSON object", id="truncated"),
]


@pytest.mark.parametrize(("raw", "error"), MALFORMED)
def test_malformed_bodies_at_every_split(raw: bytes, error: str) -> None:
    assert expected(raw) == (Outcome.MALFORMED, None)
    assert check_every_split(raw, Outcome.MALFORMED).error == error


def test_a_lone_surrogate_is_no_model_name() -> None:
    # Python's json takes it; a label could not be written out in UTF-8.
    s = check_every_split(b'{"model":"\\ud83d"}', Outcome.MALFORMED)
    assert s.error == "model is not a valid string"


def test_nesting_past_the_cap_is_malformed() -> None:
    def deep(levels: int) -> bytes:
        return b'{"a":' + b"[" * levels + b"]" * levels + b',"model":"m"}'

    for chunks in every_split(deep(10)):
        assert scan(chunks, max_depth=10).outcome is Outcome.FOUND
    for chunks in every_split(deep(11)):
        s = scan(chunks, max_depth=10)
        assert (s.outcome, s.error) == (Outcome.MALFORMED, "nesting deeper than 10")
    s = scan([deep(100_000)])
    assert (s.outcome, s.error) == (Outcome.MALFORMED, "nesting deeper than 256")


def test_a_value_past_the_cap_is_too_long_counting_the_bytes_as_sent() -> None:
    check_every_split(b'{"model":"' + b"x" * 16 + b'"}', Outcome.FOUND, "x" * 16, max_value=16)
    s = check_every_split(b'{"model":"' + b"x" * 17 + b'"}', Outcome.TOO_LONG, max_value=16)
    assert s.error == "model longer than 16 bytes"
    # \u00e9 is one character but six bytes on the wire: the cap is on what the scanner holds.
    check_every_split(b'{"model":"\\u00e9\\u00e9\\u00e9"}', Outcome.TOO_LONG, max_value=16)


def test_truncated_bodies_never_give_a_wrong_answer() -> None:
    raw = b'{"messages":[{"role":"user","content":"a \\"model\\": b"}],"model":"tiny-llm","max_tokens":5}'
    model_end = raw.index(b'tiny-llm"') + len(b'tiny-llm"')
    for cut in range(len(raw)):
        s = scan([raw[:cut]])
        if cut >= model_end:
            assert (s.outcome, s.value) == (Outcome.FOUND, "tiny-llm"), cut
        else:
            assert (s.outcome, s.value) == (Outcome.MALFORMED, None), cut
            assert s.error == ("empty body" if cut == 0 else "body ended inside the JSON object")


def test_found_is_decided_when_the_closing_quote_passes() -> None:
    s = BodyScanner()
    s.feed(b'{"messages":[],"model":"tiny')
    assert s.outcome is Outcome.PENDING
    s.feed(b"-llm")
    assert s.outcome is Outcome.PENDING
    s.feed(b'", "this is no longer read')
    assert (s.outcome, s.value, s.done) == (Outcome.FOUND, "tiny-llm", True)


def test_the_model_after_megabytes_of_messages_in_constant_memory() -> None:
    messages = [{"role": "user", "content": "z" * 1000 + ' {"model": "no"} ['} for _ in range(2000)]
    raw = json.dumps({"messages": messages, "model": "late", "stream": True}).encode()
    assert len(raw) > 2_000_000
    s = BodyScanner(fields=OPENAI_FIELDS)
    for i in range(0, len(raw), 65536):
        s.feed(raw[i : i + 65536])
        # The scanner keeps its grammar state, never the body.
        assert len(s._raw) <= s.max_value and len(s._key) <= 129 and len(s._brackets) <= 3
    s.finish()
    assert (s.outcome, s.value, s.fields) == (Outcome.FOUND, "late", {"stream": True})


def test_openai_fields_read_on_the_way() -> None:
    raw = b'{"max_tokens":128,"n":2,"stream":true,"max_completion_tokens":64,"model":"m"}'
    s = check_every_split(raw, Outcome.FOUND, "m")
    assert s.fields == {"max_tokens": 128, "n": 2, "stream": True, "max_completion_tokens": 64}
    assert s.done  # all five wanted keys met: the scan stopped
    # Wrong types are left out (the upstream judges them), not errors.
    raw = b'{"max_tokens":"8","n":1.5,"stream":null,"max_completion_tokens":[1],"model":"m"}'
    assert check_every_split(raw, Outcome.FOUND, "m").fields == {}
    s = check_every_split(b'{"stream":false,"max_tokens":-1}', Outcome.ABSENT)
    assert s.fields == {"stream": False, "max_tokens": -1}
    # Nested ones do not count.
    assert scan([b'{"options":{"max_tokens":5,"stream":true},"model":"m"}']).fields == {}


def test_a_duplicate_key_the_first_wins() -> None:
    # Python's json keeps the last; the scanner decides at the first (documented).
    raw = b'{"model":"a","messages":[],"model":"b"}'
    assert json.loads(raw)["model"] == "b"
    check_every_split(raw, Outcome.FOUND, "a", fields={})


def test_only_the_model_wanted_stops_as_soon_as_it_is_found() -> None:
    s = BodyScanner()
    s.feed(b'{"model":"m", ')
    assert s.done
    s.feed(b"anything at all")
    assert (s.finish(), s.value, s.error) == (Outcome.FOUND, "m", None)


def _random_value(rng: random.Random, depth: int):
    kind = rng.randrange(8 if depth < 4 else 5)
    if kind == 0:
        return rng.choice([0, -3, 1.25, 1e20, 7])
    if kind == 1:
        return rng.choice([True, False, None])
    if kind in (2, 3, 4):
        return "".join(rng.choice('ab "\\/{}[]:,\n\té😀\u2028model') for _ in range(rng.randrange(12)))
    if kind in (5, 6):
        return {rng.choice(["model", "m", "content", "x"]): _random_value(rng, depth + 1) for _ in range(3)}
    return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]


def test_random_bodies_agree_with_json_at_every_split() -> None:
    rng = random.Random(13)
    for _ in range(300):
        obj = {k: _random_value(rng, 1) for k in rng.sample(["messages", "prompt", "model", "tools", "n"], 3)}
        raw = json.dumps(
            obj,
            ensure_ascii=rng.random() < 0.5,
            indent=rng.choice([None, 1]),
            separators=rng.choice([(",", ":"), (", ", ": ")]),
        ).encode()
        outcome, value = expected(raw)
        whole = scan([raw])
        assert (whole.outcome, whole.value) == (outcome, value), raw
        for i in range(0, len(raw) + 1, max(1, len(raw) // 40)):
            assert result(scan([raw[:i], raw[i:]])) == result(whole), (raw, i)


def _depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def test_random_bodies_depth_cap_exact_at_every_split() -> None:
    rng = random.Random(31)
    for _ in range(300):
        obj = {k: _random_value(rng, 0) for k in rng.sample(["messages", "prompt", "model", "tools"], 3)}
        raw = json.dumps(obj).encode()
        want: tuple = (Outcome.ABSENT, None)
        for key, value in obj.items():  # the scan stops at the model (no other key wanted)
            if key == "model":
                want = (Outcome.FOUND, value) if isinstance(value, str) else (Outcome.MALFORMED, None)
                break
            if _depth(value) > 3:
                want = (Outcome.MALFORMED, None)
                break
        for i in range(0, len(raw) + 1, max(1, len(raw) // 30)):
            s = scan([raw[:i], raw[i:]], fields={}, max_depth=3)
            assert (s.outcome, s.value) == want, (raw, i, s.error)
