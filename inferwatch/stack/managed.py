"""The process shell that ``inferwatch up`` and ``inferwatch demo`` share: the stack's
config from the command line, signals, logging, and the managed stack itself (found
running, or started here and stopped again, the stop verified)."""

from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from inferwatch import logs
from inferwatch.cli import CliError
from inferwatch.stack.core import Stack, StackConfig, StackError, StackInfo, running_stack
from inferwatch.stack.supervisor import GaveUp, StartError

log = logs.get("inferwatch.stack")

REPO_ROOT = Path(__file__).resolve().parents[2]


def stack_config(args: argparse.Namespace) -> StackConfig:
    """The StackConfig of ``up``'s and ``demo``'s shared options (stack.cli.add_stack_args)."""
    from inferwatch.stack.core import default_state_dir, free_ports, parse_port_overrides

    try:
        overrides = parse_port_overrides(args.port)
    except ValueError as exc:
        raise CliError(str(exc), code=2) from None
    if args.ready_timeout <= 0:
        raise CliError("--ready-timeout must be above 0 seconds", code=2)
    spec = Path(args.spec)
    if not spec.exists() and spec.name == args.spec and (REPO_ROOT / spec).is_file():
        spec = REPO_ROOT / spec  # the default spec, run from outside the checkout
    config = StackConfig(
        spec_path=spec,
        state_dir=(args.state_dir or default_state_dir()).expanduser().resolve(),
        ready_timeout=args.ready_timeout,
    )
    if args.free_ports:
        config.ports = free_ports(config.host)
    config.ports.update(overrides)
    if getattr(args, "gpu_backend", None):
        config.gpu_backend = args.gpu_backend
    config.llm = bool(getattr(args, "llm", False))
    config.kv_cache_gib = getattr(args, "kv_cache_gib", None)
    if config.kv_cache_gib is not None and config.kv_cache_gib < 1:
        raise CliError("--kv-cache-gib must be 1 or more (vLLM's CPU build counts whole GiB)", code=2)
    return config


def setup_logging(state_dir: Path) -> None:
    """Every line goes to ``logs/inferwatch.log`` as JSON, beside the components' logs. On
    stderr the lines are logfmt, for a person: all of them in CI, only warnings and errors
    on a terminal, where the rich view is what a person reads (inferwatch/logs.py says why)."""
    from inferwatch.stack.view import console

    logs.setup(
        "info",
        "inferwatch",
        "logfmt",
        stream_level="warning" if console.is_terminal else None,
        file=state_dir / "logs" / "inferwatch.log",
    )


@contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """An event set by SIGINT, SIGTERM or SIGHUP (restored afterwards)."""
    event = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        log.info("signal received; stopping", signal=signal.Signals(signum).name)
        event.set()

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield event
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextmanager
def managed_stack(
    config: StackConfig, stop: threading.Event, *, reuse_running: bool = False
) -> Iterator[tuple[StackInfo, Stack | None]]:
    """The stack a command works on, with the Stack when this command started it (None when
    ``reuse_running`` found one running from the state dir). A stack started here is stopped
    on the way out, whatever happened; a start interrupted by a signal ends as Ctrl-C does."""
    from inferwatch.stack.view import start_progress

    info = running_stack(config.state_dir) if reuse_running else None
    if info is not None:
        log.info("using the running stack", state_dir=str(info.state_dir), spec=str(info.spec_path))
        yield info, None
        return
    stack = Stack(config, stop)
    try:
        stack.preflight()
        with start_progress() as progress:
            info = stack.start(progress)
    except StartError as exc:
        if stop.is_set():
            raise KeyboardInterrupt from None
        raise CliError(str(exc)) from None
    except StackError as exc:
        raise CliError(str(exc)) from None
    try:
        yield info, stack
    finally:
        stop_stack(stack)


def supervised(stack: Stack) -> None:
    """One round of the stack's supervision; a component that keeps failing is a CliError
    (the managed stack then stops everything on the way out)."""
    try:
        stack.supervise()
    except GaveUp as exc:
        raise CliError(str(exc)) from None


def stop_stack(stack: Stack) -> None:
    """Stop every component; a process that survived is an error naming its pid."""
    from inferwatch.stack.view import stopped_message

    try:
        stopped_message(stack, stopping=True)
    except OSError:  # the terminal is gone (SIGHUP); stopping matters more than saying so
        pass
    survivors = stack.stop()
    if survivors:
        raise CliError(f"processes survived the stop: {' '.join(str(p[0]) for p in survivors)}")
    log.info("stack stopped; no process left", state_dir=str(stack.config.state_dir))
    try:
        stopped_message(stack, stopping=False)
    except OSError:
        pass
