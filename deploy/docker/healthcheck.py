#!/usr/bin/env python3
"""Container health check for the inferwatch image: exit 0 when every URL answers 2xx.

The slim Python image has neither curl nor wget, so docker-compose's ``healthcheck`` and
the Dockerfile call this instead: ``inferwatch-healthcheck http://127.0.0.1:9110/readyz``.
It uses only the standard library so it works before (and without) the package's imports.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request


def check(url: str, timeout: float = 3.0) -> str | None:
    """None when ``url`` answers 2xx, else one line saying what went wrong."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            if 200 <= resp.status < 300:
                return None
            return f"{url}: HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return f"{url}: HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"{url}: {reason}"


def main(argv: list[str]) -> int:
    if not argv or any(a in ("-h", "--help") for a in argv):
        print("usage: inferwatch-healthcheck URL [URL ...]  (exit 0 when each answers 2xx)", file=sys.stderr)
        return 2
    errors = [e for e in (check(u) for u in argv) if e]
    for e in errors:
        print(f"unhealthy: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
