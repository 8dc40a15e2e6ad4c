"""The whole alert path, real parts only: a test-controlled target exposing the contract's
metrics -> the real Prometheus evaluating the generated rules -> the real Alertmanager on
the generated config -> ``inferwatch pager``. The spec is fleet.yaml with windows scaled
from minutes to seconds, through the same generator."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml

from alert_rules.am_client import AlertmanagerClient, Matcher
from alert_rules.generate import build, rule_files
from inferwatch.spec import FleetSpec, parse_spec
from tests.fixtures.alerting import (
    MetricsTarget,
    ModelState,
    Pager,
    make_pager,
    start_alertmanager,
    start_prometheus,
    wait_for,
)
from tests.fixtures.net import Processes, free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def scaled_spec(pager_port: int) -> FleetSpec:
    data = yaml.safe_load((ROOT / "fleet.yaml").read_text())
    data["alerts"] = {
        "error_rate": {"threshold": 0.05, "window": "3s", "consecutive_windows": 3},
        # Held 20s: bad's latency warning must fire well after its critical (>= 9s, three
        # 3s windows) so that the inhibition, not a race, decides whether it pages.
        "latency": {"sla_factor": 2, "quantile": 0.99, "window": "4s", "for": "20s"},
        "gpu_memory": {"threshold": 0.9, "for": "3s"},
    }
    data["models"] = [{"name": "good", "latency_sla_ms": 100}, {"name": "bad", "latency_sla_ms": 100}]
    data["prometheus"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    route = {"group_wait": "1s", "group_interval": "2s", "repeat_interval": "1h"}
    data["routing"] = {
        "group_by": ["alertname", "model", "version"],
        "critical": {"receiver": "pager", **route},
        "warning": {"receiver": "ticket", **route},
        "info": {"receiver": "low-urgency", **route},
        "receivers": [
            {"name": n, "webhooks": [{"url": f"http://127.0.0.1:{pager_port}/webhook"}]}
            for n in ("pager", "ticket", "low-urgency")
        ],
    }
    return parse_spec(data, "scaled fleet.yaml")


def prom_query(url: str, query: str) -> list[dict]:
    resp = httpx.get(f"{url}/api/v1/query", params={"query": query}, timeout=10)
    resp.raise_for_status()
    return resp.json()["data"]["result"]


def pager_delivery_given_up(am_log: Path) -> bool:
    """Alertmanager's log says a whole flush to the pager receiver failed (every retry
    within its deadline refused): only a later flush can still deliver that page."""
    return any(
        'msg="Notify for alerts failed"' in line and 'err="pager/webhook' in line
        for line in am_log.read_text().splitlines()
    )


def page(pager: Pager, alertname: str, **labels: str) -> dict | None:
    for p in pager.pages(alertname=alertname):
        if all(p["labels"].get(k) == v for k, v in labels.items()):
            return p
    return None


def test_each_tier_pages_through_the_real_stack(tmp_path: Path, processes: Processes) -> None:
    pager = make_pager(tmp_path, processes)
    spec = scaled_spec(pager.port)
    build(spec, tmp_path / "gen", pager_token_file=str(pager.token_file))
    models = {
        "good": ModelState(),  # no SLA gauge: the spec's default applies
        "bad": ModelState(sla=0.1),
        "slow": ModelState(sla=0.05),  # not in the spec: covered without regenerating
    }
    with MetricsTarget(models) as target:
        am_port = free_port()
        prom = start_prometheus(processes, tmp_path, rule_files(tmp_path / "gen"), target.port, am_port, "1s")
        am = start_alertmanager(processes, tmp_path, tmp_path / "gen" / "alertmanager.yml", am_port)
        am_log = processes.procs[-1].log_path
        wait_for("both targets scraped", lambda: len(prom_query(prom, "up == 1")) == 2, timeout=30)

        # The faults: bad fails half its requests and is slow; slow is slow; the GPU fills up.
        # The pager is down meanwhile.
        models["bad"].error_ratio, models["bad"].latency = 0.5, 0.5
        models["slow"].latency = 0.2
        target.fb_used_ratio = 0.95

        firing = 'ALERTS{alertname="%s", alertstate="firing"%s}'
        wait_for(
            "the critical alert firing in Prometheus",
            lambda: prom_query(prom, firing % ("InferenceHighErrorRate", ', model="bad"')),
            timeout=60,
        )
        wait_for(
            "Alertmanager giving up a delivery to the pager",
            lambda: pager_delivery_given_up(am_log),
            timeout=60,
        )
        pager.start()

        # Each tier arrives, once the receiver is back, with its severity and labels.
        critical = wait_for("the critical page", lambda: page(pager, "InferenceHighErrorRate"), timeout=60)
        assert critical["labels"] == {
            "alertname": "InferenceHighErrorRate",
            "model": "bad",
            "version": "1",
            "severity": "critical",
        }
        assert critical["receiver"] == "pager" and critical["status"] == "firing"
        assert critical["annotations"]["runbook_url"].endswith("/InferenceHighErrorRate.md")
        warning = wait_for(
            "the warning page", lambda: page(pager, "InferenceHighP99Latency", model="slow"), timeout=60
        )
        assert warning["labels"] == {
            "alertname": "InferenceHighP99Latency",
            "model": "slow",
            "version": "1",
            "severity": "warning",
        }
        assert warning["receiver"] == "ticket"
        info = wait_for("the info page", lambda: page(pager, "GPUMemoryPressure"), timeout=60)
        assert info["labels"] == {
            "alertname": "GPUMemoryPressure",
            "severity": "info",
            **target.gpu_labels,
            "instance": f"127.0.0.1:{target.port}",
            "job": "gpu-exporter",
        }
        assert info["receiver"] == "low-urgency"

        # bad's latency alert fires in Prometheus, but its critical inhibits it: Alertmanager
        # holds it as inhibited and the pager never gets it.
        wait_for(
            "bad's latency alert firing in Prometheus",
            lambda: prom_query(prom, firing % ("InferenceHighP99Latency", ', model="bad"')),
            timeout=60,
        )
        with AlertmanagerClient(am) as client:
            matchers = [Matcher("alertname", "InferenceHighP99Latency"), Matcher("model", "bad")]
            held = wait_for(
                "the inhibited alert in Alertmanager", lambda: client.alerts(matchers), timeout=30
            )
            assert held[0].state == "suppressed" and held[0].inhibited_by
        pager_seen = {(p["alertname"], p["labels"].get("model")) for p in pager.pages()}
        assert ("InferenceHighP99Latency", "bad") not in pager_seen
        assert not any(p["labels"].get("model") == "good" for p in pager.pages())

        # The errors stop: the critical resolves, and with it the inhibition, so bad's
        # still-firing latency warning now reaches the ticket receiver.
        models["bad"].error_ratio = 0.0
        wait_for(
            "the critical page resolved",
            lambda: (p := page(pager, "InferenceHighErrorRate")) and p["status"] == "resolved",
            timeout=60,
        )
        late = wait_for(
            "bad's warning once uninhibited",
            lambda: page(pager, "InferenceHighP99Latency", model="bad"),
            timeout=60,
        )
        assert late["receiver"] == "ticket" and late["labels"]["severity"] == "warning"
        assert not any(p["labels"].get("model") == "good" for p in pager.pages())
