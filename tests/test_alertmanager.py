"""The generated alertmanager.yml: amtool accepts it, each severity reaches its receiver,
the inhibition rule is the designed one, and real integrations come from the spec."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from alert_rules.alertmanager import render_alertmanager_config, write_alertmanager_config
from inferwatch.spec import load_spec, parse_spec

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "alert_rules" / "generated" / "alertmanager.yml"


def amtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["amtool", *args], capture_output=True, text=True, timeout=60)


def test_amtool_check_config_passes() -> None:
    proc = amtool("check-config", str(CONFIG))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 receivers" in proc.stdout and "2 inhibit rules" in proc.stdout and "1 templates" in proc.stdout


@pytest.mark.parametrize(
    ("labels", "receiver"),
    [
        (["alertname=InferenceHighErrorRate", "severity=critical", "model=ranker", "version=2"], "pager"),
        (["alertname=InferenceErrorBudgetFastBurn", "severity=critical", "model=ranker"], "pager"),
        (["alertname=InferenceHighP99Latency", "severity=warning", "model=ranker", "version=1"], "ticket"),
        (["alertname=InferwatchTargetDown", "severity=warning", "job=triton"], "ticket"),
        (["alertname=GPUMemoryPressure", "severity=info", "gpu=0", "UUID=GPU-1"], "low-urgency"),
        # No or an unknown severity still reaches someone (the ticket receiver).
        (["alertname=Mystery"], "ticket"),
        (["alertname=Mystery", "severity=page"], "ticket"),
    ],
)
def test_each_severity_reaches_its_receiver(labels: list[str], receiver: str) -> None:
    proc = amtool(
        "config", "routes", "test", f"--config.file={CONFIG}", f"--verify.receivers={receiver}", *labels
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == receiver


def test_routes_take_their_timings_from_the_spec() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    spec = load_spec(ROOT / "fleet.yaml")
    by_severity = {r["matchers"][0]: r for r in config["route"]["routes"]}
    critical = by_severity['severity="critical"']
    assert (critical["receiver"], critical["group_wait"], critical["repeat_interval"]) == (
        spec.routing.critical.receiver,
        spec.routing.critical.group_wait,
        spec.routing.critical.repeat_interval,
    )
    assert config["route"]["group_by"] == ["alertname", "model", "version"]


def test_a_models_critical_inhibits_its_warnings_and_infos_only() -> None:
    [model_rule, gpu_rule] = yaml.safe_load(CONFIG.read_text())["inhibit_rules"]
    assert model_rule == {
        "source_matchers": ['severity="critical"', 'model=~".+"'],
        "target_matchers": ['severity=~"warning|info"'],
        "equal": ["model"],
    }
    assert gpu_rule["equal"] == ["UUID"]


def test_webhooks_send_the_pager_token_from_a_file(tmp_path: Path) -> None:
    spec = load_spec(ROOT / "fleet.yaml")
    config = render_alertmanager_config(spec, pager_token_file="/run/secrets/pager-token")
    for receiver in config["receivers"]:
        [hook] = receiver["webhook_configs"]
        assert hook["http_config"] == {
            "authorization": {"type": "Bearer", "credentials_file": "/run/secrets/pager-token"}
        }
        assert hook["send_resolved"] is True
    # The committed file expects the token next to it (relative paths resolve against it).
    committed = yaml.safe_load(CONFIG.read_text())
    assert committed["receivers"][0]["webhook_configs"][0]["http_config"]["authorization"] == {
        "type": "Bearer",
        "credentials_file": "pager.token",
    }


def test_pagerduty_slack_and_webhooks_from_the_spec(tmp_path: Path) -> None:
    data = yaml.safe_load((ROOT / "fleet.yaml").read_text())
    data["routing"]["receivers"] = [
        {"name": "pager", "pagerduty": [{"routing_key_file": "/secrets/pd-key"}]},
        {
            "name": "ticket",
            "webhooks": [
                {"url": "https://tickets.example.org/hook", "bearer_token_file": "/secrets/tickets"}
            ],
        },
        {
            "name": "low-urgency",
            "slack": [{"api_url_file": "/secrets/slack-url", "channel": "#inference-alerts"}],
        },
    ]
    spec = parse_spec(data)
    paths = write_alertmanager_config(spec, tmp_path, pager_token_file="/ignored/for/explicit/tokens")
    assert {p.name for p in paths} == {"alertmanager.yml", "inferwatch.tmpl"}
    proc = amtool("check-config", str(tmp_path / "alertmanager.yml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    config = yaml.safe_load((tmp_path / "alertmanager.yml").read_text())
    receivers = {r["name"]: r for r in config["receivers"]}
    pd = receivers["pager"]["pagerduty_configs"][0]
    assert pd["routing_key_file"] == "/secrets/pd-key" and "inferwatch.title" in pd["description"]
    hook = receivers["ticket"]["webhook_configs"][0]
    assert hook["http_config"]["authorization"]["credentials_file"] == "/secrets/tickets"
    slack = receivers["low-urgency"]["slack_configs"][0]
    assert slack["channel"] == "#inference-alerts" and slack["api_url_file"] == "/secrets/slack-url"


def test_notification_templates_render(tmp_path: Path) -> None:
    """amtool renders the Slack/PagerDuty text template with example data."""
    write_alertmanager_config(load_spec(ROOT / "fleet.yaml"), tmp_path)
    proc = amtool(
        "template",
        "render",
        f"--template.glob={tmp_path / 'templates' / '*.tmpl'}",
        '--template.text={{ template "inferwatch.title" . }}|{{ template "inferwatch.text" . }}',
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # amtool's example data: status "alertstatus", two alerts without labels.
    title, text = proc.stdout.split("|", 1)
    assert title.strip() == "[ALERTSTATUS]"
    assert text.count("Runbook: ") == 2 and text.count("Since: ") == 2
