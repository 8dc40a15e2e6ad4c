"""The pager's SQLite store: notifications as received, and pages (alert occurrences).

A page is one occurrence of an alert at one receiver: it opens with a firing notification
and closes with a resolved one. Deliveries can repeat (Alertmanager retries a delivery
whose answer it did not get; two clustered Alertmanagers can both send one), so every
alert in a notification is an event applied at most once:

- firing (fingerprint, startsAt): a repeat while that occurrence is open; after the
  fingerprint's latest occurrence was resolved it opens a new occurrence, whatever its
  startsAt. Prometheus re-sends the same startsAt when it could not reach Alertmanager
  for longer than the alert's endsAt, or after a restart that restored the ``for`` state,
  so "same startsAt" does not mean "same occurrence".
- except a stale firing: the same startsAt as the resolved latest occurrence, received
  within ``resolve_grace`` seconds of that occurrence's first resolved delivery. A second
  clustered Alertmanager whose flush missed the resolve sends exactly that, one peer
  timeout after the first one's resolved (prometheus/alertmanager#4008, #2447), and its
  payload is the same as a genuine re-fire's but for externalURL, which replicas may
  share. A genuine re-fire with the same startsAt needs Prometheus to have been cut off
  for longer than the alert's endsAt horizon, so it comes later. A stale firing is a
  repeat delivery of the resolved occurrence: it changes no page.
- resolved (fingerprint, startsAt, endsAt): a repeat when an occurrence already ended
  with exactly that; else it closes the open occurrence with that startsAt (or is
  recorded as one that opened and closed unseen).

One Alertmanager sends a group's notifications in order, so its own retries cannot put
a firing after its resolved.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

from inferwatch import contract as c

from .payload import WebhookAlert, WebhookPayload, normalize_time

SCHEMA_VERSION = 3
# How long after an occurrence's resolved delivery a firing with its startsAt is taken for
# a stale one: Alertmanager's default --cluster.peer-timeout (15 s) plus the critical
# route's group_interval (1 m).
DEFAULT_RESOLVE_GRACE = 75.0
_SCHEMA = """
CREATE TABLE IF NOT EXISTS notifications (
    id INTEGER PRIMARY KEY,
    received_at TEXT NOT NULL,
    receiver TEXT NOT NULL,
    status TEXT NOT NULL,
    group_key TEXT NOT NULL,
    payload TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS occurrences (
    id INTEGER PRIMARY KEY,
    receiver TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    starts_at TEXT NOT NULL,
    ends_at TEXT NOT NULL,
    status TEXT NOT NULL,
    alertname TEXT NOT NULL,
    severity TEXT NOT NULL,
    model TEXT NOT NULL,
    version TEXT NOT NULL,
    labels TEXT NOT NULL,
    annotations TEXT NOT NULL,
    first_received_at TEXT NOT NULL,
    last_received_at TEXT NOT NULL,
    notifications INTEGER NOT NULL DEFAULT 1,
    resolved_received_at TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS occurrences_alert ON occurrences (receiver, fingerprint, starts_at);
CREATE INDEX IF NOT EXISTS occurrences_status ON occurrences (status, severity);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""
FILTERS = ("status", "severity", "alertname", "model", "version", "receiver")
# Firing first, then by severity, then the most recent activity.
_ORDER = (
    " ORDER BY status = 'firing' DESC,"
    " CASE severity WHEN 'critical' THEN 0 WHEN 'warning' THEN 1 WHEN 'info' THEN 2 ELSE 3 END,"
    " last_received_at DESC, id DESC"
)


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class PageStore:
    """SQLite, one connection guarded by a lock; every write is committed (WAL, synchronous
    FULL) before the webhook answers, so an answered notification is on disk."""

    def __init__(self, path: Path, resolve_grace: float = DEFAULT_RESOLVE_GRACE) -> None:
        if not 0 <= resolve_grace <= 86400:
            raise ValueError("the resolve grace must be between 0 and 86400 seconds")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.resolve_grace = timedelta(seconds=resolve_grace)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._migrate()

    def _migrate(self) -> None:
        db = self._db
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise sqlite3.DatabaseError(f"written by a newer pager (schema {version})")
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        db.execute("BEGIN IMMEDIATE")
        try:
            if version < SCHEMA_VERSION and "pages" in tables:
                # Schema 1 kept one row per (receiver, fingerprint, startsAt) forever.
                db.execute("ALTER TABLE notifications RENAME TO notifications_v1")
                db.execute("DROP INDEX IF EXISTS pages_last")
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            if version < SCHEMA_VERSION and "pages" in tables:
                self._copy_v1()
            columns = {r[1] for r in db.execute("PRAGMA table_info(occurrences)")}
            if "resolved_received_at" not in columns:
                db.execute("ALTER TABLE occurrences ADD COLUMN resolved_received_at TEXT NOT NULL DEFAULT ''")
            if version < 3:
                # Schema 2 and 1 did not keep it; the last delivery is the closest we have.
                db.execute(
                    "UPDATE occurrences SET resolved_received_at = last_received_at"
                    " WHERE status = 'resolved' AND resolved_received_at = ''"
                )
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def _copy_v1(self) -> None:
        db = self._db
        db.execute(
            "INSERT INTO notifications (received_at, receiver, status, group_key, payload)"
            " SELECT received_at, receiver, status, group_key, payload FROM notifications_v1 ORDER BY id"
        )
        delivered = db.execute("SELECT COALESCE(SUM(deliveries), 0) FROM notifications_v1").fetchone()[0]
        db.execute("INSERT OR REPLACE INTO counters VALUES ('deliveries', ?)", (delivered,))
        for r in db.execute("SELECT * FROM pages ORDER BY id").fetchall():
            labels = json.loads(r["labels"])
            db.execute(
                "INSERT INTO occurrences (receiver, fingerprint, starts_at, ends_at, status, alertname,"
                " severity, model, version, labels, annotations, first_received_at, last_received_at,"
                " notifications) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    r["receiver"],
                    r["fingerprint"],
                    _normalized(r["starts_at"]),
                    _normalized(r["ends_at"]),
                    r["status"],
                    r["alertname"],
                    r["severity"],
                    r["model"],
                    labels.get(c.L_VERSION, ""),
                    r["labels"],
                    r["annotations"],
                    r["first_received_at"],
                    r["last_received_at"],
                    r["notifications"],
                ),
            )
        db.execute("DROP TABLE pages")
        db.execute("DROP TABLE notifications_v1")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def ping(self) -> None:
        with self._lock:
            self._db.execute("SELECT 1").fetchone()

    def add(self, payload: WebhookPayload, raw: str) -> str:
        """Applies a notification's alerts: ``stored`` when one changed a page (then the
        notification is kept), ``stale`` when one was a stale firing and none changed a
        page (a repeat, said apart for the log), else ``repeat``."""
        now = now_iso()
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute(
                    "INSERT INTO counters VALUES ('deliveries', 1)"
                    " ON CONFLICT (name) DO UPDATE SET value = value + 1"
                )
                outcomes = {self._apply(payload.receiver, a, now) for a in payload.alerts}
                outcome = next((o for o in ("stored", "stale") if o in outcomes), "repeat")
                if outcome == "stored":
                    db.execute(
                        "INSERT INTO notifications (received_at, receiver, status, group_key, payload)"
                        " VALUES (?, ?, ?, ?, ?)",
                        (now, payload.receiver, payload.status, payload.groupKey, raw),
                    )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return outcome

    def _apply(self, receiver: str, a: WebhookAlert, now: str) -> str:
        db = self._db
        fp = (receiver, a.fingerprint)
        annotations = json.dumps(a.annotations, sort_keys=True)
        if a.status == "firing":
            latest = db.execute(
                "SELECT id, status, starts_at, resolved_received_at FROM occurrences"
                " WHERE receiver = ? AND fingerprint = ? ORDER BY id DESC LIMIT 1",
                fp,
            ).fetchone()
            if latest and latest["status"] == "resolved" and self._stale(a, latest, now):
                return "stale"  # a repeat of the page's firing state, from a lagging replica
            if latest and latest["status"] == "firing":
                if a.startsAt <= latest["starts_at"]:
                    return "repeat"  # a repeat, or news older than the open occurrence
                # A later start while open: the earlier occurrence ended and its resolved
                # notification never came; it ended by this start at the latest.
                db.execute(
                    "UPDATE occurrences SET status = 'resolved', ends_at = ?, resolved_received_at = ?"
                    " WHERE id = ?",
                    (a.startsAt, now, latest["id"]),
                )
            self._insert(receiver, a, annotations, now)
            return "stored"
        seen = db.execute(
            "SELECT 1 FROM occurrences WHERE receiver = ? AND fingerprint = ? AND starts_at = ?"
            " AND status = 'resolved' AND ends_at = ?",
            (*fp, a.startsAt, a.endsAt),
        ).fetchone()
        if seen:
            return "repeat"
        cur = db.execute(
            "UPDATE occurrences SET status = 'resolved', ends_at = ?, annotations = ?,"
            " last_received_at = ?, notifications = notifications + 1, resolved_received_at = ?"
            " WHERE id = (SELECT id FROM occurrences WHERE receiver = ? AND fingerprint = ?"
            " AND starts_at = ? AND status = 'firing' ORDER BY id DESC LIMIT 1)",
            (a.endsAt, annotations, now, now, *fp, a.startsAt),
        )
        if cur.rowcount == 0:
            self._insert(receiver, a, annotations, now)
        return "stored"

    def _stale(self, a: WebhookAlert, latest: sqlite3.Row, now: str) -> bool:
        """Whether firing ``a`` is a stale copy of the resolved occurrence ``latest``: the
        same startsAt, received within the grace after that occurrence's resolve."""
        if a.startsAt != latest["starts_at"] or not latest["resolved_received_at"]:
            return False
        since = datetime.fromisoformat(now) - datetime.fromisoformat(latest["resolved_received_at"])
        return since <= self.resolve_grace

    def _insert(self, receiver: str, a: WebhookAlert, annotations: str, now: str) -> None:
        self._db.execute(
            "INSERT INTO occurrences (receiver, fingerprint, starts_at, ends_at, status, alertname,"
            " severity, model, version, labels, annotations, first_received_at, last_received_at,"
            " resolved_received_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                receiver,
                a.fingerprint,
                a.startsAt,
                a.endsAt,
                a.status,
                a.labels.get("alertname", ""),
                a.labels.get("severity", ""),
                a.labels.get(c.L_MODEL, ""),
                a.labels.get(c.L_VERSION, ""),
                json.dumps(a.labels, sort_keys=True),
                annotations,
                now,
                now,
                now if a.status == "resolved" else "",
            ),
        )

    @staticmethod
    def _where(filters: dict[str, str]) -> tuple[str, tuple[str, ...]]:
        unknown = set(filters) - set(FILTERS)
        if unknown:
            raise ValueError(f"unknown filter {sorted(unknown)[0]!r}")
        where = " AND ".join(f"{k} = ?" for k in filters)
        return (f" WHERE {where}" if where else ""), tuple(filters.values())

    def pages(self, filters: dict[str, str], limit: int = 100, offset: int = 0) -> list[dict]:
        """Pages matching ``filters``: firing first, then by severity, then the latest."""
        where, args = self._where(filters)
        sql = f"SELECT * FROM occurrences{where}{_ORDER} LIMIT ? OFFSET ?"
        with self._lock:
            rows = self._db.execute(sql, (*args, limit, offset)).fetchall()
        return [
            {
                "id": r["id"],
                "receiver": r["receiver"],
                "fingerprint": r["fingerprint"],
                "status": r["status"],
                "alertname": r["alertname"],
                "severity": r["severity"],
                "model": r["model"],
                "version": r["version"],
                "labels": json.loads(r["labels"]),
                "annotations": json.loads(r["annotations"]),
                "starts_at": r["starts_at"],
                "ends_at": r["ends_at"] if r["status"] == "resolved" else "",
                "first_received_at": r["first_received_at"],
                "last_received_at": r["last_received_at"],
                "notifications": r["notifications"],
            }
            for r in rows
        ]

    def counts(self, filters: dict[str, str] | None = None) -> dict[str, int]:
        """Pages by status (matching ``filters``), notifications stored, deliveries received."""
        where, args = self._where(filters or {})
        with self._lock:
            by_status = dict(
                self._db.execute(f"SELECT status, COUNT(*) FROM occurrences{where} GROUP BY status", args)
            )
            critical = self._db.execute(
                "SELECT COUNT(*) FROM occurrences"
                + (where + " AND" if where else " WHERE")
                + " status = 'firing' AND severity = 'critical'",
                args,
            ).fetchone()[0]
            notifications = self._db.execute("SELECT COUNT(*) FROM notifications").fetchone()[0]
            row = self._db.execute("SELECT value FROM counters WHERE name = 'deliveries'").fetchone()
        firing, resolved = by_status.get("firing", 0), by_status.get("resolved", 0)
        return {
            "pages": firing + resolved,
            "firing": firing,
            "firing_critical": critical,
            "resolved": resolved,
            "notifications": notifications,
            "deliveries": row[0] if row else 0,
        }


def _normalized(text: str) -> str:
    try:
        return normalize_time(text)
    except ValueError:
        return text
