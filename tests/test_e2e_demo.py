"""The whole mission on one machine: ``inferwatch up`` runs the real Triton, sidecar, GPU
exporter, Prometheus, Alertmanager and pager; the demo's scenario injects one fault per
alert tier; each must produce exactly its page, nothing may page while traffic is healthy,
recovery must send resolved notifications, and after SIGTERM no process may be left."""

from __future__ import annotations

import socket
import threading

import pytest

from alert_rules.links import runbook_url
from inferwatch import contract
from inferwatch.demo import TRAFFIC_MIX, Demo, Scenario
from inferwatch.spec import duration_seconds
from inferwatch.stack.supervisor import alive
from tests.fixtures.stack import UpStack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(720)]


def test_each_fault_pages_once_and_resolves_and_the_stop_leaves_nothing(local_stack: UpStack) -> None:
    info = local_stack.info
    spec = info.spec()
    eval_s = duration_seconds(spec.prometheus.evaluation_interval)
    processes = local_stack.snapshot()
    # inferwatch up, 6 components, tritonserver and its Python backend stubs at least.
    assert len(processes) >= 9, processes

    result = Demo(info, spec, Scenario(), threading.Event()).run()
    local_stack.snapshot()

    assert not result.aborted, result.aborted
    assert result.traffic["sent"] > 0
    assert set(result.traffic["by_target"]) == {f"{m}:{v}" for m, v, _w in TRAFFIC_MIX}
    assert result.steady_pages == [], [p.describe() for p in result.steady_pages]
    # Pages no fault explains: on a machine shared with other work, CPU contention can truly
    # push a model's P99 over twice its SLA; that warning is the rules doing their job. Any
    # other page (a critical or info one, another alert) would be a wiring bug.
    for page in result.unexpected_pages:
        assert (page.alertname, page.severity) == (
            contract.ALERT_HIGH_P99_LATENCY,
            contract.SEVERITY_WARNING,
        ), page.describe()
        print(f"note: latency warning outside the faults (CPU contention): {page.describe()}")

    for fault in result.faults:
        pages = [p for p in result.pages if fault.matches(p)]
        assert len(pages) == 1, (fault.title, [p.describe() for p in pages])
        page = pages[0]
        assert page is fault.page
        assert page.alertname == fault.alertname
        assert page.severity == contract.TIERED_ALERTS[fault.alertname] == fault.severity
        for label, value in fault.match.items():
            assert page.labels[label] == value, (fault.title, label)
        assert page.annotations["runbook_url"] == runbook_url(spec, fault.alertname)
        assert page.annotations.get("summary")
        # Never earlier than the rule allows: its condition time and group wait (the
        # evaluation interval in the minimum is alignment that may be zero).
        assert fault.delay_s is not None
        assert fault.delay_s >= fault.minimum_s - eval_s, (fault.title, fault.delay_s, fault.minimum_s)
        # Resolved after recovery, and nothing in between: one firing notification, one resolved.
        assert page.status == "resolved", (fault.title, page.status)
        assert fault.cleared_at is not None and fault.resolved_at is not None
        assert fault.resolved_at > fault.cleared_at
        assert page.notifications == 2, (fault.title, page.notifications)

    assert len(result.pages) == len(result.faults) + len(result.unexpected_pages)

    # The model labels on the pages are those the sidecar saw, per version (canary apart).
    latency = next(f for f in result.faults if f.alertname == contract.ALERT_HIGH_P99_LATENCY)
    assert latency.page.labels[contract.L_VERSION] == "2"

    # SIGTERM to inferwatch up: a clean exit, and every process it ever ran is gone.
    assert local_stack.stop() == 0, local_stack.output_text()[-3000:]
    left = [p for p in local_stack.seen if alive(p)]
    assert left == [], left
    for port in info.ports.values():  # every port is free again
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((info.host, port))
    assert "stack stopped; no process left" in local_stack.output_text()
