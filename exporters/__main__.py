"""``python -m exporters``: the GPU exporter alone, without the rest of the inferwatch CLI.

Same options as ``inferwatch gpu-exporter``. It builds only the exporter's own command, so
nothing of the other components (FastAPI, numpy, OpenTelemetry, ...) is imported: the lean
entry point for a DaemonSet or a container.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from exporters.cli import register
from inferwatch.cli import run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inferwatch")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["gpu-exporter", *(sys.argv[1:] if argv is None else argv)])
    return run(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
