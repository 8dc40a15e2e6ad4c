"""Find a few top-level keys of a JSON object body as it streams past, in constant memory.

The OpenAI-compatible API names its model in the body (``{"model": "tiny-llm", ...}``), and
nothing obliges a client to send ``model`` first: it may follow megabytes of ``messages``. So the
body is scanned chunk by chunk as it is forwarded, never buffered: ``BodyScanner.feed(chunk)``
keeps a small state (where it is in the grammar, the open brackets, the wanted value being read),
skips strings and nested values with a compiled regex that jumps to the next byte that matters
(a quote, a backslash, a bracket), and reads only the top level in full.

Outcomes for the key (``scanner.outcome``):

- ``FOUND``: the key's string value is in ``scanner.value``, decided the moment its closing quote
  passes (escapes decoded, ``\\uXXXX`` surrogate pairs joined). The rest of the body is not needed
  for it; scanning goes on only for the other wanted keys.
- ``ABSENT``: the body was a well-formed object without the key (known only at its end).
- ``MALFORMED``: not JSON, not an object, truncated before the key, nested more than
  ``max_depth`` levels under the top-level object, or the key's value is not a string or not
  valid (a lone surrogate, a control character, invalid UTF-8). ``scanner.error`` says which.
- ``TOO_LONG``: the key's value is longer than ``max_value`` bytes as sent.

Limits of a scanner, on purpose: only what it reads is validated (the top-level grammar, bracket
pairs, the wanted values); a number or literal inside ``messages`` is skipped unchecked, so a
body the upstream will refuse as invalid may still be FOUND here. Duplicate keys: the first
wins here, the last in Python's ``json`` and pydantic; the label may then name the other model.

Also read on the way, when cheap (``scanner.fields``): integer fields (``max_tokens``,
``max_completion_tokens``, ``n``) and boolean fields (``stream``), as their JSON value when it
has the right type, else absent from ``fields``. A wrong type there is not an error: the
upstream judges it.
"""

from __future__ import annotations

import enum
import json
import re


class Outcome(enum.Enum):
    PENDING = "pending"
    FOUND = "found"
    ABSENT = "absent"
    MALFORMED = "malformed"
    TOO_LONG = "too_long"


# Parser states. The top level is read byte by byte (a handful of keys); strings and nested
# values are skipped by regex jumps.
(
    _START,  # before the opening brace
    _KEY_OR_CLOSE,  # after "{": a key or "}"
    _KEY,  # after ",": a key
    _IN_KEY,  # inside a key string (its raw bytes kept, up to _MAX_KEY)
    _COLON,
    _VALUE,  # before a top-level value
    _IN_STR,  # inside a string being skipped (top level or nested)
    _IN_WANTED_STR,  # inside the wanted key's string value (raw bytes kept, capped)
    _SCALAR,  # inside a top-level number or literal (kept, capped, when wanted)
    _NESTED,  # inside an object or array under the top level
    _AFTER_VALUE,  # after a top-level value: "," or "}"
    _END,  # after the closing brace: whitespace only
    _STOP,  # nothing left to learn, or malformed: feed() returns at once
) = range(13)

_WS = frozenset(b" \t\r\n")
_BOM = b"\xef\xbb\xbf"
# Inside a nested value, one regex match skips plain bytes, whole strings (escapes included) and
# whole objects and arrays up to two levels deep (with their pairs checked): Python code runs per
# bracket of deeper levels only, not per byte, nor per message of a `messages` array. Possessive
# quantifiers keep it linear. It stops early at a string or group that the chunk cuts; _IN_STR
# and the bracket stack then take over. Near ``max_depth`` the shallower forms are used, so the
# depth is checked exactly whatever the split.
_PLAIN = rb'[^"\[\]{}]++'
_STRING = rb'"(?:[^"\\]++|\\.)*+"'
_FLAT = rb"(?:%s|%s)*+" % (_PLAIN, _STRING)
_GROUP1 = rb"\{%s\}|\[%s\]" % (_FLAT, _FLAT)
_INNER = rb"(?:%s|%s|%s)*+" % (_PLAIN, _STRING, _GROUP1)
_GROUP2 = rb"\{%s\}|\[%s\]" % (_INNER, _INNER)
_SKIPS = tuple(  # by the levels left under max_depth: none, one, two or more
    re.compile(rb"(?:%s)*+" % b"|".join(forms), re.DOTALL)
    for forms in ((_PLAIN, _STRING), (_PLAIN, _STRING, _GROUP1), (_PLAIN, _STRING, _GROUP1, _GROUP2))
)
_STR_BODY = re.compile(rb'(?:[^"\\]++|\\.)*+', re.DOTALL)  # a string's bytes up to its end quote
_STR_STOP = re.compile(rb'["\\]')  # what ends a run of plain string bytes
_SCALAR_BYTES = re.compile(rb"[-+.0-9eEa-z]*")  # numbers and true/false/null
_MAX_KEY = 128  # raw bytes of a key worth remembering (the longest wanted key, fully \u-escaped)
_MAX_SCALAR = 32  # raw bytes of a top-level number or literal kept (to check it, or to read it)
_SCALAR_FIRST = frozenset(b"-0123456789tfn")
_NUMBER = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")

INT, BOOL = "int", "bool"
OPENAI_FIELDS: dict[str, str] = {
    "max_tokens": INT,
    "max_completion_tokens": INT,
    "n": INT,
    "stream": BOOL,
}


def _decode_string(raw: bytes) -> str:
    """A JSON string's content (raw bytes between its quotes), strictly: raises ValueError."""
    value = json.loads(b'"' + raw + b'"') if b"\\" in raw else raw.decode("utf-8")
    if b"\\" in raw:
        value.encode("utf-8")  # a lone surrogate from \uD800 cannot be a label: UnicodeEncodeError
    elif any(b < 0x20 for b in raw):
        raise ValueError("control character in a string")
    return value


class BodyScanner:
    """Streaming finder of one top-level string key (and a few scalar ones); see the module doc."""

    __slots__ = (
        "_bom",
        "_brackets",
        "_esc",
        "_field",
        "_key",
        "_key_long",
        "_met_keys",
        "_raw",
        "_return",
        "_state",
        "_want",
        "error",
        "fields",
        "key",
        "max_depth",
        "max_value",
        "outcome",
        "value",
    )

    def __init__(
        self,
        key: str = "model",
        fields: dict[str, str] | None = None,
        max_value: int = 256,
        max_depth: int = 256,
    ) -> None:
        self.key = key
        self.max_value = max_value
        self.max_depth = max_depth
        self._want = {key.encode(): None, **{k.encode(): kind for k, kind in (fields or {}).items()}}
        self.outcome = Outcome.PENDING
        self.value: str | None = None
        self.error: str | None = None
        self.fields: dict[str, int | bool] = {}
        self._met_keys: set[bytes] = set()  # wanted keys met so far: all met, the scan can stop
        self._state = _START
        self._bom = 0  # bytes of a leading byte order mark seen; -1 once past where one may be
        self._return = _AFTER_VALUE  # where a skipped string returns to
        self._esc = False  # a backslash ended the last chunk inside a string
        self._key = b""
        self._key_long = False
        self._field: bytes | None = None  # the wanted key whose value comes next
        self._raw = b""  # the wanted value's raw bytes so far
        self._brackets = bytearray()  # open nested brackets, to check their pairs

    @property
    def done(self) -> bool:
        """True when feeding more bytes cannot change anything."""
        return self._state == _STOP

    def _fail(self, why: str) -> None:
        self.error = why
        if self.outcome is Outcome.PENDING:
            self.outcome = Outcome.MALFORMED
        self._state = _STOP

    def feed(self, chunk: bytes) -> None:
        """Scan the next bytes of the body (any split, any size)."""
        state = self._state
        if state == _STOP:
            return
        pos, n = 0, len(chunk)
        while pos < n:
            if state == _NESTED:
                pos = _SKIPS[min(2, self.max_depth - len(self._brackets))].match(chunk, pos).end()
                if pos == n:
                    break
                c = chunk[pos]
                pos += 1
                if c == 34:  # " a string the chunk cuts
                    state, self._return = _IN_STR, _NESTED
                elif c == 123 or c == 91:  # { [
                    if len(self._brackets) >= self.max_depth:
                        self._fail(f"nesting deeper than {self.max_depth}")
                        return
                    self._brackets.append(c + 2)  # the matching close: } is { + 2, ] is [ + 2
                elif self._brackets.pop() != c:
                    self._fail("mismatched bracket")
                    return
                elif not self._brackets:
                    state = _AFTER_VALUE
            elif state == _IN_STR:
                if self._esc:
                    self._esc = False
                    pos += 1
                    continue
                pos = _STR_BODY.match(chunk, pos).end()
                if pos == n:
                    break
                if chunk[pos] == 34:
                    state = self._return
                else:  # a backslash ending the chunk: the escaped byte comes next
                    self._esc = True
                pos += 1
            elif state in (_IN_WANTED_STR, _IN_KEY):
                start = pos
                if self._esc:
                    self._esc = False
                    pos += 1
                m = _STR_STOP.search(chunk, pos)
                end = m.start() if m is not None else n
                pos = m.end() if m is not None else n
                closed = m is not None and chunk[end] == 34
                if m is not None and not closed:
                    end, self._esc = pos, True  # keep the backslash; the escaped byte follows
                if state == _IN_KEY:
                    if not self._key_long:
                        self._key += chunk[start:end]
                        self._key_long = len(self._key) > _MAX_KEY
                    if closed:
                        state = _COLON
                else:
                    self._raw += chunk[start:end]
                    if len(self._raw) > self.max_value:
                        self.outcome = Outcome.TOO_LONG
                        self.error = f"{self.key} longer than {self.max_value} bytes"
                        self._state = _STOP
                        return
                    if closed:
                        if not self._take_value():
                            return
                        state = _AFTER_VALUE
            else:
                c = chunk[pos]
                if state == _START and self._bom >= 0:  # a UTF-8 byte order mark, as Python's json allows
                    if c == _BOM[self._bom]:
                        self._bom += 1
                        pos += 1
                        if self._bom == 3:
                            self._bom = -1
                        continue
                    if self._bom:
                        self._fail("not a JSON object")
                        return
                    self._bom = -1
                if c in _WS and state != _SCALAR:
                    pos += 1
                    continue
                if state == _VALUE:
                    pos += 1
                    field = self._field
                    main = field is not None and self._want[field] is None
                    if c == 34:
                        if main:
                            state, self._raw = _IN_WANTED_STR, b""
                            continue
                        state, self._return = _IN_STR, _AFTER_VALUE
                    elif c not in _SCALAR_FIRST and c != 123 and c != 91:
                        self._fail("expected a value")
                        return
                    elif main:
                        self._fail(f"{self.key} is not a string")
                        return
                    elif c != 123 and c != 91:
                        state, self._raw = _SCALAR, chunk[pos - 1 : pos]
                        continue
                    else:
                        self._brackets.append(c + 2)
                        state = _NESTED
                    if field is not None:  # a wanted number or boolean of another type: met anyway
                        self._field = None
                        if self._met(field):
                            return
                elif state == _SCALAR:
                    end = _SCALAR_BYTES.match(chunk, pos).end()
                    if len(self._raw) <= _MAX_SCALAR:
                        self._raw += chunk[pos : min(end, pos + _MAX_SCALAR + 1)]
                    pos = end
                    if pos < n:  # the scalar ended here
                        if not self._take_scalar():
                            return
                        state = _AFTER_VALUE
                elif state == _AFTER_VALUE:
                    pos += 1
                    if c == 44:  # ,
                        state = _KEY
                    elif c == 125:  # }
                        state = _END
                    else:
                        self._fail("expected , or } after a value")
                        return
                elif state == _COLON:
                    if c != 58:
                        self._fail("expected : after a key")
                        return
                    pos += 1
                    key = self._key
                    if b"\\" in key and not self._key_long:
                        try:
                            key = json.loads(b'"' + key + b'"').encode("utf-8", "surrogatepass")
                        except ValueError:
                            key = b""
                    self._field = None if self._key_long or key not in self._want else key
                    state = _VALUE
                elif state in (_KEY, _KEY_OR_CLOSE):
                    pos += 1
                    if c == 34:
                        state, self._key, self._key_long = _IN_KEY, b"", False
                    elif c == 125 and state == _KEY_OR_CLOSE:
                        state = _END
                    else:
                        self._fail("expected a key")
                        return
                elif state == _START:
                    if c != 123:
                        self._fail("not a JSON object")
                        return
                    pos += 1
                    state = _KEY_OR_CLOSE
                else:  # _END
                    self._fail("data after the JSON object")
                    return
        self._state = state

    def _take_value(self) -> bool:
        """The wanted key's string closed: decode it. False when it is invalid (scan stopped)."""
        self._field = None
        try:
            value = _decode_string(self._raw)
        except ValueError:  # bad escape, control character, lone surrogate, invalid UTF-8
            self._fail(f"{self.key} is not a valid string")
            return False
        if self.outcome is Outcome.PENDING:
            self.outcome, self.value = Outcome.FOUND, value
            return not self._met(self.key.encode())
        return True

    def _take_scalar(self) -> bool:
        """A top-level number or literal ended: check it, keep it if wanted. False: scan stopped."""
        field, raw = self._field, self._raw
        self._field, self._raw = None, b""
        if len(raw) <= _MAX_SCALAR:  # longer ones are numbers too long to be worth checking
            if raw[0] >= 0x61 and raw not in (b"true", b"false", b"null"):
                self._fail("invalid literal")
                return False
            if raw[0] < 0x61 and _NUMBER.fullmatch(raw) is None:
                self._fail("invalid number")
                return False
        if field is None:
            return True
        name = field.decode()
        if field not in self._met_keys:
            kind = self._want[field]
            if kind == INT and raw.lstrip(b"-").isdigit():
                self.fields[name] = int(raw)
            elif kind == BOOL and raw in (b"true", b"false"):
                self.fields[name] = raw == b"true"
        return not self._met(field)

    def _met(self, key: bytes) -> bool:
        """Note a wanted key as seen; True when that was the last one (the scan stops)."""
        self._met_keys.add(key)
        if len(self._met_keys) == len(self._want):
            self._state = _STOP
            return True
        return False

    def finish(self) -> Outcome:
        """The body ended: settle the outcome (PENDING becomes ABSENT or MALFORMED)."""
        if self._state == _SCALAR and self._take_scalar():  # only in a truncated body
            self._state = _AFTER_VALUE
        if self.outcome is Outcome.PENDING:
            if self._state == _END:
                self.outcome = Outcome.ABSENT
            else:
                self.outcome = Outcome.MALFORMED
                self.error = self.error or (
                    "empty body" if self._state == _START else "body ended inside the JSON object"
                )
        self._state = _STOP
        return self.outcome
