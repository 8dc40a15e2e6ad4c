"""``inferwatch pager``, the real process: bearer token, durable and idempotent storage,
the JSON and HTML views, bad input, clean shutdown."""

from __future__ import annotations

import json
import signal

import httpx

from tests.fixtures.alerting import Pager, webhook
from tests.fixtures.net import inferwatch_cmd


def test_webhook_requires_the_bearer_token(pager: Pager) -> None:
    for token in (None, "wrong-token"):
        resp = pager.post(webhook(), token=token)
        assert resp.status_code == 401
        assert resp.headers["www-authenticate"] == "Bearer"
    assert pager.pages() == []
    assert "missing or wrong bearer token" in pager.log_path.read_text()


def test_a_notification_becomes_a_page_with_its_labels_and_links(pager: Pager) -> None:
    resp = pager.post(webhook())
    assert resp.status_code == 200 and resp.json() == {"stored": True, "duplicate": False, "alerts": 1}
    [page] = pager.pages()
    assert page["status"] == "firing" and page["severity"] == "critical" and page["receiver"] == "pager"
    assert page["alertname"] == "InferenceHighErrorRate"
    assert page["labels"] == {
        "alertname": "InferenceHighErrorRate",
        "model": "ranker",
        "severity": "critical",
        "version": "2",
    }
    assert page["annotations"]["runbook_url"].endswith("/InferenceHighErrorRate.md")
    html = httpx.get(pager.url + "/", timeout=10).text
    assert "InferenceHighErrorRate" in html and "firing" in html
    assert '<a href="https://example.org/runbooks/InferenceHighErrorRate.md">runbook</a>' in html
    assert "var-model=ranker" in html and ">dashboard</a>" in html


def test_repeated_deliveries_are_stored_once(pager: Pager) -> None:
    first, again = pager.post(webhook()), pager.post(webhook())
    assert first.json()["stored"] is True
    assert again.status_code == 200 and again.json() == {"stored": False, "duplicate": True, "alerts": 1}
    body = httpx.get(pager.url + "/pages", timeout=10).json()
    assert body["counts"] == {"notifications": 1, "deliveries": 2, "pages": 1}
    assert body["pages"][0]["notifications"] == 1


def test_resolved_closes_the_page_and_a_late_firing_retry_does_not_reopen_it(pager: Pager) -> None:
    pager.post(webhook())
    assert pager.post(webhook("resolved")).json()["stored"] is True
    [page] = pager.pages()
    assert page["status"] == "resolved" and page["ends_at"] == "2026-11-30T09:10:00.000Z"
    assert page["notifications"] == 2
    # A firing delivery that arrives late (different endsAt, so not a byte-for-byte repeat).
    pager.post(webhook("firing", endsAt="2026-11-30T09:04:00.000Z"))
    assert pager.pages()[0]["status"] == "resolved"
    # A new occurrence of the same alert (a new startsAt) is a new page.
    pager.post(webhook("firing", startsAt="2026-11-30T10:00:00.000Z"))
    assert [p["status"] for p in pager.pages()] == ["firing", "resolved"]
    assert [p["status"] for p in pager.pages(status="resolved")] == ["resolved"]
    assert "resolved" in httpx.get(pager.url + "/", timeout=10).text


def test_filters(pager: Pager) -> None:
    pager.post(webhook())
    info = webhook(
        fingerprint="aa11", labels={"alertname": "GPUMemoryPressure", "severity": "info", "gpu": "0"}
    )
    info["receiver"] = "low-urgency"
    pager.post(info)
    assert [p["alertname"] for p in pager.pages(severity="info")] == ["GPUMemoryPressure"]
    assert [p["alertname"] for p in pager.pages(model="ranker")] == ["InferenceHighErrorRate"]
    assert [p["alertname"] for p in pager.pages(receiver="low-urgency")] == ["GPUMemoryPressure"]
    assert len(pager.pages(limit="1")) == 1
    resp = httpx.get(pager.url + "/pages", params={"colour": "red"}, timeout=10)
    assert resp.status_code == 400 and "unknown filter 'colour'" in resp.json()["error"]


def test_malformed_payloads_get_a_4xx_and_a_log_line_and_store_nothing(pager: Pager) -> None:
    headers = {"Authorization": f"Bearer {pager.token}", "Content-Type": "application/json"}
    resp = httpx.post(pager.url + "/webhook", content=b"{not json", headers=headers, timeout=10)
    assert resp.status_code == 400 and "not JSON" in resp.json()["error"]
    bad_version = webhook() | {"version": "3"}
    resp = pager.post(bad_version)
    assert resp.status_code == 422 and "version" in resp.json()["error"]
    resp = pager.post(webhook() | {"alerts": []})
    assert resp.status_code == 422 and "alerts" in resp.json()["error"]
    resp = httpx.post(pager.url + "/webhook", content=b"x" * (17 * 1024 * 1024), headers=headers, timeout=30)
    assert resp.status_code == 413
    no_fingerprint = webhook()
    del no_fingerprint["alerts"][0]["fingerprint"]
    assert pager.post(no_fingerprint).status_code == 422
    assert pager.pages() == []
    logged = [json.loads(line) for line in pager.log_path.read_text().splitlines() if line.startswith("{")]
    rejected = [e for e in logged if e["msg"] == "webhook rejected"]
    assert [e["status"] for e in rejected] == [400, 422, 422, 413, 422]
    assert httpx.get(pager.url + "/healthz", timeout=10).json() == {"status": "ok"}


def test_pages_survive_a_restart_and_sigterm_is_clean(pager: Pager) -> None:
    pager.post(webhook())
    assert pager.stop() == 0  # SIGTERM
    log = [json.loads(line) for line in pager.log_path.read_text().splitlines() if line.startswith("{")]
    assert log[-1]["msg"] == "pager stopped"
    pager.start()
    [page] = pager.pages()
    assert page["status"] == "firing" and page["labels"]["model"] == "ranker"
    # The repeat of a notification stored before the restart is still recognised.
    assert pager.post(webhook()).json()["duplicate"] is True
    assert pager.procs.stop(pager.proc, signal.SIGINT) == 0


def test_html_escapes_what_alerts_carry(pager: Pager) -> None:
    evil = webhook(annotations={"summary": "<script>alert(1)</script>", "runbook_url": "javascript:alert(1)"})
    pager.post(evil)
    html = httpx.get(pager.url + "/", timeout=10).text
    assert "<script>alert(1)</script>" not in html and "&lt;script&gt;" in html
    assert "javascript:" not in html


def test_a_missing_token_file_is_one_line_and_exit_2(tmp_path) -> None:
    import subprocess

    proc = subprocess.run(
        inferwatch_cmd("pager", "--token-file", str(tmp_path / "nope"), "--db", str(tmp_path / "db")),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"inferwatch: error: cannot read the token file {tmp_path / 'nope'}: No such file or directory"
    ]
