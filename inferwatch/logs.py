"""Structured log lines for every long-running component: one JSON object per line on stderr.

Fields travel as ``log.info("msg", extra={"fields": {...}})`` and become keys of the line.
"""

from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    """ts, level, logger, msg, then the record's ``fields`` (and ``exc`` when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(level: str = "info", logger: str = "inferwatch") -> None:
    """Send ``logger`` (the root logger for ``""``) to stderr as JSON lines, and only there."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    target = logging.getLogger(logger)
    target.handlers[:] = [handler]
    target.setLevel(level.upper())
    if logger:
        target.propagate = False
