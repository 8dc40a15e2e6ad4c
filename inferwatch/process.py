"""Starting child processes that end with the process that started them, and the start,
readiness wait and stop shared by the servers that inferwatch runs as children."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Self

import httpx


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


def last_line(text: str, limit: int = 300) -> str:
    """The last non-blank line of a log, cut to ``limit`` characters: the usual last words."""
    last = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "no output")
    return last[:limit]


class StartError(Exception):
    """A one-line, actionable reason why a managed process did not start or get ready."""


class ManagedProcess:
    """A server run as a child: started in a process group of its own under
    :func:`die_with_parent`, its output sent to a log file (or discarded), waited on until a
    readiness URL answers 200 while the process is watched, and stopped with SIGTERM, SIGKILL
    after a timeout, then SIGKILL to whatever is left of its group. Use as a context manager.

    A subclass supplies :meth:`prepare` (its checks, argv and environment) and
    :attr:`ready_url`, and may reword :meth:`exit_reason` and :meth:`timeout_reason`.
    """

    name = "process"  # in messages
    error: type[Exception] = StartError  # what start() raises; a subclass's callers may catch their own
    ready_poll = 0.5  # seconds between readiness probes
    stop_timeout = 30.0  # seconds from SIGTERM to SIGKILL

    def __init__(self, *, log_path: Path | None, ready_timeout: float) -> None:
        self.log_path = log_path
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen | None = None

    def prepare(self) -> tuple[list[str], dict[str, str]]:
        """Check what the start needs (raising :attr:`error`); the command and its environment."""
        raise NotImplementedError

    @property
    def ready_url(self) -> str:
        raise NotImplementedError

    def start(self) -> Self:
        cmd, env = self.prepare()
        out: int | BinaryIO = subprocess.DEVNULL
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(self.log_path, "wb")  # closed below, once the child holds it
        try:
            self.proc = subprocess.Popen(
                die_with_parent(cmd),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                # Its own group: Ctrl-C in a terminal reaches only us, and we stop it in order;
                # the helpers it spawns share the group, so stop() ends them too.
                start_new_session=True,
            )
        finally:
            if not isinstance(out, int):
                out.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.ready_timeout
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                # Watch the process too: one that died will never answer.
                if self.proc.poll() is not None:
                    raise self.error(self.exit_reason(self.proc.returncode))
                try:
                    if client.get(self.ready_url).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(self.ready_poll)
        raise self.error(self.timeout_reason())

    def log_text(self) -> str:
        """The log so far; empty when there is none."""
        if self.log_path is None:
            return ""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def last_words(self) -> str:
        """The log's last line, and where the log is."""
        if self.log_path is None:
            return "no log (pass a log file)"
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return f"no log at {self.log_path}"
        return f"{last_line(text)} (log: {self.log_path})"

    def exit_reason(self, code: int) -> str:
        return f"{self.name} exited with code {code} before ready: {self.last_words()}"

    def timeout_reason(self) -> str:
        return f"{self.name} was not ready after {self.ready_timeout:g}s: {self.last_words()}"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self) -> int:
        """Block until the process exits; its exit code."""
        assert self.proc is not None
        return self.proc.wait()

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM, SIGKILL after ``timeout`` (default :attr:`stop_timeout`), then SIGKILL to
        whatever is left of the process group (helpers orphaned by an abrupt death); the exit
        code, or None if it was never started."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(self.stop_timeout if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return proc.returncode

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
