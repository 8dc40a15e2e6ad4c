"""The demo's screen: a rich Live view on a terminal, plain timestamped lines elsewhere
(CI logs), and the final table either way."""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from inferwatch import contract
from inferwatch.stack.demo import RESULT_COLUMNS, results_table_rows

STATE_STYLE = {"firing": "bold red", "pending": "yellow", "inactive": "dim", "resolved": "green"}
SEVERITY_STYLE = {
    contract.SEVERITY_CRITICAL: "bold red",
    contract.SEVERITY_WARNING: "yellow",
    contract.SEVERITY_INFO: "cyan",
}


def _console() -> Console:
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    return console


class LineReporter:
    """One line per event, and the traffic every 10 seconds: readable in a CI log."""

    def __init__(self, demo, console: Console) -> None:  # demo: inferwatch.stack.demo.Demo
        self.demo = demo
        self.console = console
        self._last_traffic = 0.0

    def _t(self) -> str:
        return f"[t+{time.time() - self.demo.result.started_at:6.1f}s]"

    def _print(self, text: str) -> None:
        self.console.print(f"{self._t()} {text}", markup=False, highlight=False, soft_wrap=True)

    def phase(self, name: str, text: str) -> None:
        self._print(f"== {name}: {text}")

    def event(self, text: str) -> None:
        self._print(text)

    def tick(self) -> None:
        now = time.time()
        if now - self._last_traffic < 10:
            return
        self._last_traffic = now
        _alerts, rates = self.demo.observer.snapshot()
        if rates:
            parts = [
                f"{m}:{v} {r:.1f}/s" + (f" ({e:.1f} err/s)" if e else "") for (m, v), (r, e) in rates.items()
            ]
            self._print("traffic " + ", ".join(parts))

    def close(self) -> None:
        pass


class LiveReporter:
    """Traffic, alert states, pages and events, redrawn twice a second."""

    def __init__(self, demo, console: Console) -> None:
        self.demo = demo
        self.console = console
        self.events: collections.deque[str] = collections.deque(maxlen=8)
        self.phase_text = ""
        self.live = Live(console=console, refresh_per_second=2, get_renderable=self.render, transient=False)

    def __enter__(self) -> LiveReporter:
        self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.stop()

    def phase(self, name: str, text: str) -> None:
        self.phase_text = text
        self._add(f"[bold]{name}[/]: {escape(text)}")

    def event(self, text: str) -> None:
        self._add(escape(text))

    def _add(self, markup: str) -> None:
        self.events.append(f"t+{time.time() - self.demo.result.started_at:5.1f}s  {markup}")

    def tick(self) -> None:
        pass

    def close(self) -> None:
        self.live.stop()

    def render(self) -> Group:
        demo = self.demo
        now = time.time()
        alerts, rates = demo.observer.snapshot()
        head = Text.assemble(
            ("inferwatch demo  ", "bold"),
            (f"phase {demo.phase}", "bold cyan"),
            f"  t+{now - demo.result.started_at:.0f}s (phase t+{now - demo.phase_started:.0f}s)  ",
            (self.phase_text, "dim"),
        )

        traffic = Table(title="traffic through the sidecar", title_justify="left", expand=True)
        for col in ("model", "version", "req/s", "server errors/s"):
            traffic.add_column(col, justify="right" if "/s" in col else "left")
        for (model, version), (rate, errors) in rates.items():
            traffic.add_row(
                model, version, f"{rate:.1f}", Text(f"{errors:.1f}", style="red" if errors else "")
            )

        alert_table = Table(title="alerts (Prometheus)", title_justify="left", expand=True)
        for col in ("alert", "labels", "state", "active for"):
            alert_table.add_column(col)
        for a in sorted(alerts.values(), key=lambda a: (a.alertname, a.ident())):
            since = f"{now - a.active_at:.0f}s" if a.active_at else ""
            alert_table.add_row(
                a.alertname, a.ident(), Text(a.state, style=STATE_STYLE.get(a.state, "")), since
            )
        if not alerts:
            alert_table.add_row("(none)", "", "", "")

        pages = Table(title="pages received (inferwatch pager)", title_justify="left", expand=True)
        for col in ("paged", "resolved", "severity", "alert", "labels"):
            pages.add_column(col)
        t0 = demo.result.started_at
        for p in demo.result.pages[-8:]:
            pages.add_row(
                Text(
                    f"t+{p.received_at - t0:.1f}s",
                    style=STATE_STYLE["firing"] if p.resolved_at is None else "",
                ),
                Text(f"t+{p.resolved_at - t0:.1f}s", style=STATE_STYLE["resolved"]) if p.resolved_at else "",
                Text(p.severity, style=SEVERITY_STYLE.get(p.severity, "")),
                p.alertname,
                p.ident(),
            )
        if not demo.result.pages:
            pages.add_row("", "(none yet)", "", "", "")

        faults = Table(title="faults", title_justify="left", expand=True)
        for col in ("fault", "expects", "injected", "page after", "min"):
            faults.add_column(col)
        for f in demo.faults:
            injected = f"t+{f.injected_at - demo.result.started_at:.0f}s" if f.injected_at else "-"
            if f.delay_s is not None:
                page = f"{f.delay_s:.1f}s"
            elif f.injected_at:
                page = f"waiting {now - f.injected_at:.0f}s"
            else:
                page = f.skipped or "-"
            faults.add_row(
                Text(f.title), Text(f"{f.alertname} [{f.severity}]"), injected, page, f"{f.minimum_s:g}s"
            )

        events = Panel("\n".join(self.events) or "", title="events", title_align="left")
        return Group(head, traffic, faults, alert_table, pages, events)


@contextmanager
def make_reporter(demo) -> Iterator[LineReporter | LiveReporter]:
    console = _console()
    if console.is_terminal:
        with LiveReporter(demo, console) as reporter:
            yield reporter
    else:
        yield LineReporter(demo, console)


def print_results(result) -> None:  # result: inferwatch.stack.demo.DemoResult
    console = _console()
    table = Table(title="fault → page: detection delay against the theoretical minimum", title_justify="left")
    for col in RESULT_COLUMNS:
        table.add_column(col, justify="left" if col in ("fault", "page") else "right")
    for row in results_table_rows(result):
        table.add_row(*(Text(cell) for cell in row))  # "[critical]" is text, not markup
    console.print(table)
    console.print(
        "theoretical min = the rule's condition time (N-1 whole error windows and two scrapes of the "
        "first, or the rule's 'for') + one evaluation interval + the route's group_wait, all from the "
        "spec; the error burst starts one scrape short of a whole window before a window ends; a delay "
        "can undercut the minimum by up to one evaluation interval when an evaluation follows at once",
        highlight=False,
    )
    for v in result.canary:
        style = {"pass": "green", "fail": "red"}.get(v.verdict, "yellow")
        console.print(
            f"canary {escape(v.model)} v{escape(v.canary)} against v{escape(v.baseline)}, {v.when} "
            f"(inferwatch canary, last {v.window}): [{style}]{v.verdict}[/] — {escape(v.why)}",
            highlight=False,
        )
    if result.steady_pages:
        console.print(f"[red]pages during the steady phase: {len(result.steady_pages)}[/]")
        for p in result.steady_pages:
            console.print(f"  {p.status} {p.describe()}", markup=False)
    if result.unexpected_pages:
        console.print(f"[yellow]pages no fault explains: {len(result.unexpected_pages)}[/]")
        for p in result.unexpected_pages:
            console.print(f"  {p.status} {p.describe()}", markup=False)
    for problem in result.problems():
        console.print(f"[red]✗ {problem}[/]")
    if result.ok:
        console.print(
            "[green]✓ every fault paged and resolved[/] "
            f"(demo took {result.ended_at - result.started_at:.0f}s)"
        )
