"""The ``inferwatch`` command: one entry point that reaches every component.

Each component registers its own subcommands through a ``register(subparsers)``
function listed in ``COMMAND_MODULES``; a module is imported only to build the parser,
and heavy imports stay inside the command functions so ``inferwatch --help`` is fast.
A command function returns the process exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from inferwatch import __version__

# Components add themselves here, one line each, when their commands work.
COMMAND_MODULES = [
    "inferwatch.spec_cli",
    "sidecar.main",
    "reference_server.cli",
    "dashboards.cli",
    "exporters.cli",
    "alert_rules.cli",
    "inferwatch.stack.cli",
]

EXIT_USAGE = 2


class CliError(Exception):
    """An error the user can fix: printed as one line, exit code ``code``, no traceback."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inferwatch",
        description=(
            "Observability and alerting for GPU inference fleets: a GPU exporter, a request-metrics "
            "sidecar, generated Prometheus rules and Grafana dashboards, and a local stack that proves "
            "them."
        ),
        epilog="Run 'inferwatch COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"inferwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"inferwatch: error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
