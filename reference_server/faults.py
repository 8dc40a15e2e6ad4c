"""Fault injection for the running reference models, without restarting Triton.

A fault is a small JSON file under ``<state dir>/faults/``: ``<model>.json`` applies to every
version of a model, ``<model>@<version>.json`` to one version and wins over the model-wide
file. Each model stats its two files before every execution and re-reads one only when it
changed (``reference_server/model_repository/reference_models.py``), so a change applies to the very
next request from any client. Files are replaced atomically, so a model never reads half of one.

An injected error makes the model's ``execute`` raise: Triton counts the request as failed
in its request-failure counter (reason ``BACKEND``) and clients get HTTP 500 or gRPC
``INTERNAL``, with a message starting "Failed to process the request(s) for model".
Extra latency is a sleep before the computation, so it shows in Triton's compute time too.

The token-streaming models (``catalog.STREAM_MODELS``) take three more knobs: the time to the
first token, the time between tokens, and an error after N tokens (an error response that ends
the stream: README.md, "What a mid-stream error looks like"). ``KNOBS`` is the one table of
fault kinds: the file keys, ``Fault``'s fields, the CLI's flags and their bounds.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from inferwatch.paths import state_dir as default_state_dir

FAULTS_SUBDIR = "faults"
MAX_EXTRA_LATENCY_MS = 600_000.0
MAX_TOKENS = 4096  # the streaming model's max_tokens_limit
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_VERSION = re.compile(r"^[0-9]+$")

# What clients see for an injected error (checked by tests/test_reference_faults.py).
HTTP_STATUS = 500
GRPC_CODE = "INTERNAL"
# Every injected error's message starts with this (reference_models.INJECTED).
INJECTED = "injected fault:"


class FaultError(ValueError):
    """Bad fault settings; the message is one line for the user."""


@dataclass(frozen=True, slots=True)
class Knob:
    """One kind of fault: its key in the fault file (and field of ``Fault``), its flag, bounds."""

    field: str
    type: type  # float or int
    low: float
    high: float
    help: str
    streaming: bool = False  # only the token-streaming models act on it

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")

    def check(self, value: float | int | None) -> None:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            raise FaultError(f"{self.flag} must be a number, got {value!r}")
        if self.type is int and int(value) != value:
            raise FaultError(f"{self.flag} must be a whole number, got {value:g}")
        if not self.low <= value <= self.high:
            raise FaultError(f"{self.flag} must be between {self.low:g} and {self.high:g}, got {value:g}")


# Every fault kind, in the order `fault set` takes them. The models read the same keys
# (reference_models.FAULT_KEYS, checked by a test); the CLI's flags come from this table.
KNOBS: tuple[Knob, ...] = (
    Knob("error_rate", float, 0.0, 1.0, "fraction of requests that fail, 0..1"),
    Knob(
        "extra_latency_ms",
        float,
        0.0,
        MAX_EXTRA_LATENCY_MS,
        "milliseconds added to every execution (streaming models: to the time to first token)",
    ),
    Knob(
        "ttft_ms",
        float,
        0.0,
        MAX_EXTRA_LATENCY_MS,
        "time to first token in ms, replacing the model's own",
        streaming=True,
    ),
    Knob(
        "per_token_ms",
        float,
        0.0,
        MAX_EXTRA_LATENCY_MS,
        "ms between two tokens, replacing the model's own",
        streaming=True,
    ),
    Knob(
        "error_after_tokens",
        int,
        0,
        MAX_TOKENS,
        "end every stream with an error after this many tokens",
        streaming=True,
    ),
)
KNOB_BY_FIELD = {k.field: k for k in KNOBS}


@dataclass(frozen=True, slots=True)
class Fault:
    """What is injected into one model (or one version). Streaming knobs left None keep the
    model's own pace, and no error after N tokens."""

    error_rate: float = 0.0
    extra_latency_ms: float = 0.0
    ttft_ms: float | None = None
    per_token_ms: float | None = None
    error_after_tokens: int | None = None

    def validate(self) -> Fault:
        for knob in KNOBS:
            knob.check(getattr(self, knob.field))
        return self

    @property
    def streaming(self) -> bool:
        """True when it sets a knob that only the streaming models act on."""
        return any(getattr(self, k.field) is not None for k in KNOBS if k.streaming)

    def to_json(self) -> dict[str, float | int]:
        """The fault file's content: the knobs that are set (None ones left out)."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, data: object) -> Fault:
        if not isinstance(data, dict):
            raise FaultError("a fault file must hold a JSON object")
        values = {}
        for key, value in data.items():
            knob = KNOB_BY_FIELD.get(key)
            if knob is None:
                raise FaultError(f"unknown fault kind {key!r} (known: {', '.join(KNOB_BY_FIELD)})")
            knob.check(value)
            values[key] = None if value is None else knob.type(value)
        return cls(**values)

    def describe(self) -> str:
        """One line for people: "error rate 0.3, extra latency 0 ms, error after 4 tokens"."""
        parts = [f"error rate {self.error_rate:g}", f"extra latency {self.extra_latency_ms:g} ms"]
        if self.ttft_ms is not None:
            parts.append(f"time to first token {self.ttft_ms:g} ms")
        if self.per_token_ms is not None:
            parts.append(f"{self.per_token_ms:g} ms per token")
        if self.error_after_tokens is not None:
            parts.append(f"error after {self.error_after_tokens} tokens")
        return ", ".join(parts)


def faults_dir(state_dir: str | os.PathLike | None = None) -> Path:
    return Path(state_dir if state_dir is not None else default_state_dir()) / FAULTS_SUBDIR


def _check_target(model: str, version: str | int | None) -> str | None:
    if not _NAME.match(model or ""):
        raise FaultError(f"model name {model!r} is not a Triton model name (letters, digits, _ . -)")
    if version is None or version == "":
        return None
    version = str(version)
    if not _VERSION.match(version):
        raise FaultError(f"version {version!r} must be a number")
    return version


def fault_path(
    model: str, version: str | int | None = None, state_dir: str | os.PathLike | None = None
) -> Path:
    v = _check_target(model, version)
    return faults_dir(state_dir) / (f"{model}@{v}.json" if v else f"{model}.json")


def set_fault(
    model: str,
    version: str | int | None = None,
    *,
    error_rate: float = 0.0,
    extra_latency_ms: float = 0.0,
    ttft_ms: float | None = None,
    per_token_ms: float | None = None,
    error_after_tokens: int | None = None,
    state_dir: str | os.PathLike | None = None,
) -> Path:
    """Replace the fault of ``model`` (one ``version``, or all); returns the file written.

    The streaming knobs (``ttft_ms``, ``per_token_ms``, ``error_after_tokens``) are refused for a
    reference model that answers in one response: they would silently do nothing there."""
    fault = Fault.from_json(
        {
            "error_rate": error_rate,
            "extra_latency_ms": extra_latency_ms,
            "ttft_ms": ttft_ms,
            "per_token_ms": per_token_ms,
            "error_after_tokens": error_after_tokens,
        }
    )
    path = fault_path(model, version, state_dir)
    if fault.streaming:
        from reference_server import catalog  # numpy: only when a streaming knob is asked for

        if model in catalog.MODELS:
            flags = ", ".join(k.flag for k in KNOBS if k.streaming and getattr(fault, k.field) is not None)
            raise FaultError(
                f"{flags}: only token-streaming models act on this, and {model} answers in one response "
                f"(the streaming models: {', '.join(sorted(catalog.STREAM_MODELS))})"
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(fault.to_json()) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def clear(
    model: str | None = None, version: str | int | None = None, state_dir: str | os.PathLike | None = None
) -> list[Path]:
    """Remove faults: all of them, every fault of ``model`` (model-wide and per version), or
    only ``model@version``. Returns the files removed."""
    root = faults_dir(state_dir)
    if model is None:
        if version not in (None, ""):
            raise FaultError("--version needs --model")
        paths = list(root.glob("*.json"))
    elif version not in (None, ""):
        paths = [fault_path(model, version, state_dir)]
    else:
        _check_target(model, None)
        paths = [root / f"{model}.json", *root.glob(f"{glob_escape(model)}@*.json")]
    removed = []
    for p in paths:
        try:
            p.unlink()
            removed.append(p)
        except FileNotFoundError:
            pass
    return removed


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def active(state_dir: str | os.PathLike | None = None) -> dict[str, Fault]:
    """{"model" or "model@version": Fault} for every fault file present."""
    out: dict[str, Fault] = {}
    for p in sorted(faults_dir(state_dir).glob("*.json")):
        try:
            out[p.stem] = Fault.from_json(json.loads(p.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            continue  # removed meanwhile, or not written by set_fault
    return out
