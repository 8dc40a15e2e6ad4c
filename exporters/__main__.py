"""``python -m exporters``: the GPU exporter alone, without the rest of the inferwatch CLI.

Same options as ``inferwatch gpu-exporter``. ``inferwatch gpu-exporter`` replaces its own process
with this one at start (same PID, so signals and supervisors are unaffected): building the full
CLI imports every component's command module (FastAPI, numpy, OpenTelemetry, ...), which would
more than double the exporter's resident memory for the rest of its life.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from exporters.cli import register
from inferwatch.cli import CliError


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inferwatch")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["gpu-exporter", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"inferwatch: error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
