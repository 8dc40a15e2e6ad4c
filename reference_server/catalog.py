"""What the reference models take and give: names, dtypes, shapes, and valid example inputs.

This is the client-side view of ``reference_server/model_repository``; a test checks it
against the model configs Triton actually serves, so the two cannot drift apart.

``MODELS`` answer one request with one response (KServe v2 ``infer``); ``STREAM_MODELS`` are
decoupled token streams, reached through ``generate``, ``generate_stream`` and gRPC
``ModelStreamInfer`` (Triton refuses ``infer`` for them), so they are kept apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

MODEL_REPOSITORY = Path(__file__).resolve().parent / "model_repository"

DENSE_DIM = 4096
RANKER_CANDIDATES = 16
RANKER_FEATURES = 32


@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    datatype: str  # the KServe v2 / Triton datatype, e.g. "FP32"
    shape: tuple[int, ...]  # without the batch dimension

    @property
    def numpy_dtype(self) -> type[np.generic]:
        return _NUMPY[self.datatype]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    versions: tuple[str, ...]
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    max_batch_size: int
    dynamic_batching: bool
    description: str
    compute: str = ""  # dense models: "float32" or "int4-streaming" (see reference_models.py)

    @property
    def input(self) -> Tensor:
        return self.inputs[0]

    @property
    def output(self) -> Tensor:
        return self.outputs[0]


@dataclass(frozen=True, slots=True)
class StreamModelInfo:
    """A decoupled model that streams tokens (reference_models.TokenStream): one response per
    token, then a final flag; ``"stream": false`` gets the whole text in one response."""

    name: str
    versions: tuple[str, ...]
    inputs: tuple[Tensor, ...]  # the first is the prompt; the others are optional
    outputs: tuple[Tensor, ...]
    ttft_ms: dict[str, float]  # by version: time from the request to the first token
    per_token_ms: dict[str, float]  # by version: time between two tokens
    default_max_tokens: int
    max_tokens_limit: int
    description: str
    max_batch_size: int = 0
    dynamic_batching: bool = False


_NUMPY: dict[str, type[np.generic]] = {
    "FP32": np.float32,
    "FP64": np.float64,
    "INT32": np.int32,
    "BYTES": np.object_,
    "BOOL": np.bool_,
}

_DENSE_IN = (Tensor("INPUT", "FP32", (DENSE_DIM,)),)
_DENSE_OUT = (Tensor("OUTPUT", "FP32", (DENSE_DIM,)),)

MODELS: dict[str, ModelInfo] = {
    m.name: m
    for m in (
        ModelInfo(
            "dense_batched",
            ("1",),
            _DENSE_IN,
            _DENSE_OUT,
            8,
            True,
            "x @ W with a 4096x4096 float32 W; dynamic batching, preferred batch sizes [4, 8]",
            "float32",
        ),
        ModelInfo(
            "dense_unbatched",
            ("1",),
            _DENSE_IN,
            _DENSE_OUT,
            8,
            False,
            "the same model and weights as dense_batched, without dynamic batching",
            "float32",
        ),
        ModelInfo(
            "dense_int4_batched",
            ("1",),
            _DENSE_IN,
            _DENSE_OUT,
            32,
            True,
            "x @ W with W in int4 (group size 128), unpacked block by block per execution (weight-bound); "
            "dynamic batching, preferred batch sizes [16, 32]",
            "int4-streaming",
        ),
        ModelInfo(
            "dense_int4_unbatched",
            ("1",),
            _DENSE_IN,
            _DENSE_OUT,
            32,
            False,
            "the same model and weights as dense_int4_batched, without dynamic batching",
            "int4-streaming",
        ),
        ModelInfo(
            "ranker",
            ("1", "2"),
            (Tensor("FEATURES", "FP32", (RANKER_CANDIDATES, RANKER_FEATURES)),),
            (Tensor("SCORES", "FP32", (RANKER_CANDIDATES,)),),
            8,
            True,
            "scores 16 candidates; version 1 stable (linear), version 2 canary (two layers, slower)",
        ),
    )
}

STREAM_MODELS: dict[str, StreamModelInfo] = {
    m.name: m
    for m in (
        StreamModelInfo(
            "tiny_stream",
            ("1", "2"),
            (
                Tensor("text_input", "BYTES", (1,)),
                Tensor("max_tokens", "INT32", (1,)),
                Tensor("stream", "BOOL", (1,)),
            ),
            (Tensor("text_output", "BYTES", (1,)),),
            ttft_ms={"1": 20.0, "2": 20.0},
            per_token_ms={"1": 10.0, "2": 15.0},
            default_max_tokens=16,
            max_tokens_limit=4096,
            description="streams the prompt's words back as tokens at a set pace; version 1 stable, "
            "version 2 canary (slower per token)",
        ),
    )
}

# How each model's weights are generated at load (the parameters of its config.pbtxt), so
# a test can rebuild them and compute the expected numbers with numpy.
WEIGHT_SEEDS: dict[tuple[str, str], int] = {
    ("dense_batched", "1"): 1,
    ("dense_unbatched", "1"): 1,
    ("dense_int4_batched", "1"): 2,
    ("dense_int4_unbatched", "1"): 2,
    ("ranker", "1"): 101,
    ("ranker", "2"): 201,
}
RANKER_V2_HIDDEN = 256


def model_info(name: str) -> ModelInfo:
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise KeyError(f"unknown model {name!r}; the reference models are: {known}") from None


def example_input(model: str, batch: int = 1, seed: int | None = None) -> dict[str, np.ndarray]:
    """A valid input for ``model``: {input name: array of shape (batch, *shape)}.

    Values are standard normal (from ``seed`` when given, so a test can repeat them).
    """
    info = model_info(model)
    rng = np.random.default_rng(seed)
    return {
        t.name: rng.standard_normal((batch, *t.shape), dtype=np.float32).astype(t.numpy_dtype)
        for t in info.inputs
    }
