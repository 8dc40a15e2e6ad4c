"""``python -m sidecar``: the sidecar alone, the same as ``inferwatch sidecar``."""

from __future__ import annotations

import argparse
import sys

from inferwatch.cli import run
from sidecar import config as cfg
from sidecar.main import _config, serve_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="inferwatch sidecar",
        description="The request-metrics proxy; see 'inferwatch sidecar --help'.",
    )
    cfg.add_arguments(parser)
    args = parser.parse_args(argv)
    return run(lambda: serve_config(_config(args)))


if __name__ == "__main__":
    sys.exit(main())
