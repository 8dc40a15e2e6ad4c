"""gRPC wire formats the proxy reads: the few protobuf string fields it labels requests by, the
message framing inside HTTP/2 DATA, and the ``grpc-timeout`` header.

Hand-written on purpose. Decoding a ``ModelInferRequest`` with the generated classes would
parse (and copy) every tensor in ``raw_input_contents`` just to read the model name; here a
length-delimited field that is not wanted is skipped by adding its length to the offset, so
the cost is a few integer operations per top-level field whatever the tensors weigh, and the
only bytes copied are the names themselves.

Only top-level fields are read (plus the one nested message of a stream response), wire types
0, 1, 2 and 5 are skipped, and anything else (groups, truncation, a length past the end) raises
``WireError``: the proxy then forwards the bytes untouched and lets the upstream judge them.
"""

from __future__ import annotations

# Wire types (https://protobuf.dev/programming-guides/encoding/).
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5

# ModelStreamInferResponse: error_message = 1, infer_response = 2 (a ModelInferResponse).
_SR_ERROR, _SR_RESPONSE = 1, 2
# ModelInferResponse: model_name = 1, id = 3, parameters = 4 (map<string, InferParameter>).
_IR_MODEL, _IR_ID, _IR_PARAMETERS = 1, 3, 4
# A map entry is a message {key = 1, value = 2}; InferParameter.bool_param = 1.
_FINAL_KEY = b"triton_final_response"


class WireError(ValueError):
    """The bytes are not a well-formed protobuf message."""


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` and the offset after it."""
    try:
        b = buf[pos]
        if b < 0x80:
            return b, pos + 1
        result, shift = b & 0x7F, 7
        while True:
            pos += 1
            b = buf[pos]
            result |= (b & 0x7F) << shift
            if b < 0x80:
                return result, pos + 1
            shift += 7
            if shift > 63:
                raise WireError("varint longer than 10 bytes")
    except IndexError:
        raise WireError("truncated varint") from None


def _fields(buf: bytes, start: int, end: int):
    """Yield (field number, wire type, value start, value end) for each field in buf[start:end].

    For a varint the value span covers its bytes; callers decode only what they want.
    """
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wtype = key >> 3, key & 7
        if number == 0:
            raise WireError("field number 0")
        if wtype == _LEN:
            length, pos = _varint(buf, pos)
            stop = pos + length
        elif wtype == _VARINT:
            _, stop = _varint(buf, pos)
        elif wtype == _I64:
            stop = pos + 8
        elif wtype == _I32:
            stop = pos + 4
        else:
            raise WireError(f"unsupported wire type {wtype} (field {number})")
        if stop > end:
            raise WireError(f"field {number} runs past the end of the message")
        yield number, wtype, pos, stop
        pos = stop


def _text(buf: bytes, start: int, stop: int) -> str:
    # A name that is not UTF-8 is the upstream's to refuse; the label only needs to be stable.
    return buf[start:stop].decode("utf-8", "replace")


def read_strings(
    buf: bytes, first: int, second: int = 0, third: int = 0, partial: bool = False
) -> tuple[str, str, str]:
    """The string fields numbered ``first``, ``second`` and ``third`` ("" when absent or 0).

    Like protobuf parsers, the last occurrence of a repeated scalar wins, so the whole top
    level is walked; that costs one step per field, never per byte. This is the per-request
    hot path, so the walk is inlined (single-byte keys and lengths take the fast branch).

    ``partial``: ``buf`` is only the first bytes of the message (the HTTP/2 relay reads the
    head of each message): the walk stops quietly where the bytes end.
    """
    a = b = c = ""
    pos, end = 0, len(buf)
    try:
        while pos < end:
            key = buf[pos]
            if key < 0x80:
                pos += 1
            else:
                key, pos = _varint(buf, pos)
            wtype = key & 7
            if wtype == _LEN:
                length = buf[pos]
                if length < 0x80:
                    pos += 1
                else:
                    length, pos = _varint(buf, pos)
                stop = pos + length
                if stop > end:
                    if partial:
                        return a, b, c
                    raise WireError(f"field {key >> 3} runs past the end of the message")
                number = key >> 3
                if number == first:
                    a = _text(buf, pos, stop)
                elif number == second:
                    b = _text(buf, pos, stop)
                elif number == third:
                    c = _text(buf, pos, stop)
                pos = stop
            elif wtype == _VARINT:
                pos = _varint(buf, pos)[1]
            elif wtype == _I64:
                pos += 8
            elif wtype == _I32:
                pos += 4
            else:
                raise WireError(f"unsupported wire type {wtype} (field {key >> 3})")
            if key >> 3 == 0:
                raise WireError("field number 0")
    except (IndexError, WireError):
        if partial:
            return a, b, c
        raise WireError("truncated message") from None
    if pos > end and not partial:
        raise WireError("the last field runs past the end of the message")
    return a, b, c


def _is_final(buf: bytes, start: int, stop: int) -> bool | None:
    """The ``triton_final_response`` flag of one parameters map entry, None when it is another key."""
    key_ok = False
    flag = False
    for number, wtype, s, e in _fields(buf, start, stop):
        if number == 1 and wtype == _LEN:
            key_ok = buf[s:e] == _FINAL_KEY
        elif number == 2 and wtype == _LEN:
            for n2, w2, s2, _e2 in _fields(buf, s, e):
                if n2 == 1 and w2 == _VARINT:
                    flag = _varint(buf, s2)[0] != 0
    return flag if key_ok else None


def stream_response_info(buf: bytes, partial: bool = False) -> tuple[str, str, str, bool | None]:
    """(error_message, model_name, id, final) of a ``ModelStreamInferResponse``.

    ``final`` is Triton's ``triton_final_response`` parameter when the response carries it
    (decoupled models asked for an empty final response), else None. ``partial``: ``buf`` is
    the head of the message; what lies past it reads as absent.
    """
    if partial:
        return _partial_response_info(buf)
    error = model = rid = ""
    final: bool | None = None
    for number, wtype, start, stop in _fields(buf, 0, len(buf)):
        if wtype != _LEN:
            continue
        if number == _SR_ERROR:
            error = _text(buf, start, stop)
        elif number == _SR_RESPONSE:
            for n, w, s, e in _fields(buf, start, stop):
                if w != _LEN:
                    continue
                if n == _IR_MODEL:
                    model = _text(buf, s, e)
                elif n == _IR_ID:
                    rid = _text(buf, s, e)
                elif n == _IR_PARAMETERS:
                    flag = _is_final(buf, s, e)
                    if flag is not None:
                        final = flag
    return error, model, rid, final


def _partial_response_info(buf: bytes) -> tuple[str, str, str, bool | None]:
    """``stream_response_info`` of a message head: the nested response is read up to the
    bytes available (its name and id come first), and a field cut by the end is dropped."""
    error = model = rid = ""
    final: bool | None = None
    end = len(buf)
    try:
        pos = 0
        while pos < end:
            key, pos = _varint(buf, pos)
            if key & 7 != _LEN:
                break  # not a ModelStreamInferResponse field layout: stop
            length, pos = _varint(buf, pos)
            stop = pos + length
            number = key >> 3
            if number == _SR_ERROR:
                if stop > end:
                    break
                error = _text(buf, pos, stop)
            elif number == _SR_RESPONSE:
                inner_end = min(stop, end)
                ipos = pos
                while ipos < inner_end:
                    ikey, ipos = _varint(buf, ipos)
                    if ikey & 7 != _LEN:
                        break
                    ilen, ipos = _varint(buf, ipos)
                    istop = ipos + ilen
                    if istop > inner_end:
                        break
                    n = ikey >> 3
                    if n == _IR_MODEL:
                        model = _text(buf, ipos, istop)
                    elif n == _IR_ID:
                        rid = _text(buf, ipos, istop)
                    elif n == _IR_PARAMETERS:
                        flag = _is_final(buf, ipos, istop)
                        if flag is not None:
                            final = flag
                    elif n > _IR_PARAMETERS:
                        break  # outputs and tensors follow: nothing more to read
                    ipos = istop
            pos = stop
    except WireError:
        pass
    return error, model, rid, final


# ModelInferResponse: outputs = 5 (InferOutputTensor, name = 1), raw_output_contents = 6.
_IR_OUTPUTS, _IR_RAW = 5, 6
TEXT_OUTPUT = b"text_output"  # the generated text of Triton's LLM models (its generate API's name)


def response_has_text(buf: bytes) -> bool:
    """Whether a ``ModelStreamInferResponse`` (or the head of one) carries generated text: an
    output tensor ``text_output`` whose first element is not empty.

    The element is read from ``raw_output_contents`` (how Triton sends every tensor over gRPC:
    a BYTES element is a 4-byte little-endian length, then the bytes); when the head ends
    before that length, the tensor's presence counts. An error response, and the empty final
    response of a decoupled model, have no outputs: no text.
    """
    end = len(buf)
    index = -1  # text_output's place among the outputs (raw contents follow that order)
    try:
        pos = 0
        while pos < end:
            key, pos = _varint(buf, pos)
            if key & 7 != _LEN:
                return False
            length, pos = _varint(buf, pos)
            if key >> 3 != _SR_RESPONSE:
                pos += length
                continue
            inner_end = min(pos + length, end)
            outputs = raws = 0
            while pos < inner_end:
                ikey, pos = _varint(buf, pos)
                if ikey & 7 != _LEN:
                    if ikey & 7 == _VARINT:
                        pos = _varint(buf, pos)[1]
                        continue
                    return False
                ilen, pos = _varint(buf, pos)
                n = ikey >> 3
                if n == _IR_OUTPUTS:
                    if index < 0 and _output_name(buf, pos, min(pos + ilen, inner_end)) == TEXT_OUTPUT:
                        index = outputs
                    outputs += 1
                elif n == _IR_RAW:
                    if raws == index:
                        if pos + 4 > inner_end:
                            return ilen > 0  # cut by the head: the tensor is there
                        return ilen >= 4 and int.from_bytes(buf[pos : pos + 4], "little") > 0
                    raws += 1
                pos += ilen
            return index >= 0  # named, its contents past the head (or sent in typed fields)
    except WireError:  # the head ends inside a field
        return index >= 0
    return False


def _output_name(buf: bytes, start: int, stop: int) -> bytes:
    """The name (field 1) of an ``InferOutputTensor``: its first field, as protobuf writes it."""
    if start >= stop or buf[start] != 0x0A:
        return b""
    length, pos = _varint(buf, start + 1)
    return bytes(buf[pos : min(pos + length, stop)])


# --------------------------------------------------------------------------- gRPC over HTTP/2

# Bytes of each gRPC message read for its fields (names and ids come first).
HEAD_BYTES = 512

_TIMEOUT_UNITS = {
    ord("H"): 3600.0,
    ord("M"): 60.0,
    ord("S"): 1.0,
    ord("m"): 1e-3,
    ord("u"): 1e-6,
    ord("n"): 1e-9,
}


def grpc_timeout_seconds(value: bytes) -> float | None:
    """A ``grpc-timeout`` header value in seconds; None when it is malformed."""
    if len(value) < 2 or value[-1] not in _TIMEOUT_UNITS or not value[:-1].isdigit():
        return None
    return int(value[:-1]) * _TIMEOUT_UNITS[value[-1]]


def grpc_timeout_value(seconds: float) -> bytes:
    """``seconds`` as a ``grpc-timeout`` value: milliseconds, or seconds past 8 digits."""
    ms = max(1, int(seconds * 1000))
    return f"{ms}m".encode() if ms < 100_000_000 else f"{max(1, int(seconds))}S".encode()


class MessageScanner:
    """Splits one direction of a call's DATA into gRPC messages (a 5-byte prefix: compressed
    flag and length, then the message) and reports the head of each, never holding more."""

    __slots__ = ("head", "head_compressed", "length", "prefix", "remaining", "want")

    def __init__(self) -> None:
        self.prefix = b""
        self.remaining = 0
        self.length = 0
        self.head: bytearray | None = None
        self.head_compressed = 0
        self.want = 0

    def feed(self, data: bytes, out: list) -> None:
        """Append (message length, head bytes, compressed) for each head completed in ``data``."""
        i, n = 0, len(data)
        while i < n:
            if self.remaining == 0 and self.head is None:
                need = 5 - len(self.prefix)
                self.prefix += data[i : i + need]
                i += need
                if len(self.prefix) < 5:
                    return
                compressed = self.prefix[0]
                self.length = self.remaining = int.from_bytes(self.prefix[1:5], "big")
                self.prefix = b""
                self.want = min(self.length, HEAD_BYTES)
                if self.want == 0:
                    out.append((0, b"", compressed))
                    continue
                self.head = bytearray()
                self.head_compressed = compressed
            take = min(n - i, self.remaining)
            if self.head is not None:
                h = min(take, self.want - len(self.head))
                self.head += data[i : i + h]
                if len(self.head) >= self.want:
                    out.append((self.length, bytes(self.head), self.head_compressed))
                    self.head = None
            self.remaining -= take
            i += take
