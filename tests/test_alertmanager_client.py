"""The Alertmanager API v2 client and ``inferwatch alerts`` / ``inferwatch silence``,
against the real Alertmanager running the generated config."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml

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
            client.expire_silence("00000000-0000-0000-0000-000000000000")
        with pytest.raises(ValueError, match="is not a silence id"):
            client.expire_silence("../alerts")
    with pytest.raises(AlertmanagerError, match="cannot reach Alertmanager"):
        AlertmanagerClient(f"http://127.0.0.1:{free_port()}").alerts()


def test_matcher_parsing() -> None:
    assert Matcher.parse("model=ranker") == Matcher("model", "ranker")
    assert Matcher.parse('version!="2"') == Matcher("version", "2", is_equal=False)
    assert Matcher.parse("alertname=~Inference.*") == Matcher("alertname", "Inference.*", is_regex=True)
    assert str(Matcher.parse("severity!~info|warning")) == 'severity!~"info|warning"'
    # Quotes and backslashes inside a value, written and read as Alertmanager does.
    quoted = Matcher.parse('model="say \\"hi\\" \\\\ bye"')
    assert quoted.value == 'say "hi" \\ bye'
    assert str(quoted) == 'model="say \\"hi\\" \\\\ bye"' and Matcher.parse(str(quoted)) == quoted
    assert Matcher.parse('model=a"b').value == 'a"b'
    with pytest.raises(ValueError, match="is not a matcher"):
        Matcher.parse("no operator")
    with pytest.raises(ValueError, match="must end with its quote"):
        Matcher.parse('model="a')
    with pytest.raises(ValueError, match="not a regular expression"):
        Matcher.parse("model=~(")


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


def add_args(*matchers: str, duration: str = "30m") -> tuple[str, ...]:
    return ("silence", "add", *matchers, "--duration", duration, "--comment", "test")


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (("silence", "add", "model", "--comment", "x"), 2, "'model' is not a matcher"),
        (("silence", "add", 'model="a', "--comment", "x"), 2, "must end with its quote"),
        (add_args("model=a", duration="soon"), 2, "--duration: 'soon' is not a duration"),
        (add_args("model=a", duration="0s"), 2, "--duration: 0s is not a positive duration"),
        (
            add_args("model=a", duration="99999999999d"),
            2,
            "--duration 99999999999d is longer than silences.max_duration 7d",
        ),
        (add_args("model=a", duration="99999d"), 2, "--duration 99999d is longer than silences.max_duration"),
        (("alerts", "--alertmanager", "http://[::1"), 2, "--alertmanager: 'http://[::1' is not a URL"),
        (("silence", "list", "--alertmanager", "ftp://host"), 2, "is not an http:// or https:// URL"),
        (
            ("alerts", "--alertmanager", "http://127.0.0.1:9"),
            1,
            "cannot reach Alertmanager at http://127.0.0.1:9",
        ),
    ],
)
def test_cli_bad_input_is_one_line(args: tuple[str, ...], code: int, message: str) -> None:
    proc = cli(*args)
    assert proc.returncode == code, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("inferwatch: error: ") and message in line, line


def test_the_spec_caps_a_silence(tmp_path: Path) -> None:
    spec = tmp_path / "fleet.yaml"
    spec.write_text(
        yaml.safe_dump(
            {**yaml.safe_load((ROOT / "fleet.yaml").read_text()), "silences": {"max_duration": "2h"}}
        )
    )
    proc = cli(
        *add_args("model=a", duration="3h"), "--spec", str(spec), "--alertmanager", "http://127.0.0.1:9"
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == f"inferwatch: error: --duration 3h is longer than silences.max_duration 2h of {spec}"
    )


class NotAlertmanager:
    """What can sit at the configured URL instead of Alertmanager: a proxy's HTML login page,
    or a JSON API of another shape."""

    def __init__(self, body: bytes, content_type: str) -> None:
        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_DELETE = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b"<html><body>Please log in</body></html>", "text/html"),
        (b'{"status": "ok", "data": {"alerts": []}}', "application/json"),
        (b'[{"id": 1}]', "application/json"),
    ],
)
def test_an_answer_that_is_not_alertmanager_is_one_line(body: bytes, content_type: str) -> None:
    proxy = NotAlertmanager(body, content_type)
    try:
        for args in (
            ("alerts",),
            ("silence", "list"),
            add_args("model=a"),
            ("silence", "add", "model=a", "--comment", "x", "--dry-run"),
        ):
            proc = cli(*args, "--alertmanager", proxy.url)
            assert proc.returncode == 1, (args, proc.stderr)
            [line] = proc.stderr.strip().splitlines()
            assert "not Alertmanager's API v2" in line and content_type in line, line
    finally:
        proxy.close()


def test_silence_preview_dry_run_expire_each_quoting_and_utc(am: str) -> None:
    # A negative matcher mutes every other model and every alert without a model label.
    now = datetime.now(UTC)
    extra = [
        {"labels": {"alertname": "GPUMemoryPressure", "severity": "info", "gpu": "0"}},
        {"labels": {"alertname": "InferenceHighErrorRate", "severity": "critical", "model": 'say "hi"'}},
    ]
    for alert in extra:
        alert |= {"startsAt": now.isoformat(), "endsAt": (now + timedelta(hours=1)).isoformat()}
    httpx.post(f"{am}/api/v2/alerts", json=extra, timeout=10).raise_for_status()
    dry = cli("silence", "add", "--alertmanager", am, "model!=ranker", "--comment", "x", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    assert lines[0].startswith("would silence until ") and lines[0].endswith(" UTC; it mutes 3 alerts now")
    assert lines[1].startswith("note: every matcher is negative")
    assert sorted(line.split()[2] for line in lines[2:]) == [
        "GPUMemoryPressure",
        "InferenceHighErrorRate",
        "InferenceHighP99Latency",
    ]
    assert cli("silence", "list", "--alertmanager", am).stdout.strip() == "no silences"

    # The preview comes before the silence, on stderr; the id alone on stdout.
    add = cli("silence", "add", "--alertmanager", am, 'model="say \\"hi\\""', "--comment", "quoted")
    assert add.returncode == 0, add.stderr
    assert add.stderr.splitlines()[0].endswith("UTC; it mutes 1 alert now")
    assert 'model=say "hi"' in add.stderr
    sid = add.stdout.strip()
    with AlertmanagerClient(am) as client:
        [silence] = client.silences()
        assert silence.matchers == [Matcher("model", 'say "hi"')]
        [alert] = client.alerts([Matcher("model", 'say "hi"')])
        assert alert.silenced_by == [sid]
    listed = cli("silence", "list", "--alertmanager", am).stdout
    assert 'model="say \\"hi\\""' in listed and " UTC " in listed
    assert " UTC " in cli("alerts", "--alertmanager", am).stdout

    # expire: each id on its own; the good one is expired whatever comes before it.
    missing = "00000000-0000-0000-0000-000000000000"
    proc = cli("silence", "expire", "--alertmanager", am, "not-an-id", missing, sid)
    assert proc.returncode == 1
    assert proc.stdout.strip() == f"expired {sid}"
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == 2 and all(line.startswith("inferwatch: error: cannot expire ") for line in errors)
    assert "'not-an-id' is not a silence id" in errors[0] and missing in errors[1]
    with AlertmanagerClient(am) as client:
        assert client.silences()[0].state == "expired"
