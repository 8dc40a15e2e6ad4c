"""inferwatch reference models: one Python-backend file serving every model of this repository.

The model's behaviour comes from its config.pbtxt ``parameters`` (``kind``, ``dim``, ``seed``,
...), so every ``<model>/<version>/model.py`` is the same four-line shim that imports this
file from the repository's top level (Triton loads only folders as models and ignores it).
The repository stays self-contained: it runs unchanged in the official Triton container,
where nothing of inferwatch is installed.

Weights are generated from a seed when the model loads (no downloads), so a test can rebuild
them and check the served numbers against its own numpy reference:
``W = default_rng(seed).standard_normal(shape, float32) * float32(1 / sqrt(rows))``
(``make_int4_weights`` for the int4 models).

Fault injection: before each execution the model stats ``<faults dir>/<model>@<version>.json``
and ``<faults dir>/<model>.json`` (the first that exists wins) and re-reads it only when it
changed, so the check costs two ``stat`` calls. The faults dir is ``$INFERWATCH_FAULTS_DIR``,
else ``$INFERWATCH_STATE_DIR/faults``; with neither set, faults are off. A fault file holds
``{"error_rate": 0.0..1.0, "extra_latency_ms": float}``.

An injected error raises from ``execute``: only then does Triton count the requests as failed in its
request-failure counter (an error set on an ``InferenceResponse`` is counted as a
success by the Python backend of Triton 2.51). Clients get HTTP 500 / gRPC INTERNAL. Raising
fails every request of the execution, so with dynamic batching a fault fails whole batches;
each request still fails with probability ``error_rate``.
"""

from __future__ import annotations

import json
import os
import random
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FAULTS_DIR_ENV = "INFERWATCH_FAULTS_DIR"
STATE_DIR_ENV = "INFERWATCH_STATE_DIR"


def make_weights(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    w *= np.float32(1.0 / np.sqrt(shape[0]))
    return w


INT4_GROUP = 128  # rows of the weight matrix sharing one scale and zero point, per column


def make_int4_weights(seed: int, dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """4-bit weights, two per byte (row 2i in the low nibble, row 2i+1 in the high one), with a
    float32 scale and zero point per group of INT4_GROUP rows and column (weight-only
    quantization, as int4 large-model serving stores weights). W = (nibble - zero) * scale."""
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 256, (dim // 2, dim), dtype=np.uint8)
    groups = dim // INT4_GROUP
    scales = (rng.random((groups, dim), dtype=np.float32) + np.float32(0.5)) * np.float32(
        1.0 / (4 * np.sqrt(dim))
    )
    zeros = rng.integers(6, 10, (groups, dim)).astype(np.float32)
    return packed, scales, zeros


def int4_streaming_matmul(
    x: np.ndarray, packed: np.ndarray, scales: np.ndarray, zeros: np.ndarray, block: int = 256
) -> np.ndarray:
    """x @ W, unpacking and dequantizing the int4 weights block by block on every call.

    This is the weight-bound path of quantized model serving: the weights stay compressed and
    are expanded as they stream through, so each call pays for every weight once whatever the
    batch, and each extra row costs little. One call's cost is nearly flat in the batch size,
    as a large model's step is on a GPU, so batching pays on a CPU too.
    """
    dim = packed.shape[1]
    y = np.zeros((x.shape[0], dim), dtype=np.float32)
    nibbles = np.empty((block, dim), dtype=np.uint8)
    for start in range(0, 2 * packed.shape[0], block):
        p = packed[start // 2 : (start + block) // 2]
        np.bitwise_and(p, 0x0F, out=nibbles[0::2])
        np.right_shift(p, 4, out=nibbles[1::2])
        g = slice(start // INT4_GROUP, (start + block) // INT4_GROUP)
        w = nibbles.astype(np.float32).reshape(-1, INT4_GROUP, dim)
        w -= zeros[g, None, :]
        w *= scales[g, None, :]
        y += x[:, start : start + block] @ w.reshape(block, dim)
    return y


class FaultReader:
    """The current fault of one model version, re-read only when its file changes."""

    def __init__(self, model: str, version: str) -> None:
        root = os.environ.get(FAULTS_DIR_ENV)
        if not root and os.environ.get(STATE_DIR_ENV):
            root = os.path.join(os.environ[STATE_DIR_ENV], "faults")
        self.paths = (
            [os.path.join(root, f"{model}@{version}.json"), os.path.join(root, f"{model}.json")]
            if root
            else []
        )
        self._key: tuple | None = None
        self._fault: dict = {}

    def current(self) -> dict:
        for path in self.paths:
            try:
                st = os.stat(path)
            except OSError:
                continue
            key = (path, st.st_ino, st.st_mtime_ns, st.st_size)
            if key != self._key:
                try:
                    with open(path, encoding="utf-8") as fh:
                        fault = json.load(fh)
                except (OSError, ValueError):
                    return {}  # replaced while reading: the next execution reads it again
                self._fault = fault if isinstance(fault, dict) else {}
                self._key = key
            return self._fault
        self._key, self._fault = None, {}
        return self._fault


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.name = args["model_name"]
        self.version = args["model_version"]
        self.kind = params.get("kind", "dense")
        self.faults = FaultReader(self.name, self.version)
        self.rng = random.Random()
        self.delay_s = 0.0
        if self.kind == "dense":
            dim = int(params.get("dim", "4096"))
            self.input_name, self.output_name = "INPUT", "OUTPUT"
            self.weights = make_weights(int(params.get("seed", "0")), (dim, dim))
        elif self.kind == "dense_int4":
            self.input_name, self.output_name = "INPUT", "OUTPUT"
            self.int4 = make_int4_weights(int(params.get("seed", "0")), int(params.get("dim", "4096")))
        elif self.kind == "ranker":
            features = int(params.get("features", "32"))
            self.input_name, self.output_name = "FEATURES", "SCORES"
            seed = int(params.get(f"v{self.version}_seed", self.version))
            hidden = int(params.get(f"v{self.version}_hidden", "0"))
            # v1: a linear scorer; v2 (the canary): a two-layer scorer that is also slower.
            self.w1 = make_weights(seed, (features, hidden)) if hidden else None
            self.w2 = make_weights(seed + 1, (hidden or features, 1))
            self.delay_s = float(params.get(f"v{self.version}_latency_ms", "0")) / 1000.0
        else:
            raise pb_utils.TritonModelException(f"unknown model kind {self.kind!r} in {self.name}")

    def _compute(self, x: np.ndarray) -> np.ndarray:
        if self.kind == "dense":
            return x @ self.weights
        if self.kind == "dense_int4":
            return int4_streaming_matmul(x, *self.int4)
        h = np.tanh(x @ self.w1) if self.w1 is not None else x
        return (h @ self.w2)[..., 0]

    def execute(self, requests: list) -> list:
        fault = self.faults.current()
        delay = self.delay_s + float(fault.get("extra_latency_ms", 0.0)) / 1000.0
        if delay > 0:
            time.sleep(delay)
        error_rate = float(fault.get("error_rate", 0.0))
        if error_rate > 0 and self.rng.random() < error_rate:
            raise pb_utils.TritonModelException(
                f"injected fault: {self.name} version {self.version} (error_rate={error_rate:g})"
            )
        # One matrix product for the whole batch: reading the weights once is what batching buys.
        inputs = [pb_utils.get_input_tensor_by_name(r, self.input_name).as_numpy() for r in requests]
        outputs = self._compute(np.concatenate(inputs) if len(inputs) > 1 else inputs[0])
        responses = []
        start = 0
        for x in inputs:
            out = np.ascontiguousarray(outputs[start : start + x.shape[0]], dtype=np.float32)
            start += x.shape[0]
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(self.output_name, out)])
            )
        return responses
