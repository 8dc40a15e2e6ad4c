"""Where inferwatch keeps state (fault settings, logs, databases) on this machine, and where
it looks for the fleet spec."""

from __future__ import annotations

import os
from pathlib import Path

STATE_DIR_ENV = "INFERWATCH_STATE_DIR"
# The fleet spec a command reads when it is given none, in the working directory. Here rather
# than in inferwatch.spec so that a CLI can name it in --help without importing pydantic.
DEFAULT_SPEC = "fleet.yaml"


def state_dir() -> Path:
    """``$INFERWATCH_STATE_DIR``, else ``~/.local/state/inferwatch``; not created here."""
    env = os.environ.get(STATE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "inferwatch"
