"""Where inferwatch keeps state (fault settings, logs, databases) on this machine."""

from __future__ import annotations

import os
from pathlib import Path

STATE_DIR_ENV = "INFERWATCH_STATE_DIR"


def state_dir() -> Path:
    """``$INFERWATCH_STATE_DIR``, else ``~/.local/state/inferwatch``; not created here."""
    env = os.environ.get(STATE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "inferwatch"
