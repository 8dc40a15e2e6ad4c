"""Structured log lines (logfmt) for the stack and the demo.

By default every line goes to stderr (what CI keeps). On a terminal, where the rich view
is what a person reads, ``configure(quiet=True, file=...)`` keeps only warnings and errors
on stderr and writes every line to the stack's log file instead.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import TextIO

_lock = threading.Lock()
_stream: TextIO | None = None
_quiet = False
_file: TextIO | None = None
_file_path: Path | None = None


def configure(stream: TextIO | None = None, quiet: bool = False, file: Path | None = None) -> None:
    """Send log lines to ``stream`` (default stderr), only warnings and errors when ``quiet``,
    and every line to ``file`` when given."""
    global _stream, _quiet, _file, _file_path
    with _lock:
        if _file is not None:
            _file.close()
        _stream, _quiet, _file, _file_path = stream, quiet, None, file


def _value(value: object) -> str:
    text = str(value)
    if not text or any(c in text for c in ' "=') or "\n" in text:
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


def log(level: str, msg: str, **fields: object) -> None:
    global _file
    to_stream = not (_quiet and level in ("debug", "info"))
    if not to_stream and _file_path is None:
        return
    ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    parts = [f"ts={ts}Z", f"level={level}", f"msg={_value(msg)}"]
    parts += [f"{k}={_value(v)}" for k, v in fields.items()]
    line = " ".join(parts)
    with _lock:
        if to_stream:
            try:
                print(line, file=_stream or sys.stderr, flush=True)
            except (OSError, ValueError):  # the terminal went away (SIGHUP): keep stopping cleanly
                pass
        if _file_path is not None:
            if _file is None:  # opened on the first line, so a refused start creates nothing
                _file_path.parent.mkdir(parents=True, exist_ok=True)
                _file = open(_file_path, "a", encoding="utf-8")
            _file.write(line + "\n")
            _file.flush()
