"""What the reference models take and give: names, dtypes, shapes, and valid example inputs.

This is the client-side view of ``reference_server/model_repository``; a test checks it
against the model configs Triton actually serves, so the two cannot drift apart.
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


_NUMPY: dict[str, type[np.generic]] = {"FP32": np.float32, "FP64": np.float64, "INT32": np.int32}

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
