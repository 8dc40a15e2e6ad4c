"""The token charge of a ``ModelInferRequest`` (``sidecar.protocols.grpc_charge``), fed raw bytes
built by Triton's own generated messages, whole and in every split."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from sidecar.apis.charge import DEFAULT_MAX_TOKENS
from sidecar.protocols.grpc_charge import RequestCharge, request_tokens


def llm_request(
    prompt: bytes = b"alpha beta",
    tensor: tuple[str, object] | None = None,
    param: int | None = None,
    contents: bool = False,
    tensor_first: bool = False,
) -> bytes:
    """A tiny_stream request as tritonclient writes it: text_input (BYTES, raw), and optionally
    a max_tokens tensor (``(datatype, values)``; raw, or in ``contents``) and parameter."""
    req = pb.ModelInferRequest(model_name="tiny_stream", model_version="1", id="r-1")
    if param is not None:
        req.parameters["max_tokens"].int64_param = param
    req.parameters["sequence_id"].int64_param = 7
    raws: list[bytes] = []

    def add_text() -> None:
        req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        raws.append(len(prompt).to_bytes(4, "little") + prompt)

    def add_tensor() -> None:
        assert tensor is not None
        dtype, values = tensor
        arr = np.atleast_1d(
            np.array(
                values,
                dtype={"INT32": np.int32, "INT64": np.int64, "UINT32": np.uint32, "FP32": np.float32}[dtype],
            )
        )
        inp = req.inputs.add(name="max_tokens", datatype=dtype, shape=list(arr.shape))
        if contents:
            field = {"INT32": "int_contents", "INT64": "int64_contents", "UINT32": "uint_contents"}[dtype]
            getattr(inp.contents, field).extend(arr.tolist())
        else:
            raws.append(arr.tobytes())

    if tensor is not None and tensor_first:
        add_tensor()
    add_text()
    if tensor is not None and not tensor_first:
        add_tensor()
    req.outputs.add(name="text_output")
    req.raw_input_contents.extend(raws)
    return req.SerializeToString()


def prompt(msg: bytes) -> int:
    return -(-len(msg) // 4)


def fed(msg: bytes, step: int) -> RequestCharge:
    charge = RequestCharge(len(msg))
    for i in range(0, len(msg), step):
        done = charge.feed(msg[i : i + step])
        assert done == (i + step >= len(msg))
    return charge


CASES = [
    ({"tensor": ("INT32", 7)}, 7, "tensor"),
    ({"tensor": ("INT64", 9)}, 9, "tensor"),
    ({"tensor": ("UINT32", 11)}, 11, "tensor"),
    ({"tensor": ("INT32", 7), "tensor_first": True}, 7, "tensor"),
    ({"tensor": ("INT32", 5), "contents": True}, 5, "tensor"),
    ({"tensor": ("INT64", 6), "contents": True}, 6, "tensor"),
    ({"tensor": ("UINT32", 8), "contents": True}, 8, "tensor"),
    ({"tensor": ("INT32", [3, 4])}, 7, "tensor"),  # a batch: each element generates
    ({"tensor": ("INT32", 7), "param": 100}, 7, "tensor"),  # the tensor wins
    ({"param": 100}, 100, "parameter"),
    ({}, DEFAULT_MAX_TOKENS, "default"),
    ({"tensor": ("INT32", -5)}, 0, "tensor"),  # negative: nothing generated (Triton refuses it)
    ({"tensor": ("INT32", -5), "contents": True}, 0, "tensor"),
    ({"param": -3}, 0, "parameter"),
    ({"tensor": ("FP32", 7.0), "param": 12}, 12, "parameter"),  # not an integer tensor: not read
]


@pytest.mark.parametrize(("kwargs", "generated", "source"), CASES)
def test_max_tokens_from_tensor_parameter_or_default(kwargs, generated, source) -> None:
    msg = llm_request(**kwargs)
    charge = fed(msg, len(msg))
    assert charge.tokens() == prompt(msg) + generated
    assert charge.source == source
    assert request_tokens(msg) == prompt(msg) + generated


@pytest.mark.parametrize(("kwargs", "generated", "source"), CASES[:11])
def test_every_split_gives_the_same_charge(kwargs, generated, source) -> None:
    msg = llm_request(prompt=b"x" * 300, **kwargs)
    for step in (1, 2, 3, 7, 64, 200):
        charge = fed(msg, step)
        assert (charge.tokens(), charge.source) == (prompt(msg) + generated, source), step


def test_the_prompt_estimate_follows_the_message_size() -> None:
    short = llm_request(prompt=b"a", tensor=("INT32", 10))
    long = llm_request(prompt=b"a" * 4001, tensor=("INT32", 10))
    assert request_tokens(long) - request_tokens(short) == prompt(long) - prompt(short) >= 1000


def test_a_long_prompt_is_skipped_not_kept() -> None:
    msg = llm_request(prompt=b"p" * 1_000_000, tensor=("INT32", 3))
    charge = RequestCharge(len(msg))
    charge.feed(msg[:500_000])
    kept = sum(len(head) for head, _ in charge._raw_heads.values()) + len(charge._keep or b"")
    assert kept <= 512  # half a megabyte of prompt read, a few bytes of it kept
    charge.feed(msg[500_000:])
    assert charge.tokens() == prompt(msg) + 3


def test_bytes_past_the_message_are_ignored() -> None:
    msg = llm_request(tensor=("INT32", 7))
    charge = RequestCharge(len(msg))
    assert charge.feed(msg + b"\x0a\x05other")
    assert charge.tokens() == prompt(msg) + 7


@pytest.mark.parametrize(
    "msg",
    [
        b"\xff\xff\xff",  # a key cut short
        b"\x0a\x20tiny",  # a field running past the end
        b"\x0b\x00",  # a group (wire type 3)
        b"\x00\x01",  # field number 0
        b"\x08" + b"\xff" * 11,  # a varint longer than 10 bytes
        b"\x22\x03\x0a\x05ab",  # a parameter entry whose key runs past the entry
        b"not protobuf at all, just words",
    ],
)
def test_a_malformed_message_is_charged_the_default(msg) -> None:
    for step in (1, len(msg)):
        charge = fed(msg, step)
        assert charge.tokens() == prompt(msg) + DEFAULT_MAX_TOKENS
        assert charge.source == "default"


def test_a_message_cut_short_or_compressed_is_charged_the_default() -> None:
    msg = llm_request(tensor=("INT32", 7))
    charge = RequestCharge(len(msg))
    assert not charge.feed(msg[:-3])  # the client ended the call inside its message
    assert charge.tokens() == prompt(msg) + DEFAULT_MAX_TOKENS
    assert request_tokens(msg, compressed=True) == prompt(msg) + DEFAULT_MAX_TOKENS
    assert RequestCharge(0).tokens() == DEFAULT_MAX_TOKENS


def test_a_max_tokens_tensor_without_contents_falls_back_to_the_parameter() -> None:
    req = pb.ModelInferRequest(model_name="m")
    req.inputs.add(name="max_tokens", datatype="INT32", shape=[1])  # its data never sent
    req.parameters["max_tokens"].int64_param = 42
    msg = req.SerializeToString()
    assert request_tokens(msg) == prompt(msg) + 42


def test_raw_contents_before_the_inputs_still_count() -> None:
    # Protobuf fields may come in any order: the raw tensors first, then their descriptions.
    req = pb.ModelInferRequest(model_name="m")
    req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    req.inputs.add(name="max_tokens", datatype="INT32", shape=[1])
    req.raw_input_contents.extend([b"\x01\x00\x00\x00a", np.int32(13).tobytes()])
    body = req.SerializeToString()
    split = body.index(b"\x3a")  # the first raw_input_contents key (field 7, wire type 2)
    msg = body[split:] + body[:split]
    assert request_tokens(msg) == prompt(msg) + 13


def test_a_long_input_description_named_max_tokens_uses_its_raw_contents() -> None:
    req = pb.ModelInferRequest(model_name="m")
    inp = req.inputs.add(name="max_tokens", datatype="INT32", shape=[1])
    inp.parameters["padding"].string_param = "x" * 1000
    req.raw_input_contents.append(np.int32(21).tobytes())
    msg = req.SerializeToString()
    assert request_tokens(msg) == prompt(msg) + 21
