"""HTTP/2 frames and HPACK header blocks, as much as the gRPC relay needs (RFC 9113, RFC 7541).

The relay forwards frames as they are and reads (or edits) only header blocks. It makes both
ends switch their HPACK dynamic table off (``settings_without_table``), so after the SETTINGS
exchange every block is self-contained: ``parse_block`` reads it without state and returns
each field's byte span, so a field can be dropped or appended (``literal``) without
desynchronising the two ends. Until a peer has applied that setting, ``HeaderReader`` follows
it with ``hpack``'s full decoder, and ``encode_stateless`` writes what it decoded again without
any table, so those first blocks are editable too.

Nothing here knows about gRPC; ``sidecar.protocols.grpc_relay`` builds on it.
"""

from __future__ import annotations

import struct

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# Frame types and flags (RFC 9113 6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    range(10)
)
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
# Error codes (RFC 9113 7).
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, REFUSED_STREAM, CANCEL = 0x0, 0x1, 0x2, 0x7, 0x8
SETTINGS_HEADER_TABLE_SIZE = 1
MAX_STREAM_ID = 0x7FFFFFFF
# SETTINGS_MAX_FRAME_SIZE's initial value: a frame the relay writes itself never exceeds it.
MAX_FRAME = 16384

_STATIC = hpack.table.HeaderTable.STATIC_TABLE  # RFC 7541 Appendix A, 1-based in the protocol

Field = tuple[bytes, bytes, int, int]  # name, value, start and end of its representation


class HpackError(ValueError):
    """A header block the stateless reader cannot take (the peer still uses its dynamic table)."""


def _int(buf: bytes, pos: int, prefix: int) -> tuple[int, int]:
    """An HPACK integer with an N-bit prefix starting at ``pos`` (RFC 7541 5.1)."""
    mask = (1 << prefix) - 1
    value = buf[pos] & mask
    pos += 1
    if value < mask:
        return value, pos
    shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value += (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 28:
            raise HpackError("integer too long")


def _string(buf: bytes, pos: int) -> tuple[bytes, int]:
    huffman = buf[pos] & 0x80
    length, pos = _int(buf, pos, 7)
    end = pos + length
    if end > len(buf):
        raise HpackError("string past the end of the block")
    raw = bytes(buf[pos:end])
    return (hpack.huffman_table.decode_huffman(raw) if huffman else raw), end


def parse_block(block: bytes, wanted: frozenset[bytes] | None = None) -> list[Field]:
    """(name, value, start, end) of each field of a header block that uses no dynamic table.

    With ``wanted``, only those fields are returned (the others are stepped over without
    decoding their values). Raises HpackError on a reference to the dynamic table or a table
    size above 0.
    """
    out = []
    pos, end = 0, len(block)
    static = _STATIC
    try:
        while pos < end:
            start = pos
            b = block[pos]
            if b & 0x80:  # indexed field
                index = b & 0x7F
                pos += 1
                if not 0 < index <= len(static):
                    raise HpackError(f"dynamic table index {index}")
                name, value = static[index - 1]
                if wanted is None or name in wanted:
                    out.append((name, value, start, pos))
                continue
            if b & 0xE0 == 0x20:  # dynamic table size update
                size, pos = _int(block, pos, 5)
                if size:
                    raise HpackError("dynamic table switched on")
                continue
            # Literal: with incremental indexing (01), without (0000) or never indexed (0001).
            index, pos = _int(block, pos, 6 if b & 0x40 else 4)
            if index:
                if index > len(static):
                    raise HpackError(f"dynamic table index {index}")
                name = static[index - 1][0]
            elif block[pos] < 0x7F:  # short raw name: the common case, read in place
                n = block[pos]
                name = bytes(block[pos + 1 : pos + 1 + n])
                pos += 1 + n
            else:
                name, pos = _string(block, pos)
            if wanted is not None and name not in wanted:
                vlen, pos = _int(block, pos, 7)
                pos += vlen
                if pos > end:
                    raise HpackError("string past the end of the block")
                continue
            value, pos = _string(block, pos)
            out.append((name, value, start, pos))
    except IndexError:
        raise HpackError("truncated header block") from None
    return out


def _hpack_int(value: int, prefix: int, first: int) -> bytes:
    mask = (1 << prefix) - 1
    if value < mask:
        return bytes([first | value])
    out = bytearray([first | mask])
    value -= mask
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes, never_indexed: bool = False) -> bytes:
    """A field as 'literal without indexing (or never indexed), new name', raw strings: it
    touches no table."""
    return (
        (b"\x10" if never_indexed else b"\x00")
        + _hpack_int(len(name), 7, 0)
        + name
        + _hpack_int(len(value), 7, 0)
        + value
    )


def encode_stateless(fields: list[tuple[bytes, bytes, bool]]) -> bytes:
    """(name, value, never indexed) fields as a block that uses no dynamic table."""
    return b"".join(literal(n, v, s) for n, v, s in fields)


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((ftype, flags)) + sid.to_bytes(4, "big") + payload


def header_frames(sid: int, end_stream: int, block: bytes) -> bytes:
    """A header block as HEADERS (plus CONTINUATIONs when it exceeds ``MAX_FRAME``)."""
    if len(block) <= MAX_FRAME:
        return frame(HEADERS, END_HEADERS | end_stream, sid, block)
    chunks = [block[i : i + MAX_FRAME] for i in range(0, len(block), MAX_FRAME)]
    out = [frame(HEADERS, end_stream, sid, chunks[0])]
    out += [frame(CONTINUATION, 0, sid, c) for c in chunks[1:-1]]
    out.append(frame(CONTINUATION, END_HEADERS, sid, chunks[-1]))
    return b"".join(out)


def settings_without_table(payload: bytes) -> bytes:
    """A SETTINGS payload with HEADER_TABLE_SIZE forced to 0."""
    out = bytearray()
    for i in range(0, len(payload) - len(payload) % 6, 6):
        if int.from_bytes(payload[i : i + 2], "big") != SETTINGS_HEADER_TABLE_SIZE:
            out += payload[i : i + 6]
    out += struct.pack(">HI", SETTINGS_HEADER_TABLE_SIZE, 0)
    return bytes(out)


def block_of(ftype: int, flags: int, payload: bytes) -> bytes:
    """The header block fragment of a HEADERS (padding and priority removed) or CONTINUATION."""
    if ftype == HEADERS:
        if flags & PADDED:
            pad = payload[0]
            payload = payload[1 : len(payload) - pad]
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
    return payload


class HeaderReader:
    """Header blocks of one direction: hpack's decoder until the peer's table is off, then stateless."""

    __slots__ = ("full", "stateless")

    def __init__(self) -> None:
        self.full: hpack.Decoder | None = hpack.Decoder()
        self.stateless = False

    def read(self, block: bytes, wanted: frozenset[bytes]) -> list[Field]:
        """The ``wanted`` fields, with their spans when stateless (editable), else spans of -1."""
        if self.stateless:
            return parse_block(block, wanted)
        return [f[:4] for f in self.read_all(block) if f[0] in wanted]

    def read_all(self, block: bytes) -> list[tuple[bytes, bytes, int, int, bool]]:
        """Every field of a block written before the peer's table went off, with spans of -1
        and whether it is never indexed (what ``encode_stateless`` needs to write it again)."""
        assert self.full is not None
        fields = [
            (bytes(n), bytes(v), -1, -1, isinstance(h, hpack.NeverIndexedHeaderTuple))
            for h in self.full.decode(block, raw=True)
            for n, v in (h,)
        ]
        if self.full.header_table.maxsize == 0 and not self.full.header_table.dynamic_entries:
            self.stateless, self.full = True, None
        return fields
