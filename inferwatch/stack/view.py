"""What a person sees while the stack starts and once it is up (rich on a terminal,
plain lines elsewhere)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.table import Table

console = Console()
if not console.is_terminal:  # CI logs: no wrapping of paths and URLs
    console = Console(width=200)


@contextmanager
def start_progress() -> Iterator[Callable[[str, str, float], None]]:
    """A progress callback for ``Stack.start``: a spinner on a terminal, a line per
    component elsewhere (the structured log already says when each is ready)."""
    if not console.is_terminal:
        yield lambda name, state, seconds: None
        return
    with console.status("starting the stack") as status:

        def update(name: str, state: str, seconds: float) -> None:
            if state == "ready":
                console.print(f"  [green]✓[/] {name} ready in {seconds:.1f}s")
            else:
                status.update(f"starting {name} ({seconds:.0f}s)")

        yield update


def print_summary(stack) -> None:  # stack: inferwatch.stack.core.Stack
    info = stack.info
    table = Table(title="inferwatch local stack: ready", title_justify="left")
    table.add_column("component")
    table.add_column("address", no_wrap=True)
    table.add_column("pid", justify="right")
    table.add_column("log", no_wrap=True)
    for name, url, pid, log_path in stack.components_table():
        table.add_row(name, url, str(pid), str(log_path))
    console.print(table)
    state = info.state_dir
    console.print(f"spec {info.spec_path}; state, configs and data under {state}")
    console.print(
        f"send traffic:   inferwatch load --url {info.sidecar_http} --protocol http --rate 20 --duration 60 "
        "--model ranker:1 --model ranker:2"
    )
    if info.llm:
        console.print(
            f"LLM streams:    inferwatch load --url {info.url('llm_sidecar_http')} --protocol openai "
            "--rate 1 --duration 60 --model tiny-llm --model tiny-llm-canary"
        )
    console.print(f"inject a fault: inferwatch fault set --state-dir {state} --model ranker --error-rate 0.5")
    console.print(f"see the pages:  {info.pager_url}/   alerts: {info.prometheus_url}/alerts")
    console.print("stop: Ctrl-C (or SIGTERM to this process) stops every component")


def stopped_message(stack, stopping: bool) -> None:  # stack: inferwatch.stack.core.Stack
    """One line for the person on a terminal (CI has the structured log lines)."""
    if not console.is_terminal:
        return
    if stopping:
        console.print("stopping the stack ...")
    else:
        console.print(
            f"[green]stack stopped[/], no process left; logs under {stack.config.state_dir / 'logs'}"
        )
