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
``{"error_rate": 0.0..1.0, "extra_latency_ms": float}``, and for the token streams
(``TokenStream``) also ``ttft_ms``, ``per_token_ms`` and ``error_after_tokens``.

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
import threading
import time
from dataclasses import dataclass, fields

import numpy as np
import triton_python_backend_utils as pb_utils

FAULTS_DIR_ENV = "INFERWATCH_FAULTS_DIR"
STATE_DIR_ENV = "INFERWATCH_STATE_DIR"
INJECTED = "injected fault:"  # the start of every injected error's message


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


@dataclass(frozen=True, slots=True)
class Faults:
    """A fault file, typed: its keys are these fields (reference_server/faults.py KNOBS has the
    same, tested). The token-stream knobs left None keep the model's own pace."""

    error_rate: float = 0.0
    extra_latency_ms: float = 0.0
    ttft_ms: float | None = None
    per_token_ms: float | None = None
    error_after_tokens: int | None = None

    @classmethod
    def from_json(cls, data: object) -> Faults:
        """The known keys of a fault file; a file written by hand with other keys or types is
        read as far as it makes sense rather than failing every request."""
        if not isinstance(data, dict):
            return NO_FAULTS
        values = {}
        for f in fields(cls):
            value = data.get(f.name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                values[f.name] = int(value) if f.name == "error_after_tokens" else float(value)
        return cls(**values)


NO_FAULTS = Faults()


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
        self._fault = NO_FAULTS

    def current(self) -> Faults:
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
                    return NO_FAULTS  # replaced while reading: the next execution reads it again
                self._fault = Faults.from_json(fault)
                self._key = key
            return self._fault
        self._key, self._fault = None, NO_FAULTS
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
        elif self.kind == "token_stream":
            self.stream = TokenStream(self.name, self.version, params, self.faults)
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

    def execute(self, requests: list) -> list | None:
        if self.kind == "token_stream":
            return self.stream.execute(requests)
        fault = self.faults.current()
        delay = self.delay_s + fault.extra_latency_ms / 1000.0
        if delay > 0:
            time.sleep(delay)
        error_rate = fault.error_rate
        if error_rate > 0 and self.rng.random() < error_rate:
            raise pb_utils.TritonModelException(
                f"{INJECTED} {self.name} version {self.version} (error_rate={error_rate:g})"
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

    def finalize(self) -> None:
        if self.kind == "token_stream":
            self.stream.finalize()


def _int_param(params: dict, key: str, default: int) -> int:
    return int(params.get(key, str(default)))


class TokenStream:
    """A decoupled model that streams tokens at a set pace, standing in for an LLM.

    Each request gets a thread of its own and ``execute`` returns at once, so streams overlap as
    on an LLM server that batches continuously. Token ``i`` is the ``i``-th word of
    ``text_input`` (cycling; "token" when it has none) followed by a space, one response per token
    through the request's response sender, then a last send with only the
    ``TRITONSERVER_RESPONSE_COMPLETE_FINAL`` flag (the stream ends after the last token, as an
    LLM's does when it stops). The first token comes ``ttft_ms`` after the request reached the
    model, each next one ``per_token_ms`` after the one before (scheduled from the start, so
    the pace does not drift). Errors reach the client as an error response with the final flag:
    bad input before any token, an injected fault before the first token (``error_rate``) or
    after ``error_after_tokens`` tokens.
    """

    def __init__(self, name: str, version: str, params: dict, faults: FaultReader) -> None:
        self.name, self.version, self.faults = name, version, faults
        self.ttft_ms = float(params.get(f"v{version}_ttft_ms", params.get("ttft_ms", "0")))
        self.per_token_ms = float(params.get(f"v{version}_per_token_ms", params.get("per_token_ms", "0")))
        self.default_max_tokens = _int_param(params, "default_max_tokens", 16)
        self.max_tokens_limit = _int_param(params, "max_tokens_limit", 4096)
        self.rng = random.Random()
        self.threads: set[threading.Thread] = set()
        self.lock = threading.Lock()

    def execute(self, requests: list) -> None:
        fault = self.faults.current()
        for request in requests:
            t = threading.Thread(target=self._stream, args=(request, fault, time.monotonic()), daemon=True)
            with self.lock:
                self.threads.add(t)
            t.start()
        return None  # decoupled: every answer goes through the response senders

    def finalize(self) -> None:
        with self.lock:
            threads = list(self.threads)
        for t in threads:
            t.join(timeout=5)

    def _fail(self, sender, message: str, code: int) -> None:
        sender.send(
            pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)),
            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
        )

    def _read(self, request) -> tuple[list[str], int, bool]:
        """The prompt's words, the number of tokens to send, and whether to stream them one
        response each; ValueError for bad input."""
        text = pb_utils.get_input_tensor_by_name(request, "text_input")
        if text is None:  # Triton 2.51 passes a request without this required input on
            raise ValueError("text_input is required (one string, the prompt)")
        text = text.as_numpy().reshape(-1)
        if text.size != 1:
            raise ValueError(f"text_input must hold one string, got {text.size}")
        raw = text[0]
        prompt = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        max_tokens = self.default_max_tokens
        given = pb_utils.get_input_tensor_by_name(request, "max_tokens")
        if given is not None:
            values = given.as_numpy().reshape(-1)
            if values.size != 1:
                raise ValueError(f"max_tokens must hold one number, got {values.size}")
            max_tokens = int(values[0])
            if not 1 <= max_tokens <= self.max_tokens_limit:
                raise ValueError(
                    f"max_tokens must be between 1 and {self.max_tokens_limit}, got {max_tokens}"
                )
        stream = pb_utils.get_input_tensor_by_name(request, "stream")
        streaming = True if stream is None else bool(stream.as_numpy().reshape(-1)[0])
        return prompt.split() or ["token"], max_tokens, streaming

    def _stream(self, request, fault: Faults, start: float) -> None:
        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            try:
                words, max_tokens, streaming = self._read(request)
            except ValueError as exc:
                self._fail(sender, f"{self.name}: {exc}", pb_utils.TritonError.INVALID_ARG)
                return
            ttft = self.ttft_ms if fault.ttft_ms is None else fault.ttft_ms
            ttft = (ttft + fault.extra_latency_ms) / 1000.0
            per_token = (self.per_token_ms if fault.per_token_ms is None else fault.per_token_ms) / 1000.0
            error_after, error_rate = fault.error_after_tokens, fault.error_rate
            text = []
            for i in range(max_tokens):
                delay = start + ttft + i * per_token - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                if request.is_cancelled():  # the client left: stop generating for it
                    pb_utils.Logger.log_info(
                        f"{self.name} version {self.version}: cancelled after {i} tokens"
                    )
                    sender.send(flags=final)
                    return
                if i == 0 and error_rate > 0 and self.rng.random() < error_rate:
                    why = f"error_rate={error_rate:g}"
                elif error_after is not None and i == error_after:
                    why = f"error after {i} tokens"
                else:
                    why = ""
                if why:
                    self._fail(
                        sender,
                        f"{INJECTED} {self.name} version {self.version} ({why})",
                        pb_utils.TritonError.INTERNAL,
                    )
                    return
                token = words[i % len(words)] + " "
                if streaming:
                    sender.send(self._response(token))
                else:
                    text.append(token)
            if not streaming:
                sender.send(self._response("".join(text)), flags=final)
            else:
                sender.send(flags=final)
        except Exception as exc:  # never leave a stream open: its client would wait forever
            try:
                self._fail(sender, f"{self.name}: {type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL)
            except Exception:
                pass
        finally:
            with self.lock:
                self.threads.discard(threading.current_thread())

    @staticmethod
    def _response(text: str):
        out = pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_))
        return pb_utils.InferenceResponse(output_tensors=[out])
