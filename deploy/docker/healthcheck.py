#!/usr/bin/env python3
"""Container health check for the inferwatch image: exit 0 when every URL answers 2xx.

The slim Python image has neither curl nor wget, so docker-compose's ``healthcheck`` and
the Dockerfile call this instead: ``inferwatch-healthcheck http://127.0.0.1:9110/readyz``.
Without a URL (the Dockerfile's HEALTHCHECK, which knows no command) it takes
$INFERWATCH_HEALTHCHECK_URL, else it reads the container's command from /proc/1/cmdline
(through docker-init or tini) and probes that component's own endpoint.
It uses only the standard library so it works before (and without) the package's imports.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

# Each long-running command's health endpoint: (port flag, port environment variable,
# default port, path). The defaults are inferwatch.contract.PORTS (a test keeps them equal).
ENDPOINTS = {
    "sidecar": ("--metrics-port", "INFERWATCH_METRICS_PORT", 9110, "/readyz"),
    "gpu-exporter": ("--port", None, 9400, "/healthz"),
    "pager": ("--port", None, 9095, "/healthz"),
}
INITS = {"docker-init", "tini", "dumb-init"}


def url_for(argv: list[str], env: dict[str, str]) -> str | None:
    """The health URL of the inferwatch command ``argv`` runs, or None if it has none."""
    if argv and os.path.basename(argv[0]) in INITS:
        argv = argv[argv.index("--") + 1 :] if "--" in argv else argv[1:]
    # `inferwatch CMD ...` or `python /usr/local/bin/inferwatch CMD ...`
    for i, arg in enumerate(argv):
        if os.path.basename(arg) == "inferwatch" and i + 1 < len(argv) and argv[i + 1] in ENDPOINTS:
            command, rest = argv[i + 1], argv[i + 2 :]
            break
    else:
        return None
    flag, env_name, port, path = ENDPOINTS[command]
    if env_name and env.get(env_name):
        port = env[env_name]
    for j, arg in enumerate(rest):
        if arg == flag and j + 1 < len(rest):
            port = rest[j + 1]
        elif arg.startswith(flag + "="):
            port = arg.split("=", 1)[1]
    return f"http://127.0.0.1:{port}{path}"


def own_command() -> list[str]:
    try:
        with open("/proc/1/cmdline", "rb") as fh:
            return [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return []


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
    if any(a in ("-h", "--help") for a in argv):
        print("usage: inferwatch-healthcheck [URL ...]  (exit 0 when each answers 2xx)", file=sys.stderr)
        return 2
    if not argv:
        url = os.environ.get("INFERWATCH_HEALTHCHECK_URL") or url_for(own_command(), dict(os.environ))
        if not url:
            print(
                "unhealthy: no URL given and the container's command has no known health endpoint"
                " (pass a URL or set INFERWATCH_HEALTHCHECK_URL)",
                file=sys.stderr,
            )
            return 1
        argv = [url]
    errors = [e for e in (check(u) for u in argv) if e]
    for e in errors:
        print(f"unhealthy: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
