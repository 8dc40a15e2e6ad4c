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
from collections.abc import Callable, Sequence

from inferwatch import __version__

# Each top-level command and the module that registers it. Running one command imports
# only its module: the sidecar and the exporter stay lean in memory, and a broken optional
# component cannot break the others. ``--help`` imports them all; a test checks this map
# against what the modules register.
COMMANDS: dict[str, str] = {
    "spec": "inferwatch.spec_cli",
    "sidecar": "sidecar.main",
    "triton": "reference_server.cli",
    "fault": "reference_server.cli",
    "load": "reference_server.cli",
    "naive-server": "reference_server.cli",
    "vllm": "reference_server.llm.cli",
    "gpu-exporter": "exporters.cli",
    "rules": "alert_rules.cli",
    "pager": "alert_rules.cli",
    "alerts": "alert_rules.cli",
    "silence": "alert_rules.cli",
    "dashboards": "dashboards.cli",
    "up": "inferwatch.stack.cli",
    "demo": "inferwatch.stack.cli",
    "canary": "inferwatch.canary.cli",
}
COMMAND_MODULES = list(dict.fromkeys(COMMANDS.values()))

EXIT_USAGE = 2


class CliError(Exception):
    """An error the user can fix: printed as one line, exit code ``code``, no traceback."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser, or with ``command`` one that registers only that command's module."""
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
    modules = [COMMANDS[command]] if command in COMMANDS else COMMAND_MODULES
    for name in modules:
        importlib.import_module(name).register(sub)
    return parser


def run(command: Callable[[], int | None]) -> int:
    """Run a command the way every inferwatch entry point does (``inferwatch``, ``python -m
    sidecar``, ``python -m exporters``): its exit code; a CliError as one line on stderr, no
    traceback; Ctrl-C as 130."""
    try:
        return int(command() or 0)
    except CliError as exc:
        print(f"inferwatch: error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    return run(lambda: args.func(args))


if __name__ == "__main__":
    # Under ``python -m inferwatch.cli`` this file is ``__main__``: run the imported module's
    # main so that it catches the CliError class the components raise.
    from inferwatch.cli import main as _main

    sys.exit(_main())
