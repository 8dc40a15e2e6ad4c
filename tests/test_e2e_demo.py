"""The whole mission on one machine, as a user runs it: ``inferwatch up`` starts the real
Triton, sidecar, GPU exporter, Prometheus, two Alertmanagers and pager; ``inferwatch demo``
plays its incident on that stack. Each fault must produce exactly its page, nothing may
page while traffic is healthy, recovery must send resolved notifications, the ranker
canary's verdict must be fail during its latency fault and pass after recovery, and after
SIGTERM to ``inferwatch up`` no process may be left. (What happens when a component dies:
tests/test_stack_ha.py.)"""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest

from alert_rules.links import runbook_url
from inferwatch import contract
from inferwatch.spec import duration_seconds
from inferwatch.stack.demo import CANARY_AFTER, CANARY_DURING, TRAFFIC_MIX
from inferwatch.stack.supervisor import alive
from tests.fixtures.net import ROOT, inferwatch_cmd
from tests.fixtures.stack import UpStack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(720)]

# (alert, the labels its page must carry): one fault per tier, as the demo injects them.
EXPECTED = {
    contract.ALERT_HIGH_ERROR_RATE: {contract.L_MODEL: "dense_unbatched", contract.L_VERSION: "1"},
    contract.ALERT_HIGH_P99_LATENCY: {contract.L_MODEL: "ranker", contract.L_VERSION: "2"},
    contract.ALERT_GPU_MEMORY_PRESSURE: {contract.L_GPU: "0"},
}


def test_each_fault_pages_once_and_resolves_and_the_stop_leaves_nothing(
    local_stack: UpStack, tmp_path: Path
) -> None:
    info = local_stack.info
    spec = info.spec()
    eval_s = duration_seconds(spec.prometheus.evaluation_interval)
    # inferwatch up, 6 components, tritonserver and its Python backend stubs at least.
    assert len(local_stack.snapshot()) >= 9

    out = tmp_path / "demo.json"
    demo = subprocess.run(
        inferwatch_cmd("demo", "--state-dir", str(info.state_dir), "--json", str(out)),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    local_stack.snapshot()
    assert demo.returncode == 0, demo.stdout[-4000:] + demo.stderr[-2000:]
    assert "using the running stack" in demo.stderr  # it played on up's stack, started none
    assert "fault → page: detection delay against the theoretical minimum" in demo.stdout
    assert "every fault paged and resolved" in demo.stdout
    result = json.loads(out.read_text())

    assert result["ok"] and result["problems"] == []
    assert result["traffic"]["sent"] > 0
    assert set(result["traffic"]["by_target"]) == {f"{m}:{v}" for m, v, _w in TRAFFIC_MIX}
    assert result["steady_pages"] == [], result["steady_pages"]
    # Pages no fault explains: on a machine shared with other work, CPU contention can truly
    # push a model's P99 over twice its SLA; that warning is the rules doing their job. Any
    # other page (a critical or info one, another alert) would be a wiring bug.
    for page in result["unexpected_pages"]:
        assert (page["alertname"], page["severity"]) == (
            contract.ALERT_HIGH_P99_LATENCY,
            contract.SEVERITY_WARNING,
        ), page
        print(f"note: latency warning outside the faults (CPU contention): {page['labels']}")

    faults = {f["alertname"]: f for f in result["faults"]}
    assert set(faults) == set(EXPECTED)
    for alertname, labels in EXPECTED.items():
        fault = faults[alertname]
        mine = [
            p
            for p in result["pages"]
            if p["alertname"] == alertname and all(p["labels"].get(k) == v for k, v in labels.items())
        ]
        assert len(mine) == 1, (alertname, mine)
        page = mine[0]
        assert page == fault["page"]
        assert page["severity"] == contract.TIERED_ALERTS[alertname]
        assert page["labels"]["severity"] == page["severity"]
        for label, value in labels.items():
            assert page["labels"][label] == value
        assert page["annotations"]["runbook_url"] == runbook_url(spec, alertname)
        assert page["annotations"].get("summary")
        # Never earlier than the rule allows: its condition time and group wait (the
        # evaluation interval in the minimum is alignment that may be zero).
        assert fault["delay_s"] >= fault["minimum_s"] - eval_s, fault
        # Resolved after recovery, and nothing in between: one firing notification, one resolved.
        assert page["status"] == "resolved"
        assert fault["resolved_at"] > fault["cleared_at"] > fault["page_at"] > fault["injected_at"]
        assert page["notifications"] == 2, page

    assert len(result["pages"]) == len(EXPECTED) + len(result["unexpected_pages"])

    # The ranker canary judged as a deploy pipeline would (inferwatch canary, the spec's
    # window): fail while its +300 ms holds (on latency), pass once a whole window has passed
    # since recovery (v2's designed ~25 ms is inside fleet.demo.yaml's margin of two SLAs).
    verdicts = {v["when"]: v for v in result["canary"]}
    assert list(verdicts) == [CANARY_DURING, CANARY_AFTER]
    during, after = verdicts[CANARY_DURING], verdicts[CANARY_AFTER]
    assert (during["model"], during["baseline"], during["canary"]) == ("ranker", "1", "2")
    assert during["window"] == spec.canary.window
    assert during["verdict"] == "fail", during
    assert {c["name"]: c["verdict"] for c in during["checks"]}["latency"] == "fail", during
    assert during["why"].startswith("latency: ")
    assert after["verdict"] == "pass", after
    assert after["at"] >= faults[contract.ALERT_HIGH_P99_LATENCY]["cleared_at"] + duration_seconds(
        spec.canary.window
    )
    assert "fail → pass" in demo.stdout

    # SIGTERM to inferwatch up: a clean exit, and every process it ever ran is gone.
    assert local_stack.stop() == 0, local_stack.output_text()[-3000:]
    left = [p for p in local_stack.seen if alive(p)]
    assert left == [], left
    for port in info.ports.values():  # every port is free again
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((info.host, port))
    assert "stack stopped; no process left" in local_stack.output_text()
