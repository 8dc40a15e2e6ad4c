"""The gRPC proxy's protobuf field reader, fed raw bytes built by Triton's own generated messages."""

from __future__ import annotations

import struct

import hpack
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from sidecar.protocols.grpc_aio import forwarded_metadata, with_traceparent
from sidecar.protocols.grpc_methods import UNARY_METHODS, stream_error_code
from sidecar.protocols.grpc_streams import StreamMatcher
from sidecar.protocols.grpc_wire import (
    HEAD_BYTES,
    MessageScanner,
    WireError,
    grpc_timeout_seconds,
    grpc_timeout_value,
    read_strings,
    response_has_text,
    stream_response_info,
)
from sidecar.protocols.h2 import HeaderReader, HpackError, literal, parse_block, settings_without_table


def infer_request(model: str = "ranker", version: str = "", rid: str = "", tensor_bytes: int = 64) -> bytes:
    req = pb.ModelInferRequest(model_name=model, model_version=version, id=rid)
    inp = req.inputs.add(name="FEATURES", datatype="FP32", shape=[1, tensor_bytes // 4])
    inp.parameters["binary_data_size"].int64_param = tensor_bytes
    req.outputs.add(name="SCORES")
    req.raw_input_contents.append(np.arange(tensor_bytes // 4, dtype=np.float32).tobytes())
    return req.SerializeToString()


def test_model_and_version_of_an_infer_request() -> None:
    assert read_strings(infer_request("ranker", "2", "r-1"), 1, 2, 3) == ("ranker", "2", "r-1")
    assert read_strings(infer_request("dense_batched"), 1, 2) == ("dense_batched", "", "")


def test_tensor_bytes_are_skipped_not_parsed() -> None:
    # 8 MiB of tensor after the names: the reader returns the names and never looks inside it;
    # a tensor whose bytes look like protobuf tags cannot confuse it either.
    req = pb.ModelInferRequest(model_name="dense_batched", model_version="1")
    req.raw_input_contents.append(b"\x0a\x05bogus" * (8 * 1024 * 1024 // 7))
    assert read_strings(req.SerializeToString(), 1, 2) == ("dense_batched", "1", "")


def test_fields_out_of_order_and_repeated_follow_protobuf_rules() -> None:
    # Encoders may write fields in any order, and the last value of a scalar wins.
    tail = pb.ModelInferRequest(model_version="3").SerializeToString()
    head = pb.ModelInferRequest(model_name="first").SerializeToString()
    again = pb.ModelInferRequest(model_name="last").SerializeToString()
    data = tail + head + again
    parsed = pb.ModelInferRequest.FromString(data)
    assert read_strings(data, 1, 2) == (parsed.model_name, parsed.model_version, "")
    assert parsed.model_name == "last"


@pytest.mark.parametrize(
    ("message", "fields", "expected"),
    [
        (pb.ModelReadyRequest(name="ranker", version="1"), UNARY_METHODS["ModelReady"], ("ranker", "1")),
        (
            pb.ModelMetadataRequest(name="ranker", version="2"),
            UNARY_METHODS["ModelMetadata"],
            ("ranker", "2"),
        ),
        (pb.ModelConfigRequest(name="ranker"), UNARY_METHODS["ModelConfig"], ("ranker", "")),
        (pb.ModelStatisticsRequest(name="m", version="7"), UNARY_METHODS["ModelStatistics"], ("m", "7")),
        (
            pb.RepositoryModelLoadRequest(repository_name="repo", model_name="ranker"),
            UNARY_METHODS["RepositoryModelLoad"],
            ("ranker", ""),
        ),
        (pb.TraceSettingRequest(model_name="ranker"), UNARY_METHODS["TraceSetting"], ("ranker", "")),
    ],
)
def test_each_model_method_reads_its_own_fields(message, fields: tuple[int, int], expected) -> None:
    assert read_strings(message.SerializeToString(), *fields)[:2] == expected


def test_the_method_table_matches_triton_proto() -> None:
    """Every unary method of the service is in the table, with the fields its request really has."""
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    unary = {m.name: m for m in service.methods if not m.client_streaming}
    assert set(unary) == set(UNARY_METHODS)
    for name, (name_field, version_field) in UNARY_METHODS.items():
        fields = {f.number: f for f in unary[name].input_type.fields}
        names = ((name_field, ("name", "model_name")), (version_field, ("version", "model_version")))
        for number, wanted in names:
            if number:
                assert fields[number].name in wanted, (name, number)
                assert fields[number].type == fields[number].TYPE_STRING
        if not name_field:
            assert not {"name", "model_name"} & {f.name for f in fields.values()} or name.startswith(
                ("SystemSharedMemory", "CudaSharedMemory")  # their "name" is a region, not a model
            )


def test_empty_message_has_no_model() -> None:
    assert read_strings(b"", 1, 2) == ("", "", "")


@pytest.mark.parametrize(
    "data",
    [
        infer_request()[:-3],  # truncated inside the tensor bytes
        b"\x0a\x10ranker",  # length past the end
        b"\x0a",  # tag without its length
        b"\x0a\xff\xff",  # truncated length varint
        b"\x0b\x0c",  # group (wire type 3)
        b"\x0f",  # wire type 7
        b"\x00\x01",  # field number 0
        b"\x08" + b"\xff" * 11,  # varint over 10 bytes
    ],
)
def test_malformed_bytes_raise_wire_error(data: bytes) -> None:
    with pytest.raises(WireError):
        read_strings(data, 1, 2)


def test_non_utf8_name_does_not_raise() -> None:
    model, _, _ = read_strings(b"\x0a\x02\xff\xfe", 1, 2)
    assert isinstance(model, str) and model


def test_stream_response_ok_and_error() -> None:
    ok = pb.ModelStreamInferResponse()
    ok.infer_response.model_name = "ranker"
    ok.infer_response.model_version = "2"
    ok.infer_response.id = "r-7"
    ok.infer_response.raw_output_contents.append(b"\x00" * 4096)
    assert stream_response_info(ok.SerializeToString()) == ("", "ranker", "r-7", None)

    err = pb.ModelStreamInferResponse(error_message="Request for unknown model: 'x' is not found")
    err.infer_response.id = "r-8"  # Triton echoes the failed request's id
    assert stream_response_info(err.SerializeToString()) == (
        "Request for unknown model: 'x' is not found",
        "",
        "r-8",
        None,
    )


def test_stream_response_final_flag_of_decoupled_models() -> None:
    resp = pb.ModelStreamInferResponse()
    resp.infer_response.model_name = "m"
    resp.infer_response.parameters["sequence_id"].int64_param = 5
    resp.infer_response.parameters["triton_final_response"].bool_param = False
    assert stream_response_info(resp.SerializeToString())[3] is False
    resp.infer_response.parameters["triton_final_response"].bool_param = True
    assert stream_response_info(resp.SerializeToString())[3] is True


def test_stream_response_truncated_raises() -> None:
    resp = pb.ModelStreamInferResponse()
    resp.infer_response.model_name = "ranker"
    with pytest.raises(WireError):
        stream_response_info(resp.SerializeToString()[:-2])


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("Request for unknown model: 'nosuch' is not found", "NOT_FOUND"),
        ("[request id: r-1] unexpected inference input 'BAD' for model 'ranker'", "INVALID_ARGUMENT"),
        (
            "[request id: <id_unknown>] expected 1 inputs but got 2 inputs for model 'ranker'",
            "INVALID_ARGUMENT",
        ),
        (
            "Failed to process the request(s) for model 'ranker_0_0', message: TritonModelException",
            "INTERNAL",
        ),
        ("anything else", "INTERNAL"),
    ],
)
def test_in_stream_errors_are_classified(message: str, code: str) -> None:
    assert stream_error_code(message) == code


def test_metadata_forwarding_drops_transport_headers_and_swaps_traceparent() -> None:
    client = (
        ("user-agent", "grpc-python/1.0"),
        ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
        ("x-team", "search"),
        ("token-bin", b"\x00\x01"),
    )
    forwarded = forwarded_metadata(client)
    assert forwarded == client[1:]
    assert with_traceparent(forwarded, None) is forwarded
    ours = "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01"
    swapped = with_traceparent(forwarded, ours)
    assert [v for k, v in swapped if k == "traceparent"] == [ours]
    assert ("x-team", "search") in swapped and ("token-bin", b"\x00\x01") in swapped


# --------------------------------------------------------------------------- the HTTP/2 relay's readers


def stateless_block(headers: list[tuple[str, str]]) -> bytes:
    """A header block as an encoder with its dynamic table switched off writes it (what the
    relay's SETTINGS make both ends do)."""
    encoder = hpack.Encoder()
    encoder.header_table_size = 0
    return encoder.encode(headers)


REQUEST_HEADERS = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", "/inference.GRPCInferenceService/ModelInfer"),
    (":authority", "127.0.0.1:8011"),
    ("te", "trailers"),
    ("content-type", "application/grpc"),
    ("grpc-timeout", "2500m"),
    ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
]


def test_stateless_header_blocks_parse_with_editable_spans() -> None:
    block = stateless_block(REQUEST_HEADERS)
    fields = parse_block(block)
    assert [(n.decode(), v.decode()) for n, v, _, _ in fields] == REQUEST_HEADERS
    # Dropping one field's span and appending a literal still decodes, and changes nothing else.
    (start, stop) = next((s, e) for n, _, s, e in fields if n == b"grpc-timeout")
    edited = block[:start] + block[stop:] + literal(b"grpc-timeout", b"300m")
    decoded = [(bytes(n).decode(), bytes(v).decode()) for n, v in hpack.Decoder().decode(edited, raw=True)]
    assert decoded == [h for h in REQUEST_HEADERS if h[0] != "grpc-timeout"] + [("grpc-timeout", "300m")]


def test_only_wanted_fields_are_returned() -> None:
    block = stateless_block(REQUEST_HEADERS)
    fields = parse_block(block, frozenset({b":path", b"traceparent"}))
    assert [f[:2] for f in fields] == [
        (b":path", b"/inference.GRPCInferenceService/ModelInfer"),
        (b"traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
    ]


def test_huffman_coded_strings_are_decoded() -> None:
    encoder = hpack.Encoder()
    encoder.header_table_size = 0
    block = encoder.encode([("grpc-status", "14"), ("grpc-message", "upstream unavailable")], huffman=True)
    assert [(n, v) for n, v, _, _ in parse_block(block)] == [
        (b"grpc-status", b"14"),
        (b"grpc-message", b"upstream unavailable"),
    ]


def test_blocks_that_use_the_dynamic_table_are_refused() -> None:
    encoder = hpack.Encoder()
    encoder.encode(REQUEST_HEADERS)  # fills the dynamic table
    with pytest.raises(HpackError):
        parse_block(encoder.encode(REQUEST_HEADERS))  # now refers to it
    with pytest.raises(HpackError):
        parse_block(b"\x3f\xe1\x1f")  # dynamic table size update to 4096
    with pytest.raises(HpackError):
        parse_block(b"\x40\x0agrpc")  # truncated literal


def test_header_reader_follows_a_peer_until_its_table_is_off() -> None:
    """Before the peer applies our SETTINGS its blocks use the dynamic table: hpack's decoder
    follows them; the block carrying the size update to 0 switches the reader to stateless."""
    encoder = hpack.Encoder()
    reader = HeaderReader()
    every = frozenset(n.encode() for n, _ in REQUEST_HEADERS)
    first = reader.read(encoder.encode(REQUEST_HEADERS), every)
    assert [(n.decode(), v.decode()) for n, v, _, _ in first] == REQUEST_HEADERS
    assert not reader.stateless
    encoder.header_table_size = 0  # the peer acknowledged SETTINGS_HEADER_TABLE_SIZE = 0
    second = reader.read(encoder.encode(REQUEST_HEADERS), every)
    assert [(n.decode(), v.decode()) for n, v, _, _ in second] == REQUEST_HEADERS
    assert reader.stateless
    third = reader.read(encoder.encode(REQUEST_HEADERS), frozenset({b":path", b"grpc-timeout"}))
    assert [f[:2] for f in third] == [
        (b":path", b"/inference.GRPCInferenceService/ModelInfer"),
        (b"grpc-timeout", b"2500m"),
    ]


def test_settings_are_rewritten_to_switch_the_table_off() -> None:
    payload = struct.pack(">HIHI", 1, 4096, 4, 65535)  # HEADER_TABLE_SIZE 4096, INITIAL_WINDOW_SIZE
    assert settings_without_table(payload) == struct.pack(">HIHI", 4, 65535, 1, 0)
    assert settings_without_table(b"") == struct.pack(">HI", 1, 0)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (b"2500m", 2.5),
        (b"3S", 3.0),
        (b"1H", 3600.0),
        (b"100u", 1e-4),
        (b"5n", 5e-9),
        (b"x", None),
        (b"12", None),
    ],
)
def test_grpc_timeout_values(value: bytes, seconds: float | None) -> None:
    assert grpc_timeout_seconds(value) == (pytest.approx(seconds) if seconds else None)


def test_grpc_timeout_is_written_in_the_finest_unit_that_fits() -> None:
    assert grpc_timeout_value(0.3) == b"300m"
    assert grpc_timeout_seconds(grpc_timeout_value(60.0)) == 60.0
    assert len(grpc_timeout_value(10**7)) <= 9  # the gRPC spec allows at most 8 digits


def test_message_heads_are_found_across_any_split_of_the_stream() -> None:
    """gRPC messages (5-byte prefix + body) cut at every possible place still yield each head once."""
    bodies = [
        infer_request("ranker", "1", "a"),
        infer_request("dense_batched", "", "b", tensor_bytes=4096),
        b"",
    ]
    stream = b"".join(b"\x00" + len(b).to_bytes(4, "big") + b for b in bodies)
    for cut in range(1, len(stream)):
        scan, heads = MessageScanner(), []
        scan.feed(stream[:cut], heads)
        scan.feed(stream[cut:], heads)
        assert [h[0] for h in heads] == [len(b) for b in bodies]
        labels = [read_strings(h[1], 1, 2, 3, partial=True) for h in heads[:2]]
        assert labels == [("ranker", "1", "a"), ("dense_batched", "", "b")]
    assert len(heads[1][1]) == HEAD_BYTES  # only the head of a long message is kept


def test_partial_reads_stop_quietly_at_the_cut() -> None:
    data = infer_request("ranker", "2", "r-1")
    assert read_strings(data[:10], 1, 2, 3, partial=True) == ("ranker", "", "")  # version cut
    assert read_strings(data[:3], 1, 2, 3, partial=True) == ("", "", "")
    resp = pb.ModelStreamInferResponse()
    resp.infer_response.model_name = "ranker"
    resp.infer_response.id = "r-9"
    resp.infer_response.raw_output_contents.append(b"\x01" * 4096)
    head = resp.SerializeToString()[:64]
    assert stream_response_info(head, partial=True) == ("", "ranker", "r-9", None)
    err = pb.ModelStreamInferResponse(error_message="Request for unknown model: 'x' is not found")
    err.infer_response.id = "r-10"
    assert stream_response_info(err.SerializeToString(), partial=True)[::2] == (
        "Request for unknown model: 'x' is not found",
        "r-10",
    )


# --------------------------------------------------------------------------- the stream matcher


def test_stream_matcher_rules() -> None:
    """By id, first in first out among equal ids; an error naming no open request closes the
    oldest open one (by arrival, whatever its id); a non-final response closes nothing; drain
    hands back the rest oldest first."""
    m = StreamMatcher()
    for rid, obs in (("a", "a1"), ("b", "b1"), ("a", "a2"), ("", "n1"), ("", "n2")):
        m.add(rid, obs, len(obs))
    assert len(m) == 5
    assert m.take("a", error=False, final=False) is None  # decoupled, not final
    assert m.take("a", error=False, final=None) == ("a1", 2)
    assert m.take("zz", error=False, final=None) is None  # a response for nothing open
    assert m.take("zz", error=True, final=None) == ("b1", 2)  # the oldest open: b1, not a2
    assert m.take("", error=False, final=True) == ("n1", 2)
    assert list(m.drain()) == [("a2", 2), ("n2", 2)]
    assert len(m) == 0 and m.take("", error=True, final=None) is None


# --------------------------------------------------------------------------- generated text


def _token_response(text: bytes | None, outputs_before: int = 0, final: bool = False) -> bytes:
    """A decoupled model's ModelStreamInferResponse, as Triton sends a token (text_output)."""
    r = pb.ModelStreamInferResponse()
    ir = r.infer_response
    ir.model_name, ir.model_version, ir.id = "tiny_stream", "1", "r-1"
    ir.parameters["triton_final_response"].bool_param = final
    for i in range(outputs_before):
        ir.outputs.add(name=f"other_{i}", datatype="INT32", shape=[1])
        ir.raw_output_contents.append(b"\x07\x00\x00\x00")
    if text is not None:
        ir.outputs.add(name="text_output", datatype="BYTES", shape=[1])
        ir.raw_output_contents.append(len(text).to_bytes(4, "little") + text)
    return r.SerializeToString()


def test_response_has_text() -> None:
    assert response_has_text(_token_response(b"hi "))
    assert response_has_text(_token_response(b"hi ", outputs_before=2))  # found by its place
    assert not response_has_text(_token_response(b""))  # an empty text is no token
    assert not response_has_text(_token_response(None, final=True))  # the empty final response
    assert not response_has_text(_token_response(b"", outputs_before=1))
    err = pb.ModelStreamInferResponse(error_message="injected fault: tiny_stream (error after 2 tokens)")
    err.infer_response.id = "r-1"
    assert not response_has_text(err.SerializeToString())
    other = pb.ModelStreamInferResponse()
    other.infer_response.outputs.add(name="SCORES", datatype="FP32", shape=[1])
    other.infer_response.raw_output_contents.append(b"\x00" * 4)
    assert not response_has_text(other.SerializeToString())  # not an LLM's output
    assert not response_has_text(b"\xff\xff")  # not protobuf: no text, no exception


def test_response_has_text_on_every_head_length() -> None:
    """The relay reads only a message's head: a head cut anywhere never raises, says no text
    before the text_output tensor is named, and says text once it is (unless the element's
    length, when read, is 0)."""
    full = _token_response(b"a long token " * 50)
    named_at = full.index(b"text_output") + len(b"text_output")
    for cut in range(len(full) + 1):
        assert response_has_text(full[:cut]) is (cut >= named_at), cut
    empty = _token_response(b"")
    named_at = empty.index(b"text_output") + len(b"text_output")
    for cut in range(len(empty) + 1):
        # Cut before the length: the tensor's presence counts; once the length (0) is read: none.
        assert response_has_text(empty[:cut]) is (named_at <= cut < len(empty)), cut


def test_stream_matcher_peek() -> None:
    m = StreamMatcher()
    assert m.peek("a") is None
    m.add("a", "a1", 1)
    m.add("a", "a2", 1)
    assert m.peek("a") == "a1" and m.peek("b") is None and len(m) == 2  # peek closes nothing
    assert m.take("a", error=False, final=True) == ("a1", 1)
    assert m.peek("a") == "a2"
