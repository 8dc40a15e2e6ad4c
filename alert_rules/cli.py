"""CLI of the alerting component: ``inferwatch rules``, ``pager``, ``alerts``, ``silence``."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from inferwatch.cli import CliError

DEFAULT_SPEC = "fleet.yaml"


def register(sub: argparse._SubParsersAction) -> None:
    _register_rules(sub)
    _register_pager(sub)


def _register_pager(sub: argparse._SubParsersAction) -> None:
    from inferwatch.contract import PORTS

    pager = sub.add_parser(
        "pager",
        help="run the on-call inbox: an Alertmanager webhook receiver with a web page",
        description=(
            "Receive Alertmanager webhook notifications (payload version 4) at POST /webhook, "
            "authenticated by a bearer token; store each in SQLite before answering; list pages at "
            "GET /pages (JSON; filters status, severity, alertname, model, receiver, limit) and GET / "
            "(HTML). Runs until SIGTERM or Ctrl-C."
        ),
    )
    pager.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    pager.add_argument("--port", type=int, default=PORTS["pager"], help="port (default: %(default)s)")
    pager.add_argument("--db", help="SQLite database (default: <state dir>/pager.db)")
    pager.add_argument(
        "--token-file",
        help="file holding the bearer token Alertmanager sends (default: $INFERWATCH_PAGER_TOKEN)",
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


def _load(spec_path: str):
    from inferwatch.spec import SpecError, load_spec

    try:
        return load_spec(spec_path)
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
