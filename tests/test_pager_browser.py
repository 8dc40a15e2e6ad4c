"""The inbox as an on-call engineer sees it: rendered by a real headless Chromium at 1280x900,
with the pager's own Content-Security-Policy in force. The test asserts what is on screen,
and saves the screenshot; ``PAGER_SCREENSHOT=docs/img/pager-inbox.png`` writes alert_rules/README.md's."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

from tests.fixtures.alerting import Pager, webhook
from tests.fixtures.browser import Browser
from tests.fixtures.net import Processes

ROOT = Path(__file__).resolve().parents[1]
RUNBOOKS = "https://github.com/inferwatch/inferwatch/blob/main/alert_rules/runbooks"
GRAFANA = "http://localhost:3000/d"


def _ago(now: datetime, **delta: float) -> str:
    return (now - timedelta(**delta)).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _alert(fp: str, labels: dict, summary: str, description: str, runbook: str, dashboard: str, **kw) -> dict:
    payload = webhook(
        fingerprint=fp,
        labels=labels,
        annotations={
            "summary": summary,
            "description": description,
            "runbook_url": f"{RUNBOOKS}/{runbook}.md",
            "dashboard_url": dashboard,
        },
        **kw,
    )
    payload["receiver"] = {"critical": "pager", "warning": "ticket"}.get(labels["severity"], "low-urgency")
    return payload


def post_incident(pager: Pager, now: datetime) -> None:
    """A plausible night: a critical and a warning firing, a GPU filling up, one resolved."""
    ranker = {
        "alertname": "InferenceHighErrorRate",
        "severity": "critical",
        "model": "ranker",
        "version": "2",
    }
    dense = {
        "alertname": "InferenceHighP99Latency",
        "severity": "warning",
        "model": "dense_batched",
        "version": "1",
    }
    gpu = {
        "alertname": "GPUMemoryPressure",
        "severity": "info",
        "gpu": "3",
        "UUID": "GPU-5d1c2a9e-8f3b-4c47-9a0e-2b6f7d8e9f01",
        "Hostname": "gpu-node-7",
        "instance": "10.0.4.17:9400",
        "job": "gpu-exporter",
    }
    old = {**ranker, "model": "embedder", "version": "5"}
    model_dash = f"{GRAFANA}/inferwatch-model-detail/inferwatch-model-detail?var-model="
    notifications = [
        # Info first and the critical last: the inbox must still put the critical on top.
        _alert(
            "gpu3",
            gpu,
            f"GPU 3 ({gpu['UUID']}) on gpu-node-7: framebuffer memory above 90%",
            f"GPU 3 ({gpu['UUID']}) on gpu-node-7 has used 94.2% of its framebuffer memory for 5m. "
            "New model instances or larger batches may fail to allocate.",
            "GPUMemoryPressure",
            f"{GRAFANA}/inferwatch-gpu/inferwatch-gpu",
            startsAt=_ago(now, hours=2, minutes=5),
        ),
        _alert(
            "dense1",
            dense,
            "dense_batched v1: P99 latency above 2x its SLA",
            "P99 latency of model dense_batched version 1 over 5m is 412ms, above 2x its SLA, for 5m. "
            "Compare Triton's queue time with its compute time to tell overload from a slow model.",
            "InferenceHighP99Latency",
            model_dash + "dense_batched",
            startsAt=_ago(now, minutes=47),
        ),
        _alert(
            "emb5",
            old,
            "embedder v5: server errors above 5% for 3 windows of 1m",
            "At least 8.1% of the requests to model embedder version 5 failed on the server side in each "
            "of the last 3 1m windows (threshold 5%). If a new version was just rolled out, roll it back.",
            "InferenceHighErrorRate",
            model_dash + "embedder",
            startsAt=_ago(now, hours=3),
        ),
        _alert(
            "ranker2",
            ranker,
            "ranker v2: server errors above 5% for 3 windows of 1m",
            "At least 27.4% of the requests to model ranker version 2 failed on the server side in each "
            "of the last 3 1m windows (threshold 5%). If a new version was just rolled out, roll it back.",
            "InferenceHighErrorRate",
            model_dash + "ranker",
            startsAt=_ago(now, minutes=12, seconds=10),
        ),
    ]
    for payload in notifications:
        assert pager.post(payload).status_code == 200
    resolved = notifications[2]
    resolved["status"] = resolved["alerts"][0]["status"] = "resolved"
    resolved["alerts"][0]["endsAt"] = _ago(now, hours=2, minutes=20)
    assert pager.post(resolved).status_code == 200


# Run in the page: what is on screen, and where.
ON_SCREEN = {
    "text": "document.body.innerText",
    "viewport": "[innerWidth, innerHeight]",
    "scroll_width": "document.documentElement.scrollWidth",
    "links": """[...document.querySelectorAll('td.links a')].map(a => {
        const r = a.getBoundingClientRect();
        return {text: a.textContent, left: r.left, right: r.right, width: r.width, top: r.top};
    })""",
    "headers": """[...document.querySelectorAll('th')].map(th => {
        const r = th.getBoundingClientRect(); return [th.textContent, r.left, r.right];
    })""",
    "rows": """[...document.querySelectorAll('tbody tr')].map(tr => [tr.className,
        tr.querySelector('.name').textContent, tr.querySelector('time').textContent.trim(),
        tr.querySelector('time').title])""",
    # Styles apply only if the CSP's style hash matches the page's style block.
    "critical_badge": "getComputedStyle(document.querySelector('.sev-critical')).backgroundColor",
    "critical_border": "getComputedStyle(document.querySelector('tr.firing.critical td')).borderLeftColor",
}


def test_the_inbox_at_1280_px_in_a_real_browser(pager: Pager, tmp_path: Path, processes: Processes) -> None:
    now = datetime.now(UTC)
    post_incident(pager, now)
    shot = Path(os.environ.get("PAGER_SCREENSHOT") or tmp_path / "inbox.png")
    seen = Browser(processes, tmp_path).visit(pager.url + "/", ON_SCREEN, screenshot=shot)

    assert seen["viewport"] == [1280, 900]
    assert seen["scroll_width"] <= 1280, "the table is wider than the screen"
    # Every header, the receiver column included, is on screen.
    assert [h[0] for h in seen["headers"]] == [
        "severity",
        "alert",
        "model / target",
        "since",
        "links",
        "receiver",
    ]
    assert all(left >= 0 and right <= 1280 for _, left, right in seen["headers"])
    # Both links of every row are whole and on screen.
    assert sorted({link["text"] for link in seen["links"]}) == ["dashboard", "runbook"]
    assert len(seen["links"]) == 8
    assert all(link["width"] > 0 and link["left"] >= 0 and link["right"] <= 1280 for link in seen["links"])

    # Firing first, then by severity; resolved last.
    assert [(r[0], r[1]) for r in seen["rows"]] == [
        ("firing critical", "InferenceHighErrorRate"),
        ("firing warning", "InferenceHighP99Latency"),
        ("firing info", "GPUMemoryPressure"),
        ("resolved critical", "InferenceHighErrorRate"),
    ]
    critical = seen["rows"][0]
    assert critical[2] == "firing for 12m"
    started = datetime.fromisoformat(_ago(now, minutes=12, seconds=10)).strftime("%Y-%m-%d %H:%M:%S")
    assert critical[3].startswith(f"firing since {started}") and critical[3].endswith(" UTC")
    assert seen["rows"][2][2] == "firing for 2h 5m"
    assert seen["rows"][3][2] == "resolved 2h 20m ago"
    # Critical is marked as such, by the page's own style (so the CSP lets it apply).
    assert seen["critical_badge"] == "rgb(179, 38, 30)"
    assert seen["critical_border"] == "rgb(179, 38, 30)"

    text = seen["text"]
    assert "3 firing (1 critical), 1 resolved" in text
    assert "Showing 1\u20134 of 4" in text  # an en dash
    assert "ranker v2" in text and "At least 27.4% of the requests to model ranker version 2" in text
    assert "dense_batched v1" in text and "gpu-node-7" in text
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
