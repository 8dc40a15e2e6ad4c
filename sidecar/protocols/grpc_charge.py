"""What a KServe v2 ``ModelInferRequest`` costs the fleet spec's ``tokens`` bucket, read from the
message itself (``ModelInfer`` and the first message of a ``ModelStreamInfer`` stream).

The same charge as HTTP's (``sidecar.apis.charge``, whose constants it shares):

- prompt estimate: ``ceil(message bytes / BYTES_PER_TOKEN)``. The message carries the prompt
  (the ``text_input`` BYTES tensor of Triton's LLM models); names and shapes count too, so it
  errs high, as HTTP's JSON does.
- generation, read in this order: an input tensor named ``max_tokens`` (INT32, INT64 or UINT32;
  its element in ``raw_input_contents`` at that input's index, or in its ``contents``), as
  TensorRT-LLM's ensemble and the reference ``tiny_stream`` model take it; else a request
  parameter ``max_tokens`` (``int64_param`` or ``uint64_param``); else ``DEFAULT_MAX_TOKENS``.
  A tensor of several elements (a batch) is charged the sum of its elements (the first
  ``_RAW_HEAD`` bytes read; each element past them as the largest read).
- a message the sidecar cannot read (malformed, or compressed) is charged the prompt estimate
  of its bytes and the default: never an error, the upstream judges the message.

Field numbers from Triton's ``grpc_service.proto``. ``RequestCharge`` is fed the message in
pieces (the relay sees it frame by frame and never holds it): the top level is walked field by
field, a field that is not wanted is skipped by counting its length, and only small pieces are
kept (a parameter entry, the head of an input's description, the head of one raw tensor), so
the work is a few steps per top-level field and the memory a few hundred bytes, whatever the
prompt weighs. Fields may come in any order (protobuf allows it); the last ``max_tokens``
parameter wins, as in a protobuf parser.
"""

from __future__ import annotations

from sidecar.apis.charge import BYTES_PER_TOKEN, DEFAULT_MAX_TOKENS
from sidecar.protocols.grpc_wire import WireError, _fields, _varint, read_strings

# ModelInferRequest: parameters = 4 (map<string, InferParameter>), inputs = 5
# (InferInputTensor), raw_input_contents = 7 (bytes, one per input, in the inputs' order).
_PARAMETERS, _INPUTS, _RAW = 4, 5, 7
# A map entry: key = 1, value = 2. InferParameter: int64_param = 2, uint64_param = 5.
_INT64_PARAM, _UINT64_PARAM = 2, 5
# InferInputTensor: name = 1, datatype = 2, contents = 5 (InferTensorContents: int_contents = 2,
# int64_contents = 3, uint_contents = 4).
_CONTENTS = 5
# datatype -> (InferTensorContents field, bytes per element in raw_input_contents, signed)
_TYPES = {b"INT32": (2, 4, True), b"INT64": (3, 8, True), b"UINT32": (4, 4, False)}
NAME = b"max_tokens"

_PARAM_CAP = 256  # a max_tokens entry is ~20 bytes; a longer entry is another parameter
_INPUT_CAP = 512  # the head of an input's description kept (its name and datatype lead it)
_RAW_HEAD = 64  # bytes of the max_tokens tensor's raw contents read: 16 INT32 elements
_MAX_INPUTS = 64  # raw tensor heads kept while the max_tokens input is not known yet

# Walker phases.
_KEY, _LENGTH, _VARINT, _SKIP, _BODY, _DONE = range(6)


class RequestCharge:
    """The token cost of one ``ModelInferRequest`` of ``length`` bytes, fed its bytes in order::

    charge = RequestCharge(length)
    charge.feed(piece)   # True once the whole message was fed (bytes past it are ignored)
    charge.tokens()      # the cost (see the module doc); callable at any time
    """

    __slots__ = (
        "_cap",
        "_field",
        "_keep",
        "_kept",
        "_param",
        "_phase",
        "_raw_heads",
        "_shift",
        "_skip",
        "_tensor",
        "_value",
        "bad",
        "inputs",
        "left",
        "length",
        "raws",
        "source",
    )

    def __init__(self, length: int, compressed: bool = False) -> None:
        self.length = length
        self.left = length  # message bytes not fed yet
        self.bad = compressed  # unreadable: charged the default
        self._phase = _KEY
        self._value = self._shift = 0  # the varint being read
        self._field = 0
        self._skip = 0  # bytes left of the current field
        self._keep: bytearray | None = None  # the kept head of the current field
        self._cap = 0
        self._kept = 0  # the current field's full length
        self.inputs = self.raws = 0  # inputs and raw tensors met so far
        self._param: int | None = None  # the max_tokens parameter
        # The max_tokens input: [index, element size, signed, values from contents or None].
        self._tensor: list | None = None
        self._raw_heads: dict[int, tuple[bytes, int]] = {}  # raw index -> (head, full length)
        self.source = ""  # where max_tokens came from: tensor, parameter, default (after tokens())

    @property
    def done(self) -> bool:
        return self.left == 0

    def feed(self, data: bytes | bytearray | memoryview) -> bool:
        """Read the next bytes of the message; True once it is complete."""
        n = min(len(data), self.left)
        if n == 0:
            return self.left == 0
        self.left -= n
        if not self.bad:
            try:
                self._walk(data, n)
            except WireError:
                self.bad = True
        return self.left == 0

    def _walk(self, data: bytes | bytearray | memoryview, n: int) -> None:
        i = 0
        while i < n:
            phase = self._phase
            if phase in (_SKIP, _BODY):
                take = min(self._skip, n - i)
                keep = self._keep
                if keep is not None and len(keep) < self._cap:
                    keep += data[i : i + min(take, self._cap - len(keep))]
                i += take
                self._skip -= take
                if self._skip == 0:
                    if phase == _BODY:
                        self._field_done()
                    self._phase = _KEY
                continue
            b = data[i]
            i += 1
            self._value |= (b & 0x7F) << self._shift
            if b & 0x80:
                self._shift += 7
                if self._shift > 63:
                    raise WireError("varint longer than 10 bytes")
                continue
            value, self._value, self._shift = self._value, 0, 0
            if phase == _KEY:
                self._field, wtype = value >> 3, value & 7
                if self._field == 0:
                    raise WireError("field number 0")
                if wtype == 2:
                    self._phase = _LENGTH
                elif wtype == 0:
                    self._phase = _VARINT
                elif wtype == 1 or wtype == 5:
                    self._skip, self._phase = (8 if wtype == 1 else 4), _SKIP
                else:
                    raise WireError(f"unsupported wire type {wtype}")
            elif phase == _VARINT:
                self._phase = _KEY
            else:  # _LENGTH
                self._start(value)
        if self.left == 0 and self._phase != _KEY:
            raise WireError("the message ends inside a field")

    def _start(self, length: int) -> None:
        """A length-delimited field of ``length`` bytes begins: keep its head if it is wanted."""
        field = self._field
        cap = 0
        if field == _PARAMETERS:
            cap = _PARAM_CAP
        elif field == _INPUTS:
            cap = _INPUT_CAP
        elif field == _RAW:
            t = self._tensor
            if (t is not None and t[0] == self.raws) or (t is None and len(self._raw_heads) < _MAX_INPUTS):
                cap = _RAW_HEAD
            else:
                self.raws += 1
        self._keep = bytearray() if cap else None
        self._cap, self._kept = cap, length
        self._skip = length
        self._phase = _BODY if cap else _SKIP
        if length == 0:
            if cap:
                self._field_done()
            self._phase = _KEY

    def _field_done(self) -> None:
        head, length = bytes(self._keep or b""), self._kept
        self._keep = None
        field = self._field
        if field == _RAW:
            self._raw_heads[self.raws] = (head, length)
            self.raws += 1
        elif field == _INPUTS:
            index = self.inputs
            self.inputs += 1
            if length > len(head):
                # A long description: only its name and datatype are read (its contents, if
                # any, are too long for a max_tokens: the raw contents are used).
                name, dtype, _ = read_strings(head, 1, 2, partial=True)
                if name.encode() == NAME and dtype.encode() in _TYPES:
                    self._tensor = [index, *_TYPES[dtype.encode()][1:], None]
                return
            self._input(index, head)
        elif field == _PARAMETERS and length <= len(head):
            self._parameter(head)

    def _input(self, index: int, buf: bytes) -> None:
        name = dtype = b""
        contents: tuple[int, int] | None = None
        for number, wtype, start, stop in _fields(buf, 0, len(buf)):
            if wtype != 2:
                continue
            if number == 1:
                name = buf[start:stop]
            elif number == 2:
                dtype = buf[start:stop]
            elif number == _CONTENTS:
                contents = (start, stop)
        if name != NAME:
            return
        kind = _TYPES.get(dtype)
        if kind is None:
            self._tensor = None  # not an integer tensor: the upstream refuses it; not read
            return
        values = None
        if contents is not None:
            values = _ints(buf, contents[0], contents[1], kind[0], kind[2])
        self._tensor = [index, kind[1], kind[2], values or None]

    def _parameter(self, buf: bytes) -> None:
        key = b""
        value: int | None = None
        for number, wtype, start, stop in _fields(buf, 0, len(buf)):
            if number == 1 and wtype == 2:
                key = buf[start:stop]
            elif number == 2 and wtype == 2:
                for n2, w2, s2, _e2 in _fields(buf, start, stop):
                    if w2 == 0 and n2 in (_INT64_PARAM, _UINT64_PARAM):
                        v = _varint(buf, s2)[0]
                        value = v - (1 << 64) if n2 == _INT64_PARAM and v >= 1 << 63 else v
        if key == NAME and value is not None:
            self._param = value

    def max_tokens(self) -> int:
        """Generated tokens charged: from the tensor, the parameter or the default (``source``)."""
        if not self.bad and not self.left:  # a message cut short is not read either
            generated = self._from_tensor()
            if generated is not None:
                self.source = "tensor"
                return generated
            if self._param is not None:
                self.source = "parameter"
                return max(0, self._param)  # a charge over the capacity takes the whole bucket
        self.source = "default"
        return DEFAULT_MAX_TOKENS

    def _from_tensor(self) -> int | None:
        t = self._tensor
        if t is None:
            return None
        index, size, signed, values = t
        count = len(values) if values else 0
        if values is None:
            raw = self._raw_heads.get(index)
            if raw is None:
                return None
            head, length = raw
            count = length // size
            values = [
                int.from_bytes(head[k : k + size], "little", signed=signed)
                for k in range(0, min(len(head), count * size), size)
            ]
        if not values:
            return None
        values = [max(0, v) for v in values]
        return sum(values) + (count - len(values)) * max(values)

    def tokens(self) -> int:
        """The cost: ``ceil(length / BYTES_PER_TOKEN)`` + the generated tokens (module doc)."""
        return -(-self.length // BYTES_PER_TOKEN) + self.max_tokens()


def _ints(buf: bytes, start: int, stop: int, field: int, signed: bool) -> list[int]:
    """The integers of one InferTensorContents field (packed or not)."""
    out: list[int] = []
    for number, wtype, s, e in _fields(buf, start, stop):
        if number != field:
            continue
        if wtype == 2:
            pos = s
            while pos < e:
                v, pos = _varint(buf, pos)
                out.append(v)
        elif wtype == 0:
            out.append(_varint(buf, s)[0])
    if signed:
        # int32/int64 negative values are written as 64-bit two's complement varints.
        out = [v - (1 << 64) if v >= 1 << 63 else v for v in out]
    return out


def request_tokens(message: bytes, compressed: bool = False) -> int:
    """The cost of a whole ``ModelInferRequest`` (the aio engine has the message at once)."""
    charge = RequestCharge(len(message), compressed)
    charge.feed(message)
    return charge.tokens()
