"""``inferwatch pager``: the on-call inbox of the local stack.

An Alertmanager webhook receiver (payload version 4) that requires a bearer token, stores
every notification in SQLite before answering (so an acknowledged page survives a crash
or restart, and an unacknowledged one is retried by Alertmanager), applies each alert's
event once however often it is delivered, and shows the pages, worst first.

  payload.py  the webhook payload and every way a body can be refused (4xx, never 500)
  store.py    SQLite: notifications and pages (alert occurrences), idempotent events,
              a stale firing after resolved (clustered Alertmanagers) kept off new pages
  web.py      the HTTP API: auth, body limit, security headers, /pages and the inbox
  inbox.py    the HTML inbox
  server.py   the process: tokens, socket, uvicorn with a header timeout, shutdown
"""

from .payload import BadPayload, WebhookAlert, WebhookPayload, parse_body
from .server import (
    READ_TOKEN_ENV,
    RESOLVE_GRACE_ENV,
    TOKEN_ENV,
    main,
    new_token_file,
    read_token,
    serve,
)
from .store import DEFAULT_RESOLVE_GRACE, PageStore
from .web import MAX_BODY, create_app

__all__ = [
    "DEFAULT_RESOLVE_GRACE",
    "MAX_BODY",
    "READ_TOKEN_ENV",
    "RESOLVE_GRACE_ENV",
    "TOKEN_ENV",
    "BadPayload",
    "PageStore",
    "WebhookAlert",
    "WebhookPayload",
    "create_app",
    "main",
    "new_token_file",
    "parse_body",
    "read_token",
    "serve",
]
