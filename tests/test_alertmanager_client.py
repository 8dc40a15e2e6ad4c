"""The Alertmanager API v2 client and ``inferwatch alerts`` / ``inferwatch silence``,
against the real Alertmanager running the generated config."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from alert_rules.am_client import AlertmanagerClient, AlertmanagerError, Matcher
from alert_rules.generate import build
from inferwatch.spec import load_spec
from tests.fixtures.alerting import start_alertmanager, wait_for
from tests.fixtures.net import Processes, free_port, inferwatch_cmd

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def am(tmp_path: Path, processes: Processes) -> Iterator[str]:
    build(load_spec(ROOT / "fleet.yaml"), tmp_path / "gen", pager_token_file=str(tmp_path / "token"))
    url = start_alertmanager(processes, tmp_path, tmp_path / "gen" / "alertmanager.yml", free_port())
    now = datetime.now(UTC)
    alerts = [
        {
            "labels": {"alertname": name, "severity": sev, "model": model, "version": "1"},
            "annotations": {"summary": f"{model} {name}"},
            "startsAt": now.isoformat(),
            "endsAt": (now + timedelta(hours=1)).isoformat(),
        }
        for name, sev, model in (
            ("InferenceHighErrorRate", "critical", "ranker"),
            ("InferenceHighP99Latency", "warning", "ranker"),
            ("InferenceHighP99Latency", "warning", "dense_batched"),
        )
    ]
    httpx.post(f"{url}/api/v2/alerts", json=alerts, timeout=10).raise_for_status()
    # The inhibitor ingests alerts asynchronously: start each test once it has.
    with AlertmanagerClient(url) as client:
        wait_for("the inhibition to apply", lambda: any(a.inhibited_by for a in client.alerts()), timeout=20)
    yield url


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(inferwatch_cmd(*args), capture_output=True, text=True, timeout=60)


def test_client_lists_alerts_with_their_state(am: str) -> None:
    with AlertmanagerClient(am) as client:
        assert client.ready()
        alerts = client.alerts()
        assert [(a.name, a.labels["model"]) for a in alerts] == [
            ("InferenceHighErrorRate", "ranker"),
            ("InferenceHighP99Latency", "dense_batched"),
            ("InferenceHighP99Latency", "ranker"),
        ]
        # ranker's warning is inhibited by ranker's critical; dense_batched's is not.
        alerts = client.alerts([Matcher("alertname", "InferenceHighP99Latency")])
        by_model = {a.labels["model"]: a for a in alerts}
        assert by_model["ranker"].state == "suppressed" and by_model["ranker"].inhibited_by
        assert by_model["dense_batched"].state == "active" and by_model["dense_batched"].receivers == [
            "ticket"
        ]
        assert [a.labels["model"] for a in client.alerts([Matcher.parse('model="dense_batched"')])] == [
            "dense_batched"
        ]


def test_client_creates_lists_and_expires_silences(am: str) -> None:
    with AlertmanagerClient(am) as client:
        sid = client.create_silence(
            [Matcher("model", "dense_batched")], timedelta(hours=2), "oncall", "rollback"
        )
        [silence] = client.silences()
        assert (silence.id, silence.state, silence.created_by, silence.comment) == (
            sid,
            "active",
            "oncall",
            "rollback",
        )
        assert [str(m) for m in silence.matchers] == ['model="dense_batched"']
        [alert] = client.alerts([Matcher("model", "dense_batched")])
        assert alert.state == "suppressed" and alert.silenced_by == [sid]
        client.expire_silence(sid)
        assert client.silences()[0].state == "expired"
        assert client.alerts([Matcher("model", "dense_batched")])[0].state == "active"
        with pytest.raises(AlertmanagerError, match="Alertmanager answered"):
            client.expire_silence("not-a-silence-id")
    with pytest.raises(AlertmanagerError, match="cannot reach Alertmanager"):
        AlertmanagerClient(f"http://127.0.0.1:{free_port()}").alerts()


def test_matcher_parsing() -> None:
    assert Matcher.parse("model=ranker") == Matcher("model", "ranker")
    assert Matcher.parse('version!="2"') == Matcher("version", "2", is_equal=False)
    assert Matcher.parse("alertname=~Inference.*") == Matcher("alertname", "Inference.*", is_regex=True)
    assert str(Matcher.parse("severity!~info|warning")) == 'severity!~"info|warning"'
    with pytest.raises(ValueError, match="is not a matcher"):
        Matcher.parse("no operator")


def test_cli_alerts_and_silence(am: str) -> None:
    out = cli("alerts", "--alertmanager", am)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 3
    assert any(line.startswith("suppressed (inhibited)") and "model=ranker" in line for line in lines)
    data = json.loads(cli("alerts", "--alertmanager", am, "--json", "severity=critical").stdout)
    assert [a["labels"]["alertname"] for a in data] == ["InferenceHighErrorRate"]

    add = cli(
        "silence",
        "add",
        "--alertmanager",
        am,
        "model=dense_batched",
        "--duration",
        "30m",
        "--comment",
        "test",
    )
    assert add.returncode == 0, add.stderr
    sid = add.stdout.strip()
    listed = cli("silence", "list", "--alertmanager", am)
    assert sid in listed.stdout and 'model="dense_batched"' in listed.stdout
    assert "suppressed (silenced)" in cli("alerts", "--alertmanager", am, "model=dense_batched").stdout
    assert cli("silence", "expire", "--alertmanager", am, sid).stdout.strip() == f"expired {sid}"
    assert cli("silence", "list", "--alertmanager", am).stdout.strip() == "no silences"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("silence", "add", "model", "--comment", "x"), "'model' is not a matcher"),
        (
            ("silence", "add", "model=a", "--duration", "soon", "--comment", "x"),
            "--duration: 'soon' is not a duration",
        ),
        (
            ("alerts", "--alertmanager", "http://127.0.0.1:9"),
            "cannot reach Alertmanager at http://127.0.0.1:9",
        ),
    ],
)
def test_cli_bad_input_is_one_line(args: tuple[str, ...], message: str) -> None:
    proc = cli(*args)
    assert proc.returncode != 0
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("inferwatch: error: ") and message in line
