"""The pager's HTTP API: the webhook, the inbox (JSON and HTML), health.

POST /webhook   Alertmanager's webhook (Authorization: Bearer <token>)
GET  /pages     pages as JSON: filters status, severity, alertname, model, version,
                receiver; limit, offset
GET  /          the same as the HTML inbox
GET  /healthz   liveness (and the database answers); never needs a token
"""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from . import inbox
from .payload import BadPayload, parse_body
from .store import FILTERS, PageStore

# Thousands of alerts fit in far less; a bigger body is a mistake or an attack.
MAX_BODY = 16 * 1024 * 1024
MAX_LIMIT = 5000
DEFAULT_LIMIT = 100
log = logging.getLogger("inferwatch.pager")

SECURITY_HEADERS = {
    # No script anywhere; the inbox's one style block is allowed by its hash.
    "content-security-policy": (
        f"default-src 'none'; style-src '{inbox.STYLE_HASH}'; base-uri 'none'; "
        "form-action 'none'; frame-ancestors 'none'"
    ),
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}


class RateLimitedLog:
    """At most one line per ``interval`` seconds for each kind of event; the next line says
    how many were left out. A client that posts without a token cannot flood the log."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self._log = logger
        self._interval = interval
        self._lock = threading.Lock()
        self._last: dict[object, float] = {}
        self._suppressed: dict[object, int] = {}

    def warning(self, kind: object, msg: str, fields: dict) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -self._interval) < self._interval:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return
            self._last[kind] = now
            suppressed = self._suppressed.pop(kind, 0)
        self._log.warning(msg, extra={"fields": {**fields, "suppressed_since_last": suppressed}})


def _bearer_or_basic(header: str) -> bytes:
    """The credential in an Authorization header: a bearer token, or a Basic password (so
    a browser's own login prompt can open the inbox)."""
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer":
        return value.strip().encode()
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(value.strip(), validate=True).partition(b":")[2]
        except (binascii.Error, ValueError):
            return b""
    return b""


def _query(request: Request) -> tuple[dict[str, str], int, int]:
    """Filters, limit and offset from the query; ValueError naming what is wrong."""
    q = request.query_params
    unknown = sorted(set(q) - {*FILTERS, "limit", "offset"})
    if unknown:
        raise ValueError(f"unknown filter {unknown[0]!r}; known: {', '.join(FILTERS)}, limit, offset")
    filters = {k: q[k] for k in FILTERS if q.get(k)}
    try:
        limit = int(q.get("limit", DEFAULT_LIMIT))
        offset = int(q.get("offset", 0))
    except ValueError:
        raise ValueError("limit and offset must be whole numbers") from None
    if not 1 <= limit <= MAX_LIMIT or offset < 0:
        raise ValueError(f"limit must be 1 to {MAX_LIMIT} and offset 0 or more")
    return filters, limit, offset


def create_app(store: PageStore, token: str, read_token: str | None = None) -> FastAPI:
    """The FastAPI app. ``token`` authorizes the webhook; ``read_token``, when given, is
    needed for every read (/pages and /) except /healthz."""
    if not token:
        raise ValueError("the pager needs a non-empty bearer token")
    if read_token is not None and not read_token:
        raise ValueError("the read token is empty")
    app = FastAPI(title="inferwatch pager", docs_url=None, redoc_url=None, openapi_url=None)
    expected = token.encode()
    expected_read = read_token.encode() if read_token else None
    warn = RateLimitedLog(log)

    @app.middleware("http")
    async def security_headers(request: Request, call_next):
        response = await call_next(request)
        response.headers.update(SECURITY_HEADERS)
        return response

    def reject(status: int, reason: str, client: str, headers: dict | None = None) -> JSONResponse:
        # One kind per status: a flood of one mistake costs one line per interval.
        warn.warning(status, "webhook rejected", {"status": status, "reason": reason, "client": client})
        return JSONResponse({"error": reason}, status_code=status, headers=headers)

    @app.post("/webhook")
    async def webhook(request: Request):
        client = request.client.host if request.client else ""
        if not hmac.compare_digest(_bearer_or_basic(request.headers.get("authorization", "")), expected):
            return reject(401, "missing or wrong bearer token", client, {"WWW-Authenticate": "Bearer"})
        try:
            declared = int(request.headers.get("content-length") or 0)
        except ValueError:
            return reject(400, "bad Content-Length", client)
        if declared > MAX_BODY:
            return reject(413, f"body larger than {MAX_BODY} bytes", client)
        # Counted as it streams in: a chunked body has no Content-Length to check first.
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY:
                return reject(413, f"body larger than {MAX_BODY} bytes", client, {"Connection": "close"})
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            payload = parse_body(raw)
        except BadPayload as exc:
            return reject(exc.status, str(exc), client)
        outcome = await run_in_threadpool(store.add, payload, raw.decode("utf-8"))
        log.info(
            {
                "stored": "notification stored",
                # Another Alertmanager's firing just after this one's resolved (its flush
                # missed the resolve): a repeat, but a genuine re-fire inside the grace
                # would look the same, so it is said apart.
                "stale": "stale firing after resolved ignored",
                "repeat": "repeated delivery ignored",
            }[outcome],
            extra={
                "fields": {
                    "receiver": payload.receiver,
                    "status": payload.status,
                    "alerts": len(payload.alerts),
                    "alertnames": sorted({a.labels.get("alertname", "") for a in payload.alerts}),
                    "group_key": payload.groupKey,
                    **(
                        {"fingerprints": sorted({a.fingerprint for a in payload.alerts})}
                        if outcome == "stale"
                        else {}
                    ),
                }
            },
        )
        return {
            "stored": outcome == "stored",
            "duplicate": outcome != "stored",
            "stale_firing": outcome == "stale",
            "alerts": len(payload.alerts),
        }

    def unauthorized_read(request: Request, html: bool) -> Response | None:
        if expected_read is None:
            return None
        got = _bearer_or_basic(request.headers.get("authorization", ""))
        if hmac.compare_digest(got, expected_read):
            return None
        client = request.client.host if request.client else ""
        warn.warning("read-401", "read rejected", {"status": 401, "path": request.url.path, "client": client})
        challenge = 'Basic realm="inferwatch pager", charset="UTF-8"' if html else "Bearer"
        return JSONResponse(
            {"error": "missing or wrong read token"}, status_code=401, headers={"WWW-Authenticate": challenge}
        )

    @app.get("/pages")
    def pages(request: Request):
        if denied := unauthorized_read(request, html=False):
            return denied
        try:
            filters, limit, offset = _query(request)
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        return {
            "pages": store.pages(filters, limit, offset),
            "counts": store.counts(filters),
            "limit": limit,
            "offset": offset,
        }

    @app.get("/", response_class=HTMLResponse)
    def index(request: Request):
        if denied := unauthorized_read(request, html=True):
            return denied
        try:
            filters, limit, offset = _query(request)
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        page = store.pages(filters, limit, offset)
        return HTMLResponse(inbox.render(page, store.counts(filters), filters, limit, offset))

    @app.get("/healthz")
    def healthz():
        store.ping()
        return {"status": "ok"}

    return app
