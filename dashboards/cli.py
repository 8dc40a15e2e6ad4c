"""``inferwatch dashboards build|snapshot``."""

from __future__ import annotations

import argparse
from pathlib import Path

from inferwatch.cli import CliError
from inferwatch.paths import DEFAULT_SPEC


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "dashboards",
        help="build the Grafana dashboards, or render them from live data to PNG",
        description="Grafana dashboards generated from the fleet spec (Fleet overview, Model detail, GPU).",
    )
    dsub = parser.add_subparsers(dest="dashboards_command", metavar="SUBCOMMAND", required=True)

    build = dsub.add_parser(
        "build",
        help="write dashboards/generated/*.json from the fleet spec",
        description=(
            "Generate the Grafana dashboard JSON from the fleet spec (thresholds, SLAs, windows). "
            "The files import through Grafana's UI and load through file provisioning."
        ),
    )
    build.add_argument("--spec", default=DEFAULT_SPEC, help="fleet spec (default: %(default)s)")
    build.add_argument("--out", type=Path, default=None, help="output folder (default: dashboards/generated)")
    build.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if the files in --out are missing or stale against the spec",
    )
    build.set_defaults(func=_build)

    snap = dsub.add_parser(
        "snapshot",
        help="render every panel from a live Prometheus to PNG files and an index.html",
        description=(
            "Run every panel's queries against a Prometheus over a time range and draw them with "
            "matplotlib (titles, units, legends, threshold lines): the dashboards where no Grafana runs."
        ),
    )
    snap.add_argument(
        "--prometheus", required=True, metavar="URL", help="Prometheus base URL, e.g. http://127.0.0.1:9090"
    )
    snap.add_argument("--out", type=Path, required=True, help="folder for the PNG files and index.html")
    snap.add_argument("--spec", default=DEFAULT_SPEC, help="fleet spec (default: %(default)s)")
    snap.add_argument(
        "--range",
        dest="range_",
        default="15m",
        metavar="DURATION",
        help="time range ending now (default: %(default)s)",
    )
    snap.add_argument(
        "--scrape-interval",
        default="15s",
        metavar="DURATION",
        help="the Prometheus scrape interval, for $__rate_interval (default: %(default)s)",
    )
    snap.add_argument(
        "--var",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="pin a dashboard variable (e.g. model=ranker); default: all values, or the first value",
    )
    snap.add_argument(
        "--dashboard",
        action="append",
        default=[],
        metavar="NAME",
        help="render only this dashboard: fleet-overview, model-detail, gpu or llm-serving (repeatable)",
    )
    snap.set_defaults(func=_snapshot)


def _load(spec_path: str):
    from alert_rules.config import MissingSetting, RulesConfig
    from inferwatch.spec import SpecError, load_spec_for_cli

    try:
        spec = load_spec_for_cli(spec_path)
        # The panels read the alert settings through the rules' config: refuse what it refuses,
        # before anything is written.
        RulesConfig.from_spec(spec)
    except SpecError as exc:
        raise CliError(str(exc), code=2) from None
    except MissingSetting as exc:
        raise CliError(f"{spec_path}: {exc}", code=2) from None
    return spec


def _build(args: argparse.Namespace) -> int:
    from dashboards import build

    spec = _load(args.spec)
    out = args.out or build.DEFAULT_OUT
    if args.check:
        stale = build.stale(spec, out)
        if stale:
            names = ", ".join(str(p) for p in stale)
            raise CliError(f"stale dashboards (run 'inferwatch dashboards build'): {names}")
        print(f"{out}: {len(build.DASHBOARDS)} dashboards up to date")
        return 0
    try:
        paths = build.write(spec, out)
    except OSError as exc:
        raise CliError(f"cannot write to {out}: {exc.strerror or exc}") from None
    for path in paths:
        print(path)
    return 0


def _snapshot(args: argparse.Namespace) -> int:
    from dashboards import snapshot
    from dashboards.live import LiveError
    from inferwatch.spec import duration_seconds

    spec = _load(args.spec)
    try:
        range_s = duration_seconds(args.range_)
        scrape_s = duration_seconds(args.scrape_interval)
    except ValueError as exc:
        raise CliError(str(exc), code=2) from None
    pins: dict[str, str] = {}
    for item in args.var:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise CliError(f"--var {item!r}: use NAME=VALUE", code=2)
        pins[name] = value
    try:
        result = snapshot.snapshot(
            args.prometheus,
            args.out,
            spec,
            range_s=range_s,
            scrape_interval_s=scrape_s,
            pins=pins,
            only=args.dashboard or None,
            progress=print,
        )
    except LiveError as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"cannot write to {args.out}: {exc.strerror or exc}") from None
    empty = [p for p in result.panels if not p.series and not p.error]
    failed = [p for p in result.panels if p.error]
    for panel in failed:
        print(f"  {panel.dashboard} / {panel.title}: {panel.error}")
    print(f"{result.index}: {len(result.panels)} panels, {len(empty)} without data, {len(failed)} failed")
    return 1 if failed else 0
