"""``inferwatch pager``: the on-call inbox of the local stack.

An Alertmanager webhook receiver (payload version 4) that requires a bearer token, stores
every notification in SQLite before answering (so an acknowledged page survives a crash
or restart, and an unacknowledged one is retried by Alertmanager), and is idempotent: a
delivery repeated by Alertmanager's retries is recognised and stored once.

  POST /webhook   Alertmanager's webhook (Authorization: Bearer <token>)
  GET  /pages     pages as JSON; filters: status, severity, alertname, model, receiver, limit
  GET  /          the same as a plain HTML page, with runbook and dashboard links
  GET  /healthz   liveness (and the database answers)

A page is one alert occurrence (receiver, fingerprint, startsAt): firing until a resolved
notification for it arrives.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import html
import json
import logging
import os
import secrets
import signal
import sqlite3
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from inferwatch import contract as c
from inferwatch import logs

TOKEN_ENV = "INFERWATCH_PAGER_TOKEN"
DEFAULT_PORT = c.PORTS["pager"]
# Thousands of alerts fit in far less; a bigger body is a mistake or an attack.
MAX_BODY = 16 * 1024 * 1024
log = logging.getLogger("inferwatch.pager")


# ---------------------------------------------------------------------------------------
# Alertmanager's webhook payload, version 4
# ---------------------------------------------------------------------------------------
class WebhookAlert(BaseModel):
    model_config = ConfigDict(extra="ignore")
    status: Literal["firing", "resolved"]
    labels: dict[str, str]
    annotations: dict[str, str] = {}
    startsAt: str = Field(min_length=1)
    endsAt: str = ""
    generatorURL: str = ""
    fingerprint: str = Field(min_length=1)


class WebhookPayload(BaseModel):
    model_config = ConfigDict(extra="ignore")
    version: Literal["4"]
    groupKey: str
    truncatedAlerts: int = 0
    status: Literal["firing", "resolved"]
    receiver: str
    groupLabels: dict[str, str] = {}
    commonLabels: dict[str, str] = {}
    commonAnnotations: dict[str, str] = {}
    externalURL: str = ""
    alerts: list[WebhookAlert] = Field(min_length=1)


def dedupe_key(payload: WebhookPayload) -> str:
    """Identical for a repeated delivery of the same notification. A firing alert's endsAt
    moves on every Prometheus resend, so only a resolved alert's endsAt is part of it."""
    alerts = sorted(
        (a.fingerprint, a.status, a.startsAt, a.endsAt if a.status == "resolved" else "")
        for a in payload.alerts
    )
    raw = json.dumps([payload.receiver, payload.groupKey, payload.status, alerts], separators=(",", ":"))
    return hashlib.sha256(raw.encode()).hexdigest()


# ---------------------------------------------------------------------------------------
# Storage
# ---------------------------------------------------------------------------------------
_SCHEMA = """
CREATE TABLE IF NOT EXISTS notifications (
    id INTEGER PRIMARY KEY,
    dedupe_key TEXT NOT NULL UNIQUE,
    received_at TEXT NOT NULL,
    receiver TEXT NOT NULL,
    status TEXT NOT NULL,
    group_key TEXT NOT NULL,
    deliveries INTEGER NOT NULL DEFAULT 1,
    payload TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS pages (
    id INTEGER PRIMARY KEY,
    receiver TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    starts_at TEXT NOT NULL,
    ends_at TEXT NOT NULL,
    status TEXT NOT NULL,
    alertname TEXT NOT NULL,
    severity TEXT NOT NULL,
    model TEXT NOT NULL,
    labels TEXT NOT NULL,
    annotations TEXT NOT NULL,
    first_received_at TEXT NOT NULL,
    last_received_at TEXT NOT NULL,
    notifications INTEGER NOT NULL DEFAULT 1,
    UNIQUE (receiver, fingerprint, starts_at)
);
CREATE INDEX IF NOT EXISTS pages_last ON pages (last_received_at);
"""
PAGE_FILTERS = ("status", "severity", "alertname", "model", "receiver")


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


class PageStore:
    """SQLite, one connection guarded by a lock; every write is committed (WAL, synchronous
    FULL) before the webhook answers, so an answered notification is on disk."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def ping(self) -> None:
        with self._lock:
            self._db.execute("SELECT 1").fetchone()

    def add(self, payload: WebhookPayload, raw: str) -> bool:
        """Stores a notification and updates its pages; False when it was a repeat."""
        key, now = dedupe_key(payload), _now()
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                cur = db.execute(
                    "INSERT INTO notifications"
                    " (dedupe_key, received_at, receiver, status, group_key, payload)"
                    " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (dedupe_key) DO UPDATE"
                    " SET deliveries = deliveries + 1 RETURNING deliveries",
                    (key, now, payload.receiver, payload.status, payload.groupKey, raw),
                )
                if cur.fetchone()[0] > 1:
                    db.execute("COMMIT")
                    return False
                for a in payload.alerts:
                    db.execute(
                        "INSERT INTO pages (receiver, fingerprint, starts_at, ends_at, status, alertname,"
                        " severity, model, labels, annotations, first_received_at, last_received_at)"
                        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                        " ON CONFLICT (receiver, fingerprint, starts_at) DO UPDATE SET"
                        # Resolved is final for an occurrence: a late retry of an older
                        # firing notification must not reopen it.
                        "  status = CASE WHEN pages.status = 'resolved' THEN 'resolved'"
                        "                ELSE excluded.status END,"
                        "  ends_at = CASE WHEN pages.status = 'resolved' THEN pages.ends_at"
                        "                 ELSE excluded.ends_at END,"
                        "  annotations = excluded.annotations,"
                        "  last_received_at = excluded.last_received_at,"
                        "  notifications = pages.notifications + 1",
                        (
                            payload.receiver,
                            a.fingerprint,
                            a.startsAt,
                            a.endsAt,
                            a.status,
                            a.labels.get("alertname", ""),
                            a.labels.get("severity", ""),
                            a.labels.get(c.L_MODEL, ""),
                            json.dumps(a.labels, sort_keys=True),
                            json.dumps(a.annotations, sort_keys=True),
                            now,
                            now,
                        ),
                    )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return True

    def pages(self, filters: dict[str, str], limit: int = 500) -> list[dict]:
        where = " AND ".join(f"{k} = ?" for k in filters)
        sql = "SELECT * FROM pages" + (f" WHERE {where}" if where else "")
        sql += " ORDER BY last_received_at DESC, id DESC LIMIT ?"
        with self._lock:
            rows = self._db.execute(sql, (*filters.values(), limit)).fetchall()
        return [
            {
                "receiver": r["receiver"],
                "fingerprint": r["fingerprint"],
                "status": r["status"],
                "alertname": r["alertname"],
                "severity": r["severity"],
                "labels": json.loads(r["labels"]),
                "annotations": json.loads(r["annotations"]),
                "starts_at": r["starts_at"],
                "ends_at": r["ends_at"],
                "first_received_at": r["first_received_at"],
                "last_received_at": r["last_received_at"],
                "notifications": r["notifications"],
            }
            for r in rows
        ]

    def counts(self) -> dict[str, int]:
        with self._lock:
            n, d = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(deliveries), 0) FROM notifications"
            ).fetchone()
            p = self._db.execute("SELECT COUNT(*) FROM pages").fetchone()[0]
        return {"notifications": n, "deliveries": d, "pages": p}


# ---------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------
def _link(url: str, text: str) -> str:
    if not url.startswith(("http://", "https://")):
        return ""
    return f'<a href="{html.escape(url, quote=True)}">{text}</a>'


def render_html(pages: list[dict], counts: dict[str, int]) -> str:
    rows = []
    for p in pages:
        labels = ", ".join(
            f"{html.escape(k)}={html.escape(v)}"
            for k, v in sorted(p["labels"].items())
            if k not in ("alertname", "severity")
        )
        ann = p["annotations"]
        rows.append(
            f'<tr class="{html.escape(p["status"])}"><td>{html.escape(p["status"])}</td>'
            f"<td>{html.escape(p['severity'])}</td><td>{html.escape(p['alertname'])}</td>"
            f"<td>{labels}</td><td>{html.escape(ann.get('summary', ''))}</td>"
            f"<td>{html.escape(p['starts_at'])}</td>"
            f"<td>{html.escape(p['ends_at']) if p['status'] == 'resolved' else ''}</td>"
            f"<td>{_link(ann.get('runbook_url', ''), 'runbook')} "
            f"{_link(ann.get('dashboard_url', ''), 'dashboard')}</td>"
            f"<td>{html.escape(p['receiver'])}</td></tr>"
        )
    firing = sum(p["status"] == "firing" for p in pages)
    body = "\n".join(rows) or '<tr><td colspan="9">No pages yet.</td></tr>'
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="10">
<title>inferwatch pager ({firing} firing)</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; }} table {{ border-collapse: collapse; width: 100%; }}
td, th {{ border-bottom: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }}
tr.firing td:first-child {{ color: #b00; font-weight: bold; }} tr.resolved td:first-child {{ color: #080; }}
</style></head><body>
<h1>inferwatch pager</h1>
<p>{firing} firing, {len(pages) - firing} resolved; {counts["notifications"]} notifications received.</p>
<table><tr><th>status</th><th>severity</th><th>alert</th><th>labels</th><th>summary</th>
<th>since</th><th>resolved</th><th>links</th><th>receiver</th></tr>
{body}
</table></body></html>
"""


def create_app(store: PageStore, token: str) -> FastAPI:
    """The FastAPI app; ``store`` and ``token`` are its only dependencies."""
    if not token:
        raise ValueError("the pager needs a non-empty bearer token")
    app = FastAPI(title="inferwatch pager", docs_url=None, redoc_url=None)
    expected = f"Bearer {token}".encode()

    def reject(status: int, reason: str, **extra: object) -> JSONResponse:
        log.warning("webhook rejected", extra={"fields": {"status": status, "reason": reason, **extra}})
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return JSONResponse({"error": reason}, status_code=status, headers=headers)

    @app.post("/webhook")
    async def webhook(request: Request):
        client = request.client.host if request.client else ""
        auth = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(auth, expected):
            return reject(401, "missing or wrong bearer token", client=client)
        if int(request.headers.get("content-length") or 0) > MAX_BODY:
            return reject(413, f"body larger than {MAX_BODY} bytes", client=client)
        raw = await request.body()
        if len(raw) > MAX_BODY:
            return reject(413, f"body larger than {MAX_BODY} bytes", client=client)
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            return reject(400, f"body is not JSON: {exc}", client=client)
        try:
            payload = WebhookPayload.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "body"
            return reject(422, f"not an Alertmanager v4 payload: {where}: {err['msg']}", client=client)
        stored = await run_in_threadpool(store.add, payload, raw.decode())
        log.info(
            "notification stored" if stored else "repeated delivery ignored",
            extra={
                "fields": {
                    "receiver": payload.receiver,
                    "status": payload.status,
                    "alerts": len(payload.alerts),
                    "alertnames": sorted({a.labels.get("alertname", "") for a in payload.alerts}),
                    "group_key": payload.groupKey,
                }
            },
        )
        return {"stored": stored, "duplicate": not stored, "alerts": len(payload.alerts)}

    def _filters(request: Request) -> tuple[dict[str, str], int]:
        q = request.query_params
        filters = {k: q[k] for k in PAGE_FILTERS if q.get(k)}
        try:
            limit = max(1, min(int(q.get("limit", "500")), 5000))
        except ValueError:
            limit = 500
        return filters, limit

    @app.get("/pages")
    def pages(request: Request):
        filters, limit = _filters(request)
        unknown = sorted(set(request.query_params) - {*PAGE_FILTERS, "limit"})
        if unknown:
            return JSONResponse(
                {"error": f"unknown filter {unknown[0]!r}; known: {', '.join(PAGE_FILTERS)}, limit"},
                status_code=400,
            )
        return {"pages": store.pages(filters, limit), "counts": store.counts()}

    @app.get("/", response_class=HTMLResponse)
    def index(request: Request):
        filters, limit = _filters(request)
        return HTMLResponse(render_html(store.pages(filters, limit), store.counts()))

    @app.get("/healthz")
    def healthz():
        store.ping()
        return {"status": "ok"}

    return app


# ---------------------------------------------------------------------------------------
# Process
# ---------------------------------------------------------------------------------------


def read_token(token_file: str | None) -> str:
    """The token from ``token_file``, else from $INFERWATCH_PAGER_TOKEN; ValueError if none."""
    if token_file:
        try:
            token = Path(token_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"cannot read the token file {token_file}: {exc.strerror}") from None
        if not token:
            raise ValueError(f"the token file {token_file} is empty")
        return token
    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise ValueError(f"no bearer token: pass --token-file FILE or set {TOKEN_ENV}")
    return token


def new_token_file(path: Path) -> str:
    """Writes a fresh random token to ``path`` (mode 0600) and returns it; for local stacks."""
    token = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    return token


def serve(host: str, port: int, db: Path, token: str) -> int:
    """Runs until SIGTERM/SIGINT (uvicorn finishes in-flight requests), then closes the DB."""
    import uvicorn

    store = PageStore(db)
    app = create_app(store, token)
    config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    log.info(
        "pager starting", extra={"fields": {"host": host, "port": port, "db": str(db), **store.counts()}}
    )
    started = time.monotonic()
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal to the
    # handler that was installed before it; a no-op one lets us close the store and exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        store.close()
    log.info("pager stopped", extra={"fields": {"uptime_s": round(time.monotonic() - started, 1)}})
    return 0 if server.started else 1


def main(args: argparse.Namespace) -> int:
    from inferwatch.cli import CliError
    from inferwatch.paths import state_dir

    # The root logger: uvicorn's records come out as JSON lines too.
    logs.setup(logger="")
    try:
        token = read_token(args.token_file)
    except ValueError as exc:
        raise CliError(str(exc), code=2) from None
    db = Path(args.db) if args.db else state_dir() / "pager.db"
    try:
        return serve(args.host, args.port, db, token)
    except sqlite3.Error as exc:
        raise CliError(f"cannot use the database {db}: {exc}") from None
