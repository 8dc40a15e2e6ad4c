"""Structured log lines (logfmt) for the stack and the demo, on stderr, so stdout stays
for what a person reads (the summary, the live view, the final table)."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

_lock = threading.Lock()
_stream: TextIO | None = None
_quiet = False


def configure(stream: TextIO | None = None, quiet: bool = False) -> None:
    """Send log lines to ``stream`` (default stderr); ``quiet`` keeps only warnings and errors."""
    global _stream, _quiet
    _stream = stream
    _quiet = quiet


def _value(value: object) -> str:
    text = str(value)
    if not text or any(c in text for c in ' "=') or "\n" in text:
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


def log(level: str, msg: str, **fields: object) -> None:
    if _quiet and level in ("debug", "info"):
        return
    ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    parts = [f"ts={ts}Z", f"level={level}", f"msg={_value(msg)}"]
    parts += [f"{k}={_value(v)}" for k, v in fields.items()]
    stream = _stream or sys.stderr
    with _lock:
        print(" ".join(parts), file=stream, flush=True)
