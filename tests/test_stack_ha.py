"""High availability and supervision on the real local stack (``inferwatch up``, the demo
spec's scaled windows): a page survives an Alertmanager killed during the incident, and a
component that keeps dying stops the stack with an error that says so."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from inferwatch import contract
from inferwatch.stack.core import STACK_FILE, StackInfo
from inferwatch.stack.demo import Traffic, clear_faults, set_fault
from inferwatch.stack.supervisor import alive
from inferwatch.stack.timing import deadline_after, next_error_window_start, resolve_bound
from tests.fixtures.alerting import wait_for
from tests.fixtures.stack import UpStack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MODEL, VERSION = "ranker", "1"  # cheap to serve: the error burst costs the machine little


def stack_json(up: UpStack) -> StackInfo:
    return StackInfo.from_json(json.loads((up.state_dir / STACK_FILE).read_text()))


def cluster(url: str) -> dict:
    """Alertmanager's view of its cluster: its own name and every peer's."""
    return httpx.get(f"{url}/api/v2/status", timeout=5, trust_env=False).json()["cluster"]


def clustered(urls: dict[str, str]) -> bool:
    try:
        return all(len(cluster(u)["peers"]) == len(urls) for u in urls.values())
    except httpx.HTTPError:
        return False


def first_in_line(urls: dict[str, str]) -> str:
    """The instance that notifies first: Alertmanager orders peers by name, and the one at
    position n waits n x --cluster.peer-timeout before it sends what nobody sent."""
    views = {name: cluster(u) for name, u in urls.items()}
    lowest = min(p["name"] for view in views.values() for p in view["peers"])
    [name] = [n for n, view in views.items() if view["name"] == lowest]
    return name


def firing(info: StackInfo) -> bool:
    alerts = httpx.get(info.url("prometheus", "/api/v1/alerts"), timeout=5, trust_env=False).json()
    return any(
        a["labels"].get("alertname") == contract.ALERT_HIGH_ERROR_RATE
        and a["labels"].get(contract.L_MODEL) == MODEL
        and a["state"] == "firing"
        for a in alerts["data"]["alerts"]
    )


def pages(info: StackInfo) -> list[dict]:
    resp = httpx.get(
        info.url("pager", "/pages"),
        params={"alertname": contract.ALERT_HIGH_ERROR_RATE, "model": MODEL},
        timeout=5,
        trust_env=False,
    )
    resp.raise_for_status()
    return resp.json()["pages"]


def test_a_page_survives_a_killed_alertmanager_and_the_stack_restarts_it(local_stack: UpStack) -> None:
    info = local_stack.info
    spec = info.spec()
    urls = info.alertmanager_urls
    assert len(urls) == 2
    wait_for("the two Alertmanagers to gossip with each other", lambda: clustered(urls), timeout=60)
    assert pages(info) == []

    traffic = Traffic(info, 10.0, ((MODEL, VERSION, 1.0),))
    traffic.start()
    try:
        # The burst starts where the demo starts it in its error window: the page comes at
        # the rule's minimum, about 28 s with fleet.demo.yaml.
        time.sleep(max(0.0, next_error_window_start(spec, time.time()) - time.time()))
        set_fault(info, MODEL, VERSION, error_rate=0.5)
        wait_for("the error alert to fire in Prometheus", lambda: firing(info), timeout=120, interval=0.2)
        # Both instances have the alert now and wait out their group_wait (2 s): kill the one
        # that would send the page, so the other must.
        victim = first_in_line(urls)
        victim_pid = stack_json(local_stack).pids[victim]
        os.kill(victim_pid, signal.SIGKILL)
        killed_at = time.time()
        assert pages(info) == [], "the page came before the kill: nothing was tested"

        [page] = wait_for("the page, from the surviving Alertmanager", lambda: pages(info), timeout=90)
        page_after_kill = time.time() - killed_at
        assert page["status"] == "firing" and page["labels"][contract.L_VERSION] == VERSION

        # The stack restarts the killed instance, counts it, and it rejoins the cluster.
        def restarted() -> bool:
            now = stack_json(local_stack)
            return now.restarts.get(victim) == 1 and now.pids[victim] != victim_pid

        wait_for("the killed Alertmanager restarted", restarted, timeout=60)
        wait_for("the restarted Alertmanager back in the cluster", lambda: clustered(urls), timeout=60)
        local_stack.snapshot()

        clear_faults(info)
        cleared_at = time.time()
        bound = deadline_after(resolve_bound(spec, contract.ALERT_HIGH_ERROR_RATE))
        wait_for(
            "the resolved notification",
            lambda: [p for p in pages(info) if p["status"] == "resolved"],
            timeout=bound,
        )
        resolved_after = time.time() - cleared_at
    finally:
        traffic.stop()
        clear_faults(info)

    # Exactly once: one page, one firing and one resolved notification stored, however
    # many deliveries the two Alertmanagers made.
    [page] = pages(info)
    assert page["status"] == "resolved" and page["notifications"] == 2, page
    counts = httpx.get(info.url("pager", "/pages"), timeout=5, trust_env=False).json()["counts"]
    print(
        f"killed {victim} (first in line) when the alert fired; page {page_after_kill:.1f}s after the kill, "
        f"resolved {resolved_after:.1f}s after the fault cleared; the pager, all alerts: "
        f"{counts['deliveries']} deliveries, {counts['notifications']} notifications stored"
    )
    output = local_stack.output_text()
    assert f'msg="component exited; restarting" component={victim} reason="exited with code -9"' in output
    assert f"msg=restarted component={victim}" in output
    assert local_stack.stop() == 0, output[-3000:]
    assert [p for p in local_stack.seen if alive(p)] == []


def test_a_component_that_keeps_dying_stops_the_stack_saying_so(local_stack: UpStack) -> None:
    """The pager's database is replaced by something that is not one, then the pager dies:
    every restart fails, and after five restarts with backoff (1+2+4+8+16 s) up stops
    everything and names the cause."""
    info = local_stack.info
    processes = local_stack.snapshot()
    db = info.state_dir / "pager.sqlite"
    # Under the running pager (it keeps the old files open): only a restart reads the new one.
    # Its write-ahead log goes too, or SQLite would rebuild the database from it.
    garbage = db.with_name("garbage")
    garbage.write_text("this is not an SQLite database\n" * 100)
    garbage.replace(db)
    for extra in ("-wal", "-shm"):
        db.with_name(db.name + extra).unlink(missing_ok=True)
    os.kill(info.pids["pager"], signal.SIGKILL)
    code = local_stack.proc.wait(240)
    output = local_stack.output_text()
    assert code == 1, output[-3000:]
    retries = [ln for ln in output.splitlines() if 'msg="component exited; restarting" component=pager' in ln]
    assert [ln.split("restart_in=")[1].split()[0] for ln in retries] == ["1s", "2s", "4s", "8s", "16s"]
    assert 'reason="exited with code -9"' in retries[0]
    assert all('reason="exited with code 1 while restarting"' in ln for ln in retries[1:])
    errors = [ln for ln in output.splitlines() if ln.startswith("inferwatch: error: ")]
    assert len(errors) == 1, output[-3000:]
    assert errors[0].startswith(
        "inferwatch: error: pager failed 6 times in a row "
        "(5 restarts with backoff did not keep it up), the stack stops: "
        "last exited with code 1 while restarting"
    )
    assert f"cannot use the database {db}: file is not a database" in errors[0]
    assert "msg=stopped component=triton" in output  # the rest was stopped, and said so
    assert [p for p in processes | local_stack.snapshot() if alive(p)] == []
