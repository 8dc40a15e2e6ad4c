"""``inferwatch canary``: judge a canary version against its baseline, for people and for
deploy pipelines.

Exit codes: 0 pass, 1 fail (roll the canary back), 2 inconclusive (too little traffic:
wait and ask again), 3 error (bad arguments or spec, Prometheus unreachable).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys

from inferwatch.paths import DEFAULT_SPEC

EXIT_ERROR = 3  # inferwatch.canary.EXIT_ERROR, without importing the analysis for --help
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")

EPILOG = """\
exit codes:
  0  pass: the canary is not worse than the baseline beyond the spec's margins
  1  fail: it is worse (server errors or latency), significantly and beyond a margin: roll back
  2  inconclusive: a version took fewer than canary.min_requests requests in the window
  3  error: bad arguments or spec, or Prometheus cannot answer

The margins, the minimum traffic, the confidence and the default window are the fleet
spec's `canary:` section. With --templates DIR, write the Argo Rollouts AnalysisTemplate and
the Flagger MetricTemplates for the spec instead (deploy/kubernetes/components/canary).
"""


class _Parser(argparse.ArgumentParser):
    """Bad arguments exit 3, not argparse's 2, which here means 'inconclusive'."""

    def error(self, message: str):  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message}\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return ns, []


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "canary",
        help="judge a canary version against its baseline: pass, fail or inconclusive",
        description="Compare a canary version of a model with its baseline over one window, from "
        "the sidecar's metrics in Prometheus: server-error ratio (two-proportion test), latency "
        "P50/P99 and a rank test over the histogram buckets, and TTFT/TPOT for LLM models.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.__class__ = _Parser  # add_parser builds the subparsers' class; this one exits 3 on errors
    p.add_argument("--prometheus", metavar="URL", help="Prometheus base URL, e.g. http://127.0.0.1:9090")
    p.add_argument("--model", help="the model name")
    p.add_argument("--baseline", metavar="V1", help="the version the canary replaces")
    p.add_argument("--canary", metavar="V2", help="the new version")
    p.add_argument("--window", help="how far back to compare, e.g. 10m (default: the spec's canary.window)")
    p.add_argument(
        "--at", type=float, metavar="UNIX_TIME", help="judge the window ending then (default: now)"
    )
    p.add_argument("--spec", help=f"the fleet spec (default: {DEFAULT_SPEC} if present, else the defaults)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--templates", metavar="DIR", help="write the Argo Rollouts and Flagger templates and exit"
    )
    p.set_defaults(func=_canary)


def _fail(message: str) -> int:
    print(f"inferwatch canary: error: {message}", file=sys.stderr)
    return EXIT_ERROR


def _canary(args: argparse.Namespace) -> int:
    from inferwatch.spec import SpecError, duration_seconds, load_spec_for_cli

    try:
        spec = load_spec_for_cli(args.spec, if_none="default-if-present")
    except SpecError as exc:
        return _fail(str(exc))
    if args.templates:
        from inferwatch.canary import templates

        for path in templates.write(spec, args.templates):
            print(path)
        return 0
    missing = [f"--{n}" for n in ("prometheus", "model", "baseline", "canary") if not getattr(args, n)]
    if missing:
        return _fail(f"missing {', '.join(missing)}")
    for name in ("model", "baseline", "canary"):
        if not _LABEL_VALUE.match(getattr(args, name)):
            return _fail(f"--{name} {getattr(args, name)!r}: use letters, digits, '_', '.', '-'")
    if args.window is not None:
        try:
            duration_seconds(args.window)
        except ValueError as exc:
            return _fail(f"--window: {exc}")
    if not re.match(r"^https?://", args.prometheus):
        return _fail(f"--prometheus {args.prometheus!r}: expected a URL such as http://127.0.0.1:9090")

    from inferwatch.canary.analysis import CanaryError, judge

    try:
        report = judge(
            args.prometheus, args.model, args.baseline, args.canary, spec, window=args.window, at=args.at
        )
    except CanaryError as exc:
        return _fail(str(exc))
    if args.json:
        print(json.dumps(_finite(report.to_dict()), indent=2, sort_keys=True, allow_nan=False))
    else:
        print_report(report)
    return report.exit_code


def _finite(obj):
    """NaN and infinities as null: JSON has no spelling for them."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


_STYLE = {"pass": "green", "fail": "bold red", "inconclusive": "yellow", "skipped": "dim"}


def print_report(report, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(
        title=f"canary {report.model}: v{report.canary} against v{report.baseline}, last {report.window}",
        title_justify="left",
    )
    for col in ("check", "baseline", "canary", "limit", "p-value", "verdict", "why"):
        table.add_column(col, overflow="fold")
    for ch in report.checks:
        p = "-" if ch.p_value is None else f"{ch.p_value:.2g}"
        style = _STYLE.get(ch.verdict, "")
        table.add_row(ch.name, ch.baseline, ch.canary, ch.limit, p, f"[{style}]{ch.verdict}[/]", ch.reason)
    console.print(table)
    style = _STYLE[report.verdict]
    console.print(f"verdict: [{style}]{report.verdict}[/] (exit {report.exit_code})")
