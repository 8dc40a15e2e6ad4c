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
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_VERSION = re.compile(r"^[0-9]+$")

# What clients see for an injected error (checked by tests/test_reference_faults.py).
HTTP_STATUS = 500
GRPC_CODE = "INTERNAL"


class FaultError(ValueError):
    """Bad fault settings; the message is one line for the user."""


@dataclass(frozen=True, slots=True)
class Fault:
    error_rate: float = 0.0
    extra_latency_ms: float = 0.0

    def validate(self) -> Fault:
        if not 0.0 <= self.error_rate <= 1.0:
            raise FaultError(f"error rate must be between 0 and 1, got {self.error_rate:g}")
        if not 0.0 <= self.extra_latency_ms <= MAX_EXTRA_LATENCY_MS:
            raise FaultError(
                f"extra latency must be between 0 and {MAX_EXTRA_LATENCY_MS:g} ms, "
                f"got {self.extra_latency_ms:g}"
            )
        return self


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
    state_dir: str | os.PathLike | None = None,
) -> Path:
    """Replace the fault of ``model`` (one ``version``, or all); returns the file written."""
    fault = Fault(float(error_rate), float(extra_latency_ms)).validate()
    path = fault_path(model, version, state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(fault)) + "\n", encoding="utf-8")
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
            data = json.loads(p.read_text(encoding="utf-8"))
            out[p.stem] = Fault(float(data.get("error_rate", 0)), float(data.get("extra_latency_ms", 0)))
        except (OSError, ValueError, AttributeError):
            continue
    return out
