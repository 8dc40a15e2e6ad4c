"""The LLM alerts in Alertmanager: amtool routes each one to its severity's receiver, and the
real Alertmanager on the committed config holds a model's TTFT, TPOT and saturation alerts
as inhibited while that model has a critical alert, and only that model's."""

from __future__ import annotations

import shutil
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import yaml

from inferwatch import contract as c
from inferwatch.spec import load_spec
from tests.fixtures.alerting import start_alertmanager, wait_for
from tests.fixtures.net import Processes, free_port

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ROOT / "alert_rules" / "generated"
CONFIG = GENERATED / "alertmanager.yml"
SPEC = load_spec(ROOT / "fleet.yaml")
# Labels each alert carries as its rule writes them (vLLM's alerts keep the engine's labels).
ENGINE = {"model_name": "tiny-llm", "engine": "0", "instance": "vllm-0:8100", "job": "vllm"}
LABELS: dict[str, dict[str, str]] = {
    c.ALERT_HIGH_TTFT: {"model": "tiny-llm", "version": "1"},
    c.ALERT_HIGH_TPOT: {"model": "tiny-llm", "version": "1"},
    c.ALERT_TTFT_SLO_FAST_BURN: {"model": "tiny-llm"},
    c.ALERT_TTFT_SLO_SLOW_BURN: {"model": "tiny-llm"},
    c.ALERT_LLM_KV_CACHE_SATURATION: {"model": "tiny-llm", **ENGINE},
    c.ALERT_LLM_PREEMPTIONS: {"model": "tiny-llm", **ENGINE},
    c.ALERT_LLM_REQUESTS_QUEUED: {"model": "tiny-llm", **ENGINE},
}


def test_every_llm_alert_has_labels_here() -> None:
    assert set(LABELS) == set(c.LLM_ALERTS)


@pytest.mark.parametrize("alert", sorted(c.LLM_ALERTS))
def test_each_llm_alert_reaches_its_severitys_receiver(alert: str) -> None:
    severity = c.LLM_ALERTS[alert]
    receiver = getattr(SPEC.routing, severity).receiver
    labels = [f"{k}={v}" for k, v in {"alertname": alert, "severity": severity, **LABELS[alert]}.items()]
    proc = subprocess.run(
        [
            "amtool",
            "config",
            "routes",
            "test",
            f"--config.file={CONFIG}",
            f"--verify.receivers={receiver}",
            *labels,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == receiver


def _alert(name: str, **labels: str) -> dict:
    now = datetime.now(UTC)
    return {
        "labels": {"alertname": name, "severity": c.ALL_ALERTS[name], **labels},
        "annotations": {"summary": name},
        "startsAt": now.isoformat(),
        "endsAt": (now + timedelta(minutes=10)).isoformat(),
    }


@pytest.mark.integration
def test_a_models_critical_inhibits_its_ttft_and_saturation_alerts_only(
    tmp_path: Path, processes: Processes
) -> None:
    # The committed config, as is; its webhooks point at a pager that is not running, which
    # does not matter: inhibition is decided before notification.
    shutil.copytree(GENERATED / "templates", tmp_path / "templates")
    shutil.copyfile(CONFIG, tmp_path / "alertmanager.yml")
    (tmp_path / "pager.token").write_text("unused\n")
    url = start_alertmanager(processes, tmp_path, tmp_path / "alertmanager.yml", free_port())

    warnings = [n for n in c.LLM_ALERTS if n != c.ALERT_TTFT_SLO_FAST_BURN]
    alerts = [_alert(n, **LABELS[n]) for n in warnings]
    # The same warnings for another model, which has no critical: they stay active.
    alerts += [_alert(n, **{**LABELS[n], "model": "chat-llm", "model_name": "chat-llm"}) for n in warnings]
    alerts.append(_alert(c.ALERT_TTFT_SLO_FAST_BURN, model="tiny-llm"))
    httpx.post(f"{url}/api/v2/alerts", json=alerts, timeout=10).raise_for_status()

    def states() -> dict[tuple[str, str], str] | None:
        got = httpx.get(f"{url}/api/v2/alerts", timeout=10).json()
        out = {(a["labels"]["alertname"], a["labels"]["model"]): a["status"]["state"] for a in got}
        # Inhibition is computed as alerts arrive; wait until every alert has a settled state.
        return out if len(out) == len(alerts) and "unprocessed" not in out.values() else None

    got = wait_for("Alertmanager to hold every alert", states, timeout=30)
    assert got[c.ALERT_TTFT_SLO_FAST_BURN, "tiny-llm"] == "active"
    for name in warnings:
        assert got[name, "tiny-llm"] == "suppressed", name
        assert got[name, "chat-llm"] == "active", name


def test_each_llm_runbook_quotes_its_rule_and_tells_overload_from_a_slow_model() -> None:
    rules = {
        r["alert"]: r["expr"]
        for path in sorted(GENERATED.glob("llm*.rules.yml"))
        for group in yaml.safe_load(path.read_text())["groups"]
        for r in group["rules"]
        if "alert" in r
    }
    assert set(rules) == set(c.LLM_ALERTS)
    for alert, expr in rules.items():
        text = (ROOT / "alert_rules" / "runbooks" / f"{alert}.md").read_text()
        assert expr in text, alert
        assert "**Overload**" in text and "**A slow model**" in text, alert
        assert c.REC_VLLM_REQUESTS_WAITING in text and c.REC_TPOT_QUANTILE in text, alert
