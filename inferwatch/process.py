"""Starting child processes that end with the process that started them."""

from __future__ import annotations

import shutil
import sys


def die_with_parent(cmd: list[str]) -> list[str]:
    """``cmd`` wrapped so the kernel sends it SIGTERM when the thread that started it dies
    (PR_SET_PDEATHSIG, kept across exec): a parent killed without stopping its children
    (SIGKILL, a crash) leaves no server behind.

    The signal is set by util-linux's ``setpriv`` (2.33+; util-linux is Essential on Debian
    and Ubuntu), which then execs ``cmd``, rather than by a ``preexec_fn``: a ``preexec_fn``
    makes ``subprocess`` fork this Python process (running gRPC's fork handlers) instead of
    vforking it, and a fork while gRPC threads were busy crashed the child at random. Without
    ``setpriv`` the command runs unwrapped, and only an orderly stop ends it.

    The parent is the starting *thread*: start long-lived children from a thread that lives
    as long as they should (the main thread), not from a short-lived worker.
    """
    setpriv = shutil.which("setpriv") if sys.platform == "linux" else None
    return [setpriv, "--pdeathsig", "TERM", "--", *cmd] if setpriv else cmd
