"""CLI of the alerting component: ``inferwatch rules``, ``pager``, ``alerts``, ``silence``."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from inferwatch.cli import CliError
from inferwatch.paths import DEFAULT_SPEC


def register(sub: argparse._SubParsersAction) -> None:
    _register_rules(sub)
    _register_pager(sub)
    _register_alerts(sub)


def _am_url_arg(parser: argparse.ArgumentParser) -> None:
    from alert_rules.am_client import DEFAULT_URL, URL_ENV

    parser.add_argument(
        "--alertmanager",
        default=os.environ.get(URL_ENV, DEFAULT_URL),
        help=f"Alertmanager base URL (default: ${URL_ENV} or {DEFAULT_URL})",
    )


def _register_alerts(sub: argparse._SubParsersAction) -> None:
    alerts = sub.add_parser(
        "alerts",
        help="list the alerts Alertmanager holds (firing, silenced, inhibited)",
        description="List the alerts Alertmanager holds, through its API v2.",
    )
    _am_url_arg(alerts)
    alerts.add_argument(
        "matchers",
        nargs="*",
        metavar="MATCHER",
        help="label matchers: name=value, name!=v, name=~re, name!~re",
    )
    alerts.add_argument(
        "--state",
        choices=("all", "active", "suppressed"),
        default="all",
        help="active: notified; suppressed: silenced or inhibited (default: %(default)s)",
    )
    alerts.add_argument("--json", action="store_true", help="print JSON instead of a table")
    alerts.set_defaults(func=_alerts)

    silence = sub.add_parser("silence", help="create, list and expire Alertmanager silences")
    silence_sub = silence.add_subparsers(dest="silence_command", metavar="SUBCOMMAND", required=True)
    add = silence_sub.add_parser(
        "add",
        help="silence the alerts matching all MATCHERs for a while",
        description="Create a silence, e.g.: inferwatch silence add model=ranker version=2 --duration 2h "
        '--comment "rollback in progress". The alerts it mutes now are listed first (on stderr; with '
        "--dry-run on stdout, and nothing is created). A value with spaces or quotes: "
        """'model="a \\"b\\""'. Times are UTC.""",
    )
    _am_url_arg(add)
    add.add_argument(
        "matchers", nargs="+", metavar="MATCHER", help='name=value, name!=v, name=~re, name!~re; "quoted"'
    )
    add.add_argument("--duration", default="1h", help="how long, e.g. 30m, 2h (default: %(default)s)")
    add.add_argument("--comment", required=True, help="why (shown to everyone who sees the silence)")
    add.add_argument("--author", default=os.environ.get("USER", "inferwatch"), help="who (default: $USER)")
    add.add_argument(
        "--dry-run", action="store_true", help="list the alerts the silence would mute now; create nothing"
    )
    add.add_argument(
        "--spec",
        help="fleet spec whose silences.max_duration caps --duration (default: fleet.yaml if present, "
        "else the built-in 7d)",
    )
    add.set_defaults(func=_silence_add)
    ls = silence_sub.add_parser("list", help="list silences")
    _am_url_arg(ls)
    ls.add_argument("--all", action="store_true", help="include expired silences")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.set_defaults(func=_silence_list)
    expire = silence_sub.add_parser("expire", help="end silences now")
    _am_url_arg(expire)
    expire.add_argument("ids", nargs="+", metavar="ID", help="silence ids (from 'silence list')")
    expire.set_defaults(func=_silence_expire)


def _matchers(texts: list[str]):
    from alert_rules.am_client import Matcher

    try:
        return [Matcher.parse(t) for t in texts]
    except ValueError as exc:
        raise CliError(str(exc), code=2) from None


def _client(args: argparse.Namespace):
    from alert_rules.am_client import AlertmanagerClient

    try:
        return AlertmanagerClient(args.alertmanager)
    except ValueError as exc:
        raise CliError(f"--alertmanager: {exc}", code=2) from None


def _iso(t) -> str:
    from datetime import UTC

    return t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if t else ""


def _alerts(args: argparse.Namespace) -> int:
    import json

    from alert_rules.am_client import AlertmanagerError

    matchers = _matchers(args.matchers)
    try:
        with _client(args) as am:
            alerts = am.alerts(matchers)
    except AlertmanagerError as exc:
        raise CliError(str(exc)) from None
    if args.state != "all":
        alerts = [a for a in alerts if a.state == args.state]
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "fingerprint": a.fingerprint,
                        "state": a.state,
                        "labels": a.labels,
                        "annotations": a.annotations,
                        "starts_at": a.starts_at.isoformat() if a.starts_at else None,
                        "silenced_by": a.silenced_by,
                        "inhibited_by": a.inhibited_by,
                        "receivers": a.receivers,
                    }
                    for a in alerts
                ],
                indent=2,
            )
        )
        return 0
    if not alerts:
        print("no alerts")
        return 0
    for a in alerts:
        why = " (inhibited)" if a.inhibited_by else " (silenced)" if a.silenced_by else ""
        labels = " ".join(
            f"{k}={v}" for k, v in sorted(a.labels.items()) if k not in ("alertname", "severity")
        )
        print(
            f"{a.state + why:<22} {a.labels.get('severity', ''):<9} {a.name:<30} {labels}  "
            f"since {_iso(a.starts_at)}  {a.annotations.get('summary', '')}"
        )
    return 0


def _max_silence(spec_arg: str | None) -> tuple[str, float]:
    """silences.max_duration from --spec, else fleet.yaml when there is one, else the default."""
    from inferwatch.spec import duration_seconds

    text = _load(spec_arg, if_none="default-if-present").silences.max_duration
    source = spec_arg or (DEFAULT_SPEC if Path(DEFAULT_SPEC).exists() else "the built-in default")
    return f"silences.max_duration {text} of {source}", duration_seconds(text)


def _preview(alerts, matchers) -> list[str]:
    lines = [f"mutes {len(alerts)} alert{'s' if len(alerts) != 1 else ''} now"]
    if all(m.negative for m in matchers):
        lines.append(
            "note: every matcher is negative (!= or !~): this also mutes every alert without those labels"
        )
    for a in alerts[:20]:
        labels = " ".join(
            f"{k}={v}" for k, v in sorted(a.labels.items()) if k not in ("alertname", "severity")
        )
        lines.append(f"  {a.state:<10} {a.labels.get('severity', ''):<9} {a.name}  {labels}")
    if len(alerts) > 20:
        lines.append(f"  ... and {len(alerts) - 20} more ('inferwatch alerts MATCHER...' lists them)")
    return lines


def _silence_add(args: argparse.Namespace) -> int:
    from datetime import UTC, datetime, timedelta

    from alert_rules.am_client import AlertmanagerError
    from inferwatch.spec import duration_seconds

    matchers = _matchers(args.matchers)
    try:
        seconds = duration_seconds(args.duration)
    except ValueError as exc:
        raise CliError(f"--duration: {exc}", code=2) from None
    if seconds <= 0:
        raise CliError(f"--duration: {args.duration} is not a positive duration", code=2)
    limit, max_seconds = _max_silence(args.spec)
    if seconds > max_seconds:
        raise CliError(f"--duration {args.duration} is longer than {limit}", code=2)
    try:
        duration = timedelta(seconds=seconds)
        ends = datetime.now(UTC) + duration
    except OverflowError:
        raise CliError(f"--duration {args.duration} ends after the year 9999", code=2) from None
    if not args.comment.strip():
        raise CliError("--comment must say why", code=2)
    try:
        with _client(args) as am:
            preview = _preview(am.alerts(matchers), matchers)
            if args.dry_run:
                print("\n".join([f"would silence until {_iso(ends)}; it {preview[0]}", *preview[1:]]))
                return 0
            print(
                "\n".join([f"silencing until {_iso(ends)}; it {preview[0]}", *preview[1:]]), file=sys.stderr
            )
            silence_id = am.create_silence(matchers, duration, args.author, args.comment)
    except (AlertmanagerError, ValueError) as exc:
        raise CliError(str(exc)) from None
    print(silence_id)
    return 0


def _silence_list(args: argparse.Namespace) -> int:
    import json

    from alert_rules.am_client import AlertmanagerError

    try:
        with _client(args) as am:
            silences = am.silences()
    except AlertmanagerError as exc:
        raise CliError(str(exc)) from None
    if not args.all:
        silences = [s for s in silences if s.state != "expired"]
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "id": s.id,
                        "state": s.state,
                        "matchers": [str(m) for m in s.matchers],
                        "starts_at": s.starts_at.isoformat() if s.starts_at else None,
                        "ends_at": s.ends_at.isoformat() if s.ends_at else None,
                        "created_by": s.created_by,
                        "comment": s.comment,
                    }
                    for s in silences
                ],
                indent=2,
            )
        )
        return 0
    if not silences:
        print("no silences")
    for s in silences:
        matchers = ",".join(str(m) for m in s.matchers)
        print(f"{s.id}  {s.state:<8} until {_iso(s.ends_at)}  {matchers}  {s.created_by}: {s.comment}")
    return 0


def _silence_expire(args: argparse.Namespace) -> int:
    """Each id on its own: one bad id does not keep the others silenced."""
    from alert_rules.am_client import AlertmanagerError

    failed = 0
    with _client(args) as am:
        for silence_id in args.ids:
            try:
                am.expire_silence(silence_id)
            except (AlertmanagerError, ValueError) as exc:
                print(f"inferwatch: error: cannot expire {silence_id}: {exc}", file=sys.stderr)
                failed += 1
            else:
                print(f"expired {silence_id}")
    return 1 if failed else 0


def _register_pager(sub: argparse._SubParsersAction) -> None:
    from inferwatch.contract import PORTS

    pager = sub.add_parser(
        "pager",
        help="run the on-call inbox: an Alertmanager webhook receiver with a web page",
        description=(
            "Receive Alertmanager webhook notifications (payload version 4) at POST /webhook, "
            "authenticated by a bearer token; store each in SQLite before answering; list pages at "
            "GET /pages (JSON; filters status, severity, alertname, model, version, receiver; limit, "
            "offset) and GET / (HTML). Runs until SIGTERM or Ctrl-C."
        ),
    )
    pager.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    pager.add_argument("--port", type=int, default=PORTS["pager"], help="port (default: %(default)s)")
    pager.add_argument("--db", help="SQLite database (default: <state dir>/pager.db)")
    pager.add_argument(
        "--token-file",
        help="file holding the bearer token Alertmanager sends (default: $INFERWATCH_PAGER_TOKEN)",
    )
    pager.add_argument(
        "--read-token-file",
        help=(
            "file holding a second, read-only token that GET / and /pages then require, as a bearer "
            "token or a Basic-auth password (default: $INFERWATCH_PAGER_READ_TOKEN; unset: reads are open)"
        ),
    )
    pager.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a client gets to send a request's headers (default: %(default)s)",
    )
    pager.add_argument(
        "--resolve-grace",
        type=float,
        default=None,
        metavar="SECONDS",
        help=(
            "a firing with the startsAt of a page resolved less than this long ago is a second "
            "Alertmanager's stale copy, kept on the resolved page; a later one reopens it "
            "(default: $INFERWATCH_PAGER_RESOLVE_GRACE, else 75: a 15 s peer timeout plus a 1 m "
            "group interval; 0 turns it off)"
        ),
    )
    pager.set_defaults(func=_pager)


def _pager(args: argparse.Namespace) -> int:
    from alert_rules import pager

    return pager.main(args)


def _register_rules(sub: argparse._SubParsersAction) -> None:
    from alert_rules.generate import DEFAULT_OUT, DEFAULT_PAGER_TOKEN_FILE, DEFAULT_RUNBOOKS

    rules = sub.add_parser("rules", help="generate and check the Prometheus rules and Alertmanager config")
    rules_sub = rules.add_subparsers(dest="rules_command", metavar="SUBCOMMAND", required=True)
    build = rules_sub.add_parser(
        "build",
        help="generate rule files, the PrometheusRule, alertmanager.yml and runbooks from the spec",
        description=(
            "Generate, from the fleet spec: one Prometheus rule file per alert group, the same rules as "
            "a PrometheusRule resource, alertmanager.yml with its templates, and one runbook per alert. "
            "Output is deterministic; commit it."
        ),
    )
    build.add_argument("--spec", default=DEFAULT_SPEC, help="the fleet spec (default: %(default)s)")
    build.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="output directory (default: %(default)s)"
    )
    build.add_argument(
        "--runbooks",
        type=Path,
        default=DEFAULT_RUNBOOKS,
        help="where runbooks go (default: %(default)s); '-' to skip them",
    )
    build.add_argument(
        "--pager-token-file",
        default=DEFAULT_PAGER_TOKEN_FILE,
        help=(
            "bearer-token file the webhooks send when the spec names none; relative paths are "
            "resolved by Alertmanager against alertmanager.yml's directory (default: %(default)s)"
        ),
    )
    build.add_argument(
        "--check", action="store_true", help="also run promtool check rules and amtool check-config"
    )
    build.set_defaults(func=_rules_build)


def _load(spec_path: str | None, if_none: str = "default"):
    from inferwatch.spec import SpecError, load_spec_for_cli

    try:
        return load_spec_for_cli(spec_path, if_none=if_none)
    except SpecError as exc:
        raise CliError(str(exc), code=2) from None


def _rules_build(args: argparse.Namespace) -> int:
    from alert_rules.config import MissingSetting
    from alert_rules.generate import build, rule_files

    spec = _load(args.spec)
    runbooks = None if str(args.runbooks) == "-" else args.runbooks
    try:
        paths = build(spec, args.out, runbooks, args.pager_token_file or None)
    except MissingSetting as exc:
        raise CliError(f"{args.spec}: {exc}", code=2) from None
    except OSError as exc:
        raise CliError(f"cannot write {exc.filename}: {exc.strerror}") from None
    for path in paths:
        print(f"wrote {_rel(path)}")
    if args.check:
        _run_check(["promtool", "check", "rules", *map(str, rule_files(args.out))])
        _run_check(["amtool", "check-config", str(Path(args.out) / "alertmanager.yml")])
    return 0


def _run_check(cmd: list[str]) -> None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise CliError(f"{cmd[0]} is not installed (scripts/bootstrap installs it)") from None
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise CliError(f"{' '.join(cmd[:2])} failed")
    print(f"{' '.join(cmd[:3])}: ok")


def _rel(path: Path) -> str:
    try:
        return os.path.relpath(path)
    except ValueError:
        return str(path)
