"""Structured log lines for every inferwatch process: one module, two formats, UTC everywhere.

Which format where:

- **JSON** for every service (the sidecar, the GPU exporter, the pager, the Triton launcher)
  and for the stack's own log file: these lines are read by machines (a log shipper, ``jq``,
  a test), and one format lets one query read every component's file.
- **logfmt** for what ``inferwatch up`` and ``inferwatch demo`` print on stderr: a person
  reads those lines in a terminal or a CI log, where ``key=value`` reads better than JSON.

Both carry the same keys: ``ts`` (UTC, milliseconds, ``Z``), ``level``, ``logger``, ``msg``,
then the record's fields (and ``exc`` when there is an exception). Fields travel as
``log.info("msg", extra={"fields": {...}})``, or as keywords through ``get(name)``:
``log.info("ready", component="sidecar")``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO


def _utc(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


def _items(formatter: logging.Formatter, record: logging.LogRecord) -> dict[str, object]:
    out: dict[str, object] = {
        "ts": _utc(record),
        "level": record.levelname.lower(),
        "logger": record.name,
        "msg": record.getMessage(),
    }
    fields = getattr(record, "fields", None)
    if fields:
        out.update(fields)
    if record.exc_info:
        out["exc"] = formatter.formatException(record.exc_info)
    return out


class JsonFormatter(logging.Formatter):
    """ts, level, logger, msg, then the record's ``fields`` (and ``exc`` when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_items(self, record), default=str)


def _logfmt_value(value: object) -> str:
    text = str(value)
    if not text or any(c in text for c in ' "=\n\\'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


class LogfmtFormatter(logging.Formatter):
    """The same keys as JsonFormatter, as ``key=value`` pairs (values quoted when needed)."""

    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={_logfmt_value(v)}" for k, v in _items(self, record).items())


FORMATTERS: dict[str, type[logging.Formatter]] = {"json": JsonFormatter, "logfmt": LogfmtFormatter}


class _FileHandler(logging.FileHandler):
    """Opened (and its folder made) on the first line, so a refused start leaves no file."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, encoding="utf-8", delay=True)

    def _open(self) -> TextIO:
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()


def setup(
    level: str = "info",
    logger: str = "inferwatch",
    fmt: str = "json",
    *,
    stream: TextIO | None = None,
    stream_level: str | None = None,
    file: Path | None = None,
) -> logging.Logger:
    """Send ``logger`` (the root logger for ``""``) to ``stream`` (default stderr) in ``fmt``,
    and only there; with ``file``, every line also goes to that file as JSON. ``stream_level``
    raises the bar for the stream alone (a terminal that shows a live view instead)."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(FORMATTERS[fmt]())
    if stream_level:
        handler.setLevel(stream_level.upper())
    target = logging.getLogger(logger)
    for old in target.handlers:
        old.close()
    target.handlers[:] = [handler]
    if file is not None:
        to_file = _FileHandler(file)
        to_file.setFormatter(JsonFormatter())
        target.addHandler(to_file)
    target.setLevel(level.upper())
    if logger:
        target.propagate = False
    return target


_LOGGING_KWARGS = frozenset({"exc_info", "stack_info", "stacklevel", "extra"})


class FieldLogger(logging.LoggerAdapter):
    """A logger whose keyword arguments become the line's fields. The fields are gathered
    only when the level is on (LoggerAdapter calls ``process`` after its level check)."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        fields = {k: kwargs.pop(k) for k in list(kwargs) if k not in _LOGGING_KWARGS}
        if fields:
            extra: Mapping[str, object] = kwargs.get("extra") or {}
            kwargs["extra"] = {**extra, "fields": {**extra.get("fields", {}), **fields}}  # type: ignore[dict-item]
        return msg, kwargs


def get(name: str) -> FieldLogger:
    return FieldLogger(logging.getLogger(name), {})
