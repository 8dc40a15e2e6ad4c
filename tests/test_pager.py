"""``inferwatch pager``, the real process: bearer and read tokens, durable storage, alert
occurrences (repeats stored once, a fire after a resolve reopens, a second Alertmanager's
stale firing just after the resolve does not), the JSON and HTML views
with paging, every bad input a 4xx, the body limit while streaming, the header timeout,
rate-limited warnings, security headers, clean shutdown and one-line startup errors."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import sqlite3
import subprocess
import time
from pathlib import Path

import httpx

from alert_rules.pager import PageStore, WebhookPayload
from tests.fixtures.alerting import Pager, make_pager, webhook
from tests.fixtures.net import Processes, inferwatch_cmd

T0 = "2026-11-30T09:00:00.000000000Z"
STORED = {"stored": True, "duplicate": False, "stale_firing": False, "alerts": 1}
REPEAT = {"stored": False, "duplicate": True, "stale_firing": False, "alerts": 1}
GRACE = 1.5  # --resolve-grace for the tests that re-fire after it


def log_lines(pager: Pager) -> list[dict]:
    return [json.loads(line) for line in pager.log_path.read_text().splitlines() if line.startswith("{")]


def post_raw(pager: Pager, body: bytes, **headers: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {pager.token}", "Content-Type": "application/json", **headers}
    return httpx.post(pager.url + "/webhook", content=body, headers=headers, timeout=30)


def test_webhook_requires_the_bearer_token_and_warns_at_a_bounded_rate(pager: Pager) -> None:
    started = time.monotonic()
    for i in range(40):
        resp = pager.post(webhook(), token=None if i % 2 else "wrong-token")
        assert resp.status_code == 401
        assert resp.headers["www-authenticate"] == "Bearer"
    elapsed = time.monotonic() - started
    assert pager.pages() == []
    warnings = [e for e in log_lines(pager) if e["msg"] == "webhook rejected"]
    # One line per 10 s at most, not one per request.
    assert 1 <= len(warnings) <= 1 + int(elapsed / 10)
    assert warnings[0]["reason"] == "missing or wrong bearer token"


def test_a_notification_becomes_a_page_with_its_labels_and_links(pager: Pager) -> None:
    resp = pager.post(webhook())
    assert resp.status_code == 200 and resp.json() == STORED
    [page] = pager.pages()
    assert page["status"] == "firing" and page["severity"] == "critical" and page["receiver"] == "pager"
    assert (page["alertname"], page["model"], page["version"]) == ("InferenceHighErrorRate", "ranker", "2")
    assert page["labels"] == {
        "alertname": "InferenceHighErrorRate",
        "model": "ranker",
        "severity": "critical",
        "version": "2",
    }
    assert page["starts_at"] == T0 and page["ends_at"] == ""
    assert page["annotations"]["runbook_url"].endswith("/InferenceHighErrorRate.md")
    html = httpx.get(pager.url + "/", timeout=10).text
    assert "InferenceHighErrorRate" in html and "firing for " in html
    assert 'title="firing since 2026-11-30 09:00:00 UTC"' in html
    assert "At least 50% of the requests to model ranker version 2 failed" in html  # the description
    assert (
        'href="https://example.org/runbooks/InferenceHighErrorRate.md" rel="noreferrer">runbook</a>' in html
    )
    assert "var-model=ranker" in html and ">dashboard</a>" in html
    assert 'class="badge sev-critical">critical<' in html


def test_repeated_deliveries_are_stored_once(pager: Pager) -> None:
    first, again = pager.post(webhook()), pager.post(webhook())
    assert first.json()["stored"] is True
    assert again.status_code == 200 and again.json() == REPEAT
    # The same instant written another way (as a second Alertmanager might) is the same event.
    assert pager.post(webhook(startsAt="2026-11-30T10:00:00+01:00")).json()["duplicate"] is True
    body = httpx.get(pager.url + "/pages", timeout=10).json()
    assert body["counts"] | {} == {
        "pages": 1,
        "firing": 1,
        "firing_critical": 1,
        "resolved": 0,
        "notifications": 1,
        "deliveries": 3,
    }
    assert body["pages"][0]["notifications"] == 1


def sent_by(external_url: str, status: str = "firing") -> dict:
    """A notification as the Alertmanager at ``external_url`` sends it."""
    return {**webhook(status), "externalURL": external_url}


def grace_pager(tmp_path: Path, processes: Processes, grace: float = GRACE) -> Pager:
    pager = make_pager(tmp_path, processes)
    pager.args = ("--resolve-grace", str(grace))
    return pager.start()


def test_a_fire_after_a_resolve_reopens_the_page_whatever_its_starts_at(
    tmp_path: Path, processes: Processes
) -> None:
    """Finding 1: Prometheus re-sends the same startsAt after it could not reach
    Alertmanager for longer than endsAt, or after a restart that restored ``for``."""
    pager = grace_pager(tmp_path, processes)
    pager.post(webhook())
    assert pager.post(webhook("resolved")).json()["stored"] is True
    [page] = pager.pages()
    assert page["status"] == "resolved" and page["ends_at"] == "2026-11-30T09:10:00.000000000Z"
    assert page["notifications"] == 2
    # The retry of that resolved notification changes nothing.
    assert pager.post(webhook("resolved")).json()["duplicate"] is True

    # Firing again with the same startsAt after the grace: a new occurrence, listed first.
    time.sleep(GRACE + 0.5)
    assert pager.post(webhook()).json() == STORED
    reopened, old = pager.pages()
    assert (reopened["status"], reopened["starts_at"]) == ("firing", T0)
    assert (old["status"], old["ends_at"]) == ("resolved", "2026-11-30T09:10:00.000000000Z")
    assert reopened["id"] > old["id"]
    # Repeats of either earlier notification, from a retry or a second Alertmanager, are
    # still repeats: the reopened page stays open.
    assert pager.post(webhook()).json()["duplicate"] is True
    assert pager.post(webhook("resolved")).json()["duplicate"] is True
    assert [p["status"] for p in pager.pages()] == ["firing", "resolved"]
    counts = httpx.get(pager.url + "/pages", timeout=10).json()["counts"]
    assert (counts["firing"], counts["resolved"], counts["notifications"]) == (1, 1, 3)

    # It resolves again (a later endsAt): the reopened page closes.
    pager.post(webhook("resolved", endsAt="2026-11-30T09:30:00Z"))
    assert [(p["status"], p["ends_at"]) for p in pager.pages()] == [
        ("resolved", "2026-11-30T09:30:00.000000000Z"),
        ("resolved", "2026-11-30T09:10:00.000000000Z"),
    ]
    html = httpx.get(pager.url + "/", timeout=10).text
    assert "0 firing" in html and "2 resolved" in html and "lasted 30m" in html


def test_a_stale_firing_from_the_other_alertmanager_stays_on_the_resolved_page(
    tmp_path: Path, processes: Processes
) -> None:
    """Two clustered Alertmanagers: the first sends resolved, the second (its flush missed the
    resolve: prometheus/alertmanager#4008) sends the old firing one peer timeout later, then
    resolved with the same endsAt. One incident, one page, resolved. After the grace, the
    same firing is a genuine re-fire and reopens."""
    pager = grace_pager(tmp_path, processes, grace=4)
    am1, am2 = "http://am-0.example:9093", "http://am-1.example:9093"
    assert pager.post(sent_by(am1)).json() == STORED
    assert pager.post(sent_by(am2)).json() == REPEAT  # gossip missed: a repeat
    assert pager.post(sent_by(am1, "resolved")).json() == STORED
    stale = pager.post(sent_by(am2)).json()
    assert stale == {**REPEAT, "stale_firing": True}
    [page] = pager.pages()
    assert (page["status"], page["ends_at"]) == ("resolved", "2026-11-30T09:10:00.000000000Z")
    assert page["notifications"] == 2  # one firing, one resolved: the stale one changed nothing
    # The second instance resolves it too, with Prometheus' endsAt: a repeat.
    assert pager.post(sent_by(am2, "resolved")).json() == REPEAT
    counts = httpx.get(pager.url + "/pages", timeout=10).json()["counts"]
    assert (counts["pages"], counts["firing"], counts["resolved"]) == (1, 0, 1)
    assert (counts["notifications"], counts["deliveries"]) == (2, 5)
    html = httpx.get(pager.url + "/", timeout=10).text
    assert "0 firing" in html and "1 resolved" in html
    [line] = [r for r in log_lines(pager) if r["msg"].startswith("stale firing")]
    assert line["msg"] == "stale firing after resolved ignored"
    assert line["fingerprints"] == ["4d0f0a1c2b3e4f50"]
    # Within the grace a firing with another startsAt is a new occurrence all the same.
    other = webhook(startsAt="2026-11-30T09:20:00Z", fingerprint="other-fp")
    assert pager.post(other).json() == STORED

    # Past the grace: Prometheus re-sends the same startsAt after an outage; it reopens.
    time.sleep(4.5)
    assert pager.post(sent_by(am1)).json() == STORED
    assert pager.post(sent_by(am2)).json() == REPEAT
    pages = [p for p in pager.pages() if p["fingerprint"] == "4d0f0a1c2b3e4f50"]
    assert [p["status"] for p in pages] == ["firing", "resolved"]


def test_the_resolve_grace_is_a_flag_or_an_environment_variable(tmp_path: Path) -> None:
    from alert_rules.pager.server import RESOLVE_GRACE_ENV

    token = tmp_path / "t"
    token.write_text("tok\n")
    for env, args, message in [
        ("abc", (), f"{RESOLVE_GRACE_ENV} must be a number of seconds, not 'abc'"),
        ("-1", (), f"{RESOLVE_GRACE_ENV} must be between 0 and 86400 seconds"),
        ("nan", (), f"{RESOLVE_GRACE_ENV} must be between 0 and 86400 seconds"),
        ("5", ("--resolve-grace", "1e9"), "--resolve-grace must be between 0 and 86400 seconds"),
    ]:
        proc = subprocess.run(
            inferwatch_cmd("pager", "--token-file", str(token), "--db", str(tmp_path / "db"), *args),
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, RESOLVE_GRACE_ENV: env},
        )
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip() == f"inferwatch: error: {message}"


def test_the_resolve_grace_from_the_environment_reaches_the_store(
    tmp_path: Path, processes: Processes, monkeypatch
) -> None:
    from alert_rules.pager.server import RESOLVE_GRACE_ENV

    pager = make_pager(tmp_path, processes)
    # Pager.start passes the test process' environment on to the pager.
    monkeypatch.setenv(RESOLVE_GRACE_ENV, "0")
    pager.start()
    assert [r["resolve_grace_s"] for r in log_lines(pager) if r["msg"] == "pager starting"] == [0.0]
    pager.post(webhook())
    pager.post(webhook("resolved"))
    assert pager.post(webhook()).json() == STORED  # grace 0: every re-fire reopens


def test_a_later_start_while_open_ends_the_earlier_occurrence(pager: Pager) -> None:
    pager.post(webhook())
    # The resolved notification was lost; the alert fires again with a new startsAt.
    pager.post(webhook(startsAt="2026-11-30T10:00:00Z"))
    new, old = pager.pages()
    assert (new["status"], new["starts_at"]) == ("firing", "2026-11-30T10:00:00.000000000Z")
    assert (old["status"], old["ends_at"]) == ("resolved", "2026-11-30T10:00:00.000000000Z")
    # A late firing for the earlier start changes nothing.
    assert pager.post(webhook()).json()["duplicate"] is True
    assert [p["status"] for p in pager.pages()] == ["firing", "resolved"]


def test_a_resolved_notification_for_an_unseen_firing_is_kept(pager: Pager) -> None:
    assert pager.post(webhook("resolved")).json()["stored"] is True
    [page] = pager.pages()
    assert (page["status"], page["starts_at"]) == ("resolved", T0)


def _many(n_info: int) -> dict:
    """One notification: a critical alert and ``n_info`` info alerts for as many GPUs."""
    payload = webhook()
    info = {
        "status": "firing",
        "annotations": {"summary": "GPU framebuffer above 90%"},
        "startsAt": "2026-11-30T08:00:00Z",
        "endsAt": "0001-01-01T00:00:00Z",
        "generatorURL": "",
    }
    payload["alerts"] = [
        {
            **info,
            "labels": {"alertname": "GPUMemoryPressure", "severity": "info", "gpu": str(i), "Hostname": "h1"},
            "fingerprint": f"gpu{i:04d}",
        }
        for i in range(n_info)
    ] + payload["alerts"]  # the critical one last, as Alertmanager may order it
    return payload


def test_counts_come_from_the_database_and_the_inbox_pages_through_all(pager: Pager) -> None:
    """Finding 2: 1 critical + 500 info in one notification, 2 resolved elsewhere."""
    assert pager.post(_many(500)).status_code == 200
    for fp in ("r1", "r2"):
        pager.post(webhook("resolved", fingerprint=fp, labels={"alertname": "X", "severity": "warning"}))
    body = httpx.get(pager.url + "/pages", params={"limit": "5000"}, timeout=10).json()
    assert len(body["pages"]) == 503
    assert body["counts"]["firing"] == 501 and body["counts"]["resolved"] == 2
    # Firing first, critical first among them; resolved last.
    statuses = [(p["status"], p["severity"]) for p in body["pages"]]
    assert statuses[0] == ("firing", "critical")
    assert statuses[-2:] == [("resolved", "warning"), ("resolved", "warning")]

    html = httpx.get(pager.url + "/", timeout=10).text
    assert "501 firing</span>\n(1 critical), 2 resolved" in html
    assert "Showing 1&ndash;100 of 503" in html
    assert html.index("InferenceHighErrorRate") < html.index("GPUMemoryPressure")
    assert 'href="?limit=100&amp;offset=100">older</a>' in html
    last = httpx.get(pager.url + "/", params={"offset": "500"}, timeout=10).text
    assert "Showing 501&ndash;503 of 503" in last and ">newer</a>" in last and ">older</a>" not in last
    assert last.count('<tr class="resolved') == 2
    # Filters narrow the counts too.
    info = httpx.get(pager.url + "/", params={"severity": "info", "limit": "10"}, timeout=10).text
    assert "500 firing</span>\n(0 critical), 0 resolved matching severity=info" in info
    assert "Showing 1&ndash;10 of 500" in info
    for bad in ({"limit": "0"}, {"offset": "-1"}, {"limit": "x"}, {"colour": "red"}):
        resp = httpx.get(pager.url + "/pages", params=bad, timeout=10)
        assert resp.status_code == 400, bad
    resp = httpx.get(pager.url + "/pages", params={"colour": "red"}, timeout=10)
    assert "unknown filter 'colour'" in resp.json()["error"]


def test_filters(pager: Pager) -> None:
    pager.post(webhook())
    info = webhook(
        fingerprint="aa11", labels={"alertname": "GPUMemoryPressure", "severity": "info", "gpu": "0"}
    )
    info["receiver"] = "low-urgency"
    pager.post(info)
    assert [p["alertname"] for p in pager.pages(severity="info")] == ["GPUMemoryPressure"]
    assert [p["alertname"] for p in pager.pages(model="ranker", version="2")] == ["InferenceHighErrorRate"]
    assert [p["alertname"] for p in pager.pages(receiver="low-urgency")] == ["GPUMemoryPressure"]
    assert len(pager.pages(limit="1")) == 1
    assert [p["alertname"] for p in pager.pages(limit="1", offset="1")] == ["GPUMemoryPressure"]


def test_every_bad_input_gets_a_4xx_and_a_log_line_and_stores_nothing(pager: Pager) -> None:
    """Finding 4: a 500 makes Alertmanager retry the same body for ever."""
    surrogate = json.dumps(webhook()).replace("InferenceHighErrorRate", "\\ud800", 1).encode()
    no_fingerprint = webhook()
    del no_fingerprint["alerts"][0]["fingerprint"]
    cases: list[tuple[bytes, int, str]] = [
        (b"{not json", 400, "not JSON"),
        (b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
        (json.dumps(webhook()).encode("utf-16"), 400, "not UTF-8"),
        (json.dumps(webhook()).encode("utf-32"), 400, "not UTF-8"),
        (surrogate, 422, "lone surrogate"),
        (json.dumps(webhook(startsAt="yesterday")).encode(), 422, "alerts.0.startsAt: 'yesterday' is not"),
        (json.dumps(webhook(startsAt="2026-02-30T00:00:00Z")).encode(), 422, "not a valid date"),
        (json.dumps(webhook(startsAt=1764493200)).encode(), 422, "alerts.0.startsAt"),
        (json.dumps(webhook(endsAt="never")).encode(), 422, "alerts.0.endsAt"),
        (json.dumps(webhook(labels={"severity": 2})).encode(), 422, "alerts.0.labels.severity"),
        (json.dumps(webhook() | {"version": "3"}).encode(), 422, "version"),
        (json.dumps(webhook() | {"alerts": []}).encode(), 422, "alerts"),
        (json.dumps(no_fingerprint).encode(), 422, "fingerprint"),
        (b"[]", 422, "not an Alertmanager v4 payload"),
        (b'"\\ud800"', 422, "not an Alertmanager v4 payload"),
        (b"x" * (17 * 1024 * 1024), 413, "body larger than"),
    ]
    for body, status, message in cases:
        resp = post_raw(pager, body)
        assert (resp.status_code, message in resp.json()["error"]) == (status, True), (body[:60], resp.text)
    assert pager.pages() == []
    rejected = [e for e in log_lines(pager) if e["msg"] == "webhook rejected"]
    assert {e["status"] for e in rejected} == {400, 413, 422}
    assert httpx.get(pager.url + "/healthz", timeout=10).json() == {"status": "ok"}
    # And the pager still stores a good one.
    assert pager.post(webhook()).json()["stored"] is True


def _chunked_request(pager: Pager, headers: str = "") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", pager.port), timeout=30)
    sock.sendall(
        (
            f"POST /webhook HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {pager.token}\r\n"
            f"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n{headers}\r\n"
        ).encode()
    )
    return sock


def test_the_body_limit_holds_while_a_chunked_body_streams(pager: Pager) -> None:
    """Finding 4: the limit used to be checked after reading the whole body. Here the
    body never ends: the 413 must come while it is still being sent."""
    sock = _chunked_request(pager)
    chunk = b"x" * (1024 * 1024)
    try:
        for _ in range(17):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        answer = b""
        # The answer, up to the reset that closing with unread input sends.
        while b"}" not in answer:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            answer += data
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:100]
    assert b"body larger than 16777216 bytes" in answer


def test_half_sent_headers_are_cut_off_after_the_header_timeout(tmp_path: Path, processes: Processes) -> None:
    pager = make_pager(tmp_path, processes)
    pager.args = ("--header-timeout", "1")
    pager.start()
    socks = [socket.create_connection(("127.0.0.1", pager.port), timeout=30) for _ in range(20)]
    for s in socks:
        s.sendall(b"POST /webhook HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    # Each connection is closed by the pager (recv returns b"" at EOF) without an answer.
    for s in socks:
        assert s.recv(100) == b""
        s.close()
    # A request sent in time on a new connection is answered.
    assert pager.post(webhook()).status_code == 200


def test_reads_need_the_read_token_when_one_is_configured(tmp_path: Path, processes: Processes) -> None:
    pager = make_pager(tmp_path, processes)
    read_token_file = tmp_path / "read.token"
    read_token_file.write_text("read-only-token\n")
    pager.args = ("--read-token-file", str(read_token_file))
    pager.start()
    assert pager.post(webhook()).status_code == 200  # the webhook token still posts
    for path in ("/pages", "/"):
        for headers in ({}, {"Authorization": f"Bearer {pager.token}"}, {"Authorization": "Bearer nope"}):
            resp = httpx.get(pager.url + path, headers=headers, timeout=10)
            assert resp.status_code == 401, (path, headers)
            assert "InferenceHighErrorRate" not in resp.text
    assert httpx.get(pager.url + "/", timeout=10).headers["www-authenticate"].startswith("Basic ")
    ok = httpx.get(pager.url + "/pages", headers={"Authorization": "Bearer read-only-token"}, timeout=10)
    assert ok.status_code == 200 and len(ok.json()["pages"]) == 1
    basic = base64.b64encode(b"oncall:read-only-token").decode()
    ok = httpx.get(pager.url + "/", headers={"Authorization": f"Basic {basic}"}, timeout=10)
    assert ok.status_code == 200 and "InferenceHighErrorRate" in ok.text
    # The read token cannot post, and health checks need no token.
    assert pager.post(webhook(), token="read-only-token").status_code == 401
    assert httpx.get(pager.url + "/healthz", timeout=10).status_code == 200


def test_security_headers_and_no_openapi(pager: Pager) -> None:
    for path in ("/", "/pages", "/healthz"):
        resp = httpx.get(pager.url + path, timeout=10)
        assert resp.headers["x-frame-options"] == "DENY"
        assert resp.headers["x-content-type-options"] == "nosniff"
        csp = resp.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp and "script-src" not in csp
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(pager.url + path, timeout=10).status_code == 404


def test_pages_survive_a_restart_and_sigterm_is_clean(pager: Pager) -> None:
    pager.post(webhook())
    assert pager.stop() == 0  # SIGTERM
    assert log_lines(pager)[-1]["msg"] == "pager stopped"
    pager.start()
    [page] = pager.pages()
    assert page["status"] == "firing" and page["labels"]["model"] == "ranker"
    # The repeat of a notification stored before the restart is still recognised.
    assert pager.post(webhook()).json()["duplicate"] is True
    assert pager.procs.stop(pager.proc, signal.SIGINT) == 0


def test_html_escapes_what_alerts_carry(pager: Pager) -> None:
    evil = webhook(
        annotations={
            "summary": "<script>alert(1)</script>",
            "description": '"><img src=x onerror=alert(1)>',
            "runbook_url": "javascript:alert(1)",
        }
    )
    pager.post(evil)
    html = httpx.get(pager.url + "/", timeout=10).text
    assert "<script>alert(1)</script>" not in html and "&lt;script&gt;" in html
    assert "<img" not in html and "javascript:" not in html


def test_a_schema_1_database_is_carried_over(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "old.db")
    db.executescript(
        """
        CREATE TABLE notifications (id INTEGER PRIMARY KEY, dedupe_key TEXT NOT NULL UNIQUE,
            received_at TEXT NOT NULL, receiver TEXT NOT NULL, status TEXT NOT NULL,
            group_key TEXT NOT NULL, deliveries INTEGER NOT NULL DEFAULT 1, payload TEXT NOT NULL);
        CREATE TABLE pages (id INTEGER PRIMARY KEY, receiver TEXT NOT NULL, fingerprint TEXT NOT NULL,
            starts_at TEXT NOT NULL, ends_at TEXT NOT NULL, status TEXT NOT NULL, alertname TEXT NOT NULL,
            severity TEXT NOT NULL, model TEXT NOT NULL, labels TEXT NOT NULL, annotations TEXT NOT NULL,
            first_received_at TEXT NOT NULL, last_received_at TEXT NOT NULL,
            notifications INTEGER NOT NULL DEFAULT 1, UNIQUE (receiver, fingerprint, starts_at));
        CREATE INDEX pages_last ON pages (last_received_at);
        INSERT INTO notifications
            VALUES (1, 'k', '2026-11-30T09:00:01.000+00:00', 'pager', 'firing', 'g', 2, '{}');
        INSERT INTO pages VALUES (1, 'pager', 'fp1', '2026-11-30T09:00:00Z', '0001-01-01T00:00:00Z', 'firing',
            'InferenceHighErrorRate', 'critical', 'ranker', '{"model": "ranker", "version": "2"}', '{}',
            '2026-11-30T09:00:01.000+00:00', '2026-11-30T09:00:01.000+00:00', 1);
        """
    )
    db.close()
    store = PageStore(tmp_path / "old.db")
    [page] = store.pages({})
    assert store._db.execute("PRAGMA user_version").fetchone()[0] == 3
    assert (page["fingerprint"], page["starts_at"], page["version"]) == ("fp1", T0, "2")
    counts = store.counts()
    assert (counts["firing"], counts["notifications"], counts["deliveries"]) == (1, 1, 2)
    store.close()


def test_a_schema_2_database_gets_the_resolve_time(tmp_path: Path) -> None:
    store = PageStore(tmp_path / "v2.db")
    for status in ("firing", "resolved"):
        payload = WebhookPayload.model_validate(webhook(status))
        store.add(payload, json.dumps(webhook(status)))
    store._db.executescript(
        "ALTER TABLE occurrences DROP COLUMN resolved_received_at; PRAGMA user_version = 2;"
    )
    store.close()
    store = PageStore(tmp_path / "v2.db")
    [row] = store._db.execute("SELECT last_received_at, resolved_received_at FROM occurrences")
    assert row[1] == row[0] != ""
    store.close()


def _pager_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(inferwatch_cmd("pager", *args), capture_output=True, text=True, timeout=60)


def test_startup_errors_are_one_line(tmp_path: Path, pager: Pager) -> None:
    token = tmp_path / "t"
    token.write_text("tok\n")
    (tmp_path / "file").write_text("")
    busy = f"cannot listen on 127.0.0.1:{pager.port}: Address already in use"
    cases: list[tuple[tuple[str, ...], int, str]] = [
        (("--token-file", str(tmp_path / "nope")), 2, f"cannot read the token file {tmp_path / 'nope'}: "),
        (("--token-file", str(token), "--db", str(tmp_path / "file" / "db")), 1, "cannot use the database"),
        (("--token-file", str(token), "--port", str(pager.port)), 1, busy),
        (("--token-file", str(token), "--read-token-file", str(token)), 2, "must differ"),
        (("--token-file", str(token), "--header-timeout", "0"), 2, "--header-timeout"),
    ]
    for args, code, message in cases:
        proc = _pager_cli("--db", str(tmp_path / "db"), *args) if "--db" not in args else _pager_cli(*args)
        assert proc.returncode == code, (args, proc.stderr)
        [line] = proc.stderr.strip().splitlines()
        assert line.startswith("inferwatch: error: ") and message in line, line
