"""``inferwatch up`` and ``inferwatch demo``: the local stack and the incident demo."""

from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from inferwatch.cli import CliError

DEFAULT_SPEC = "fleet.yaml"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_SPEC = "fleet.demo.yaml"


def _add_stack_args(p: argparse.ArgumentParser, spec_default: str) -> None:
    from inferwatch.stack.config import PORT_NAMES
    from inferwatch.stack.core import default_state_dir

    p.add_argument("--spec", default=spec_default, help="the fleet spec (default: %(default)s)")
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help=f"where configs, data, logs and stack.json go (default: {default_state_dir()})",
    )
    p.add_argument(
        "--port",
        action="append",
        default=[],
        metavar="NAME=PORT",
        help=f"move one component to another port (repeatable); NAME is one of {', '.join(PORT_NAMES)}",
    )
    p.add_argument(
        "--free-ports",
        action="store_true",
        help="pick free loopback ports for every component instead of the standard ones",
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=180.0,
        metavar="S",
        help="seconds each component may take to become healthy (default: %(default)s)",
    )


def register(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser(
        "up",
        help="run the local stack (Triton, sidecar, GPU exporter, Prometheus, Alertmanager, pager)",
        description=(
            "Start the local stack in dependency order, each component waited on until healthy: "
            "Triton, the sidecar in front of it, the GPU exporter (simulated unless NVML works), the "
            "pager receiver, Alertmanager and Prometheus with the rules generated from the spec. "
            "Configs, data and logs go under the state dir. Runs in the foreground; Ctrl-C or SIGTERM "
            "stops every process it started."
        ),
    )
    _add_stack_args(up, DEFAULT_SPEC)
    up.add_argument(
        "--gpu-backend",
        choices=("auto", "nvml", "simulated"),
        default="auto",
        help="the GPU exporter's backend (default: %(default)s: NVML when it works, else simulated)",
    )
    up.set_defaults(func=_up)

    demo = sub.add_parser(
        "demo",
        help="play an incident on the local stack and show the pages arriving",
        description=(
            "Play an incident on the local stack (the running one in the state dir, or one it starts "
            "with the demo spec): steady traffic, an error burst (critical page), a latency regression "
            "in the ranker canary (warning), GPU memory pressure (info), then recovery (resolved). Shows "
            "traffic, alert states and pages live, and ends with each fault's detection delay against "
            "the theoretical minimum computed from the spec. Exits 1 if an expected page or resolved "
            "notification did not arrive in time."
        ),
    )
    _add_stack_args(demo, DEMO_SPEC)
    demo.add_argument(
        "--steady",
        type=float,
        default=None,
        metavar="S",
        help="seconds of fault-free traffic before the first fault (default: long enough for every "
        "rule to have fired from a cold start: the longest rule time + evaluation + group wait)",
    )
    demo.add_argument(
        "--rate", type=float, default=20.0, metavar="RPS", help="steady request rate (default: %(default)s)"
    )
    demo.add_argument(
        "--keep-running",
        action="store_true",
        help="leave a stack the demo started running afterwards (stop it with Ctrl-C)",
    )
    demo.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results as JSON")
    demo.set_defaults(func=_demo)


@contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """An event set by SIGINT, SIGTERM or SIGHUP (restored afterwards)."""
    event = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        from inferwatch.stack.log import log

        log("info", "signal received; stopping", signal=signal.Signals(signum).name)
        event.set()

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield event
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def stack_config(args: argparse.Namespace):  # -> StackConfig
    from inferwatch.stack.core import StackConfig, default_state_dir, free_ports, parse_port_overrides

    try:
        overrides = parse_port_overrides(args.port)
    except ValueError as exc:
        raise CliError(str(exc), code=2) from None
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
    return config


def setup_logging(state_dir: Path) -> None:
    """On a terminal the rich view is for the person: structured lines go to the stack's log
    file (warnings and errors still reach stderr). Elsewhere (CI) every line goes to stderr."""
    from inferwatch.stack.log import configure
    from inferwatch.stack.view import console

    if console.is_terminal:
        configure(quiet=True, file=state_dir / "logs" / "inferwatch.log")


def _up(args: argparse.Namespace) -> int:
    from inferwatch.stack.core import Stack, StackError
    from inferwatch.stack.log import log
    from inferwatch.stack.supervisor import StartError, log_tail
    from inferwatch.stack.view import print_summary, start_progress

    config = stack_config(args)
    setup_logging(config.state_dir)
    with stop_on_signals() as stop:
        stack = Stack(config, stop)
        try:
            stack.preflight()
        except StackError as exc:
            raise CliError(str(exc)) from None
        try:
            with start_progress() as progress:
                stack.start(progress)
        except StartError as exc:
            if stop.is_set():
                return 130
            raise CliError(str(exc)) from None
        except StackError as exc:
            raise CliError(str(exc)) from None
        code = 0
        try:  # whatever happens from here (even a closed stdout), the stack is stopped
            print_summary(stack)
            while not stop.wait(1.0):
                dead = stack.check()
                if dead is not None:
                    log(
                        "error",
                        "component exited; stopping the stack",
                        component=dead.component.name,
                        code=dead.proc.returncode,
                        log=str(dead.component.log_path),
                        tail=log_tail(dead.component.log_path, 3),
                    )
                    code = 1
                    break
        finally:
            stop_stack(stack)
        return code


def stop_stack(stack) -> None:  # stack: inferwatch.stack.core.Stack
    """Stop every component; a process that survived is an error naming its pid."""
    from inferwatch.stack.log import log
    from inferwatch.stack.view import stopped_message

    try:
        stopped_message(stack, stopping=True)
    except OSError:  # the terminal is gone (SIGHUP); stopping matters more than saying so
        pass
    survivors = stack.stop()
    if survivors:
        raise CliError(f"processes survived the stop: {' '.join(str(p[0]) for p in survivors)}")
    log("info", "stack stopped; no process left", state_dir=str(stack.config.state_dir))
    try:
        stopped_message(stack, stopping=False)
    except OSError:
        pass


def _demo(args: argparse.Namespace) -> int:
    from inferwatch.demo import main as demo_main

    return demo_main(args)
