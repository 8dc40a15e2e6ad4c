"""The pager behind the real Alertmanager 0.25, on the config generated from fleet.yaml
with its timings scaled to seconds: the flapping sequence (fire, resolve, fire again with the
same startsAt) reopens the page, and the same alert delivered by two Alertmanagers is one page."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import yaml

from alert_rules.generate import build
from inferwatch.spec import parse_spec
from tests.fixtures.alerting import Pager, make_pager, start_alertmanager, wait_for
from tests.fixtures.net import Processes, free_port, wait_http

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
GRACE = 2.0  # the pager's --resolve-grace, scaled down like the route timings
LABELS = {"alertname": "InferenceHighErrorRate", "severity": "critical", "model": "flappy", "version": "1"}


def alertmanager_config(tmp: Path, pager: Pager) -> Path:
    data = yaml.safe_load((ROOT / "fleet.yaml").read_text())
    route = {"group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h"}
    data["routing"] = {
        "group_by": ["alertname", "model", "version"],
        "critical": {"receiver": "pager", **route},
        "warning": {"receiver": "ticket", **route},
        "info": {"receiver": "low-urgency", **route},
        "receivers": [
            {"name": n, "webhooks": [{"url": f"{pager.url}/webhook"}]}
            for n in ("pager", "ticket", "low-urgency")
        ],
    }
    build(parse_spec(data, "scaled fleet.yaml"), tmp / "gen", pager_token_file=str(pager.token_file))
    return tmp / "gen" / "alertmanager.yml"


def post_alert(am: str, starts: datetime, ends: datetime) -> None:
    alert = {
        "labels": LABELS,
        "annotations": {"summary": "flappy v1: server errors above 5%", "description": "measured 42%"},
        "startsAt": starts.isoformat().replace("+00:00", "Z"),
        "endsAt": ends.isoformat().replace("+00:00", "Z"),
    }
    httpx.post(f"{am}/api/v2/alerts", json=[alert], timeout=10).raise_for_status()


def test_an_alert_that_fires_again_with_the_same_starts_at_reopens_its_page(
    tmp_path: Path, processes: Processes
) -> None:
    pager = make_pager(tmp_path, processes)
    pager.args = ("--resolve-grace", str(GRACE))
    pager.start()
    am = start_alertmanager(processes, tmp_path, alertmanager_config(tmp_path, pager), free_port())
    starts = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=5)

    # Fire, with an endsAt a few seconds ahead: Prometheus stopped reaching Alertmanager.
    post_alert(am, starts, datetime.now(UTC) + timedelta(seconds=3))
    wait_for("the page", lambda: pager.pages(model="flappy"), timeout=30)
    # endsAt passes: Alertmanager resolves the alert and says so.
    [resolved] = wait_for(
        "the resolved notification",
        lambda: [p for p in pager.pages(model="flappy") if p["status"] == "resolved"],
        timeout=60,
    )
    assert resolved["starts_at"] == starts.strftime("%Y-%m-%dT%H:%M:%S.000000000Z")

    # Prometheus reaches Alertmanager again and re-sends the alert with its old startsAt,
    # later than the pager's grace for a second Alertmanager's stale firing.
    time.sleep(GRACE + 0.5)
    post_alert(am, starts, datetime.now(UTC) + timedelta(hours=1))
    active = httpx.get(f"{am}/api/v2/alerts", params={"filter": 'model="flappy"'}, timeout=10).json()
    assert [a["status"]["state"] for a in active] == ["active"]
    reopened = wait_for(
        "the page reopened",
        lambda: [p for p in pager.pages(model="flappy") if p["status"] == "firing"],
        timeout=60,
    )
    pages = pager.pages(model="flappy")
    assert [p["status"] for p in pages] == ["firing", "resolved"]
    assert reopened[0]["starts_at"] == resolved["starts_at"] and reopened[0]["id"] > resolved["id"]
    html = httpx.get(pager.url + "/", timeout=10).text
    assert "1 firing</span>\n(1 critical), 1 resolved" in html and "measured 42%" in html


def test_the_same_alert_from_two_alertmanagers_is_one_page(tmp_path: Path, processes: Processes) -> None:
    pager = make_pager(tmp_path, processes).start()
    config = alertmanager_config(tmp_path, pager)
    ams = []
    for name in ("am1", "am2"):
        (tmp_path / name).mkdir()
        ams.append(start_alertmanager(processes, tmp_path / name, config, free_port()))
    starts = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=1)
    for am in ams:
        post_alert(am, starts, datetime.now(UTC) + timedelta(hours=1))

    def counts() -> dict:
        return httpx.get(f"{pager.url}/pages", timeout=10).json()["counts"]

    wait_for("both Alertmanagers' deliveries", lambda: counts()["deliveries"] >= 2, timeout=30)
    [page] = pager.pages(model="flappy")
    assert page["status"] == "firing" and page["notifications"] == 1
    assert counts()["notifications"] == 1
    log = pager.log_path.read_text()
    assert log.count('"msg": "notification stored"') == 1 and '"msg": "repeated delivery ignored"' in log


def start_clustered_alertmanagers(processes: Processes, tmp: Path, config: Path) -> list[str]:
    """Two Alertmanagers gossiping on loopback with a 2 s peer timeout (the local stack's)."""
    web, gossip = [free_port(), free_port()], [free_port(), free_port()]
    procs = []
    for i in (0, 1):
        workdir = tmp / f"am{i}"
        workdir.mkdir()
        cmd = [
            "prometheus-alertmanager",
            f"--config.file={config}",
            f"--storage.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{web[i]}",
            f"--cluster.listen-address=127.0.0.1:{gossip[i]}",
            f"--cluster.peer=127.0.0.1:{gossip[1 - i]}",
            "--cluster.peer-timeout=2s",
        ]
        procs.append(processes.start(f"alertmanager-{i}", cmd))
    urls = [f"http://127.0.0.1:{p}" for p in web]
    for url, proc in zip(urls, procs, strict=True):
        wait_http(f"{url}/-/ready", timeout=60, proc=proc)
    wait_for(
        "the two Alertmanagers to see each other",
        lambda: all(
            len(httpx.get(f"{u}/api/v2/status", timeout=10).json()["cluster"].get("peers") or []) == 2
            for u in urls
        ),
        timeout=60,
    )
    return urls


def test_a_stale_firing_from_the_second_alertmanager_is_not_a_new_page(
    tmp_path: Path, processes: Processes
) -> None:
    """The race of prometheus/alertmanager#4008 through a real clustered pair: the resolve
    reaches the first instance only (as when the second one's flush snapshot predates it),
    the first sends resolved, the second sends the old firing one peer timeout later (its
    view against the gossiped log), then resolved when the resolve reaches it. One page.
    Past the grace, Prometheus re-sending the same startsAt (an outage) reopens it."""
    grace = 10.0
    pager = make_pager(tmp_path, processes)
    pager.args = ("--resolve-grace", str(grace))
    pager.start()
    am1, am2 = start_clustered_alertmanagers(processes, tmp_path, alertmanager_config(tmp_path, pager))
    starts = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=1)
    for am in (am1, am2):
        post_alert(am, starts, datetime.now(UTC) + timedelta(hours=1))
    wait_for("the page", lambda: pager.pages(model="flappy"), timeout=60)

    def stored(what: str) -> list[dict]:
        lines = [json.loads(x) for x in pager.log_path.read_text().splitlines() if x.startswith("{")]
        return [r for r in lines if r["msg"].startswith(what)]

    ends = datetime.now(UTC)
    post_alert(am1, starts, ends)  # Prometheus' resolved alert reaches the first instance
    wait_for("the resolved page", lambda: pager.pages(model="flappy", status="resolved"), timeout=60)
    grace_ends = time.monotonic() + grace + 0.5
    wait_for(
        "the second instance's stale firing",
        lambda: stored("stale firing") or len(pager.pages(model="flappy")) > 1,
        timeout=60,
    )
    assert [p["status"] for p in pager.pages(model="flappy")] == ["resolved"]
    [stale] = stored("stale firing")
    assert stale["status"] == "firing"
    post_alert(am2, starts, ends)  # Prometheus' resend of the resolved alert reaches the second
    wait_for(
        "the second instance's resolved",
        lambda: [r for r in stored("repeated delivery") if r["status"] == "resolved"],
        timeout=60,
    )
    [page] = pager.pages(model="flappy")
    assert page["status"] == "resolved" and page["notifications"] == 2
    assert len(stored("notification stored")) == 2  # the firing and the first resolved

    time.sleep(max(0.0, grace_ends - time.monotonic()))
    for am in (am1, am2):
        post_alert(am, starts, datetime.now(UTC) + timedelta(hours=1))
    wait_for("the page reopened", lambda: pager.pages(model="flappy", status="firing"), timeout=60)
    assert [p["status"] for p in pager.pages(model="flappy")] == ["firing", "resolved"]
