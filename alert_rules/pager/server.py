"""The ``inferwatch pager`` process: tokens, the listening socket, uvicorn, clean shutdown."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import socket
import sqlite3
import time
from pathlib import Path

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from inferwatch import logs

from .store import DEFAULT_RESOLVE_GRACE, PageStore
from .web import create_app

TOKEN_ENV = "INFERWATCH_PAGER_TOKEN"
READ_TOKEN_ENV = "INFERWATCH_PAGER_READ_TOKEN"
RESOLVE_GRACE_ENV = "INFERWATCH_PAGER_RESOLVE_GRACE"
# A client gets this long to send a request's headers; then the connection is closed.
HEADER_TIMEOUT = 10.0
log = logging.getLogger("inferwatch.pager")


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol, plus a deadline for the request line and headers: uvicorn
    times out idle keep-alive connections but not half-sent headers, so a client could hold
    connections open for ever (slowloris)."""

    header_timeout = HEADER_TIMEOUT

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_timer()  # the next request on a kept-alive connection

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)


def _token(token_file: str | None, env: str, what: str) -> str | None:
    if token_file:
        try:
            token = Path(token_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or "not UTF-8 text"
            raise ValueError(f"cannot read the {what} file {token_file}: {reason}") from None
        if not token:
            raise ValueError(f"the {what} file {token_file} is empty")
        return token
    return os.environ.get(env, "").strip() or None


def read_token(token_file: str | None) -> str:
    """The token from ``token_file``, else from $INFERWATCH_PAGER_TOKEN; ValueError if none."""
    token = _token(token_file, TOKEN_ENV, "token")
    if not token:
        raise ValueError(f"no bearer token: pass --token-file FILE or set {TOKEN_ENV}")
    return token


def read_read_token(token_file: str | None) -> str | None:
    """The read-only token from ``token_file``, else $INFERWATCH_PAGER_READ_TOKEN; None if
    neither is set (then reads need no token)."""
    return _token(token_file, READ_TOKEN_ENV, "read token")


def new_token_file(path: Path) -> str:
    """Writes a fresh random token to ``path`` (mode 0600) and returns it; for local stacks."""
    token = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    return token


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a busy port is one clear error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(
    host: str,
    port: int,
    db: Path,
    token: str,
    read_token: str | None = None,
    sock: socket.socket | None = None,
    header_timeout: float = HEADER_TIMEOUT,
    resolve_grace: float = DEFAULT_RESOLVE_GRACE,
) -> int:
    """Runs until SIGTERM/SIGINT (uvicorn finishes in-flight requests), then closes the DB."""
    import uvicorn

    sock = sock or listen(host, port)
    store = PageStore(db, resolve_grace)
    app = create_app(store, token, read_token)
    protocol = type("PagerProtocol", (HeaderTimeoutProtocol,), {"header_timeout": header_timeout})
    config = uvicorn.Config(app, http=protocol, log_config=None, access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    log.info(
        "pager starting",
        extra={
            "fields": {
                "host": host,
                "port": port,
                "db": str(db),
                "read_token": read_token is not None,
                "resolve_grace_s": resolve_grace,
                **store.counts(),
            }
        },
    )
    started = time.monotonic()
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal to the
    # handler that was installed before it; a no-op one lets us close the store and exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        store.close()
        sock.close()
    log.info("pager stopped", extra={"fields": {"uptime_s": round(time.monotonic() - started, 1)}})
    return 0 if server.started else 1


def resolve_grace(flag: float | None) -> float:
    """The stale-firing grace in seconds: ``flag``, else $INFERWATCH_PAGER_RESOLVE_GRACE, else
    the default; ValueError naming the source when it is not 0 to 86400."""
    if flag is not None:
        value, source = flag, "--resolve-grace"
    elif os.environ.get(RESOLVE_GRACE_ENV, "").strip():
        text, source = os.environ[RESOLVE_GRACE_ENV].strip(), RESOLVE_GRACE_ENV
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{source} must be a number of seconds, not {text[:40]!r}") from None
    else:
        return DEFAULT_RESOLVE_GRACE
    if not 0 <= value <= 86400:  # NaN fails this too
        raise ValueError(f"{source} must be between 0 and 86400 seconds")
    return value


def main(args: argparse.Namespace) -> int:
    from inferwatch.cli import CliError
    from inferwatch.paths import state_dir

    # The root logger: uvicorn's records come out as JSON lines too.
    logs.setup(logger="")
    try:
        token = read_token(args.token_file)
        read_token_value = read_read_token(getattr(args, "read_token_file", None))
    except ValueError as exc:
        raise CliError(str(exc), code=2) from None
    if read_token_value is not None and read_token_value == token:
        raise CliError("the read token must differ from the webhook token", code=2)
    header_timeout = getattr(args, "header_timeout", HEADER_TIMEOUT)
    if not 0 < header_timeout <= 3600:
        raise CliError("--header-timeout must be between 0 and 3600 seconds", code=2)
    try:
        grace = resolve_grace(getattr(args, "resolve_grace", None))
    except ValueError as exc:
        raise CliError(str(exc), code=2) from None
    db = Path(args.db) if args.db else state_dir() / "pager.db"
    try:
        sock = listen(args.host, args.port)
    except OSError as exc:
        raise CliError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    try:
        return serve(args.host, args.port, db, token, read_token_value, sock, header_timeout, grace)
    except sqlite3.Error as exc:
        raise CliError(f"cannot use the database {db}: {exc}") from None
    except OSError as exc:
        where = exc.filename or db
        raise CliError(f"cannot use the database {db}: {where}: {exc.strerror or exc}") from None
    finally:
        sock.close()
