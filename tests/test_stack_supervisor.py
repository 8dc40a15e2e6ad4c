"""The stack's supervisor on real processes: ordered readiness, a start failure that says
why, restarts with backoff and giving up on a crash loop, and a stop that leaves nothing
behind (grandchildren in their own sessions and processes that ignore SIGTERM included)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inferwatch import logs
from inferwatch.stack.supervisor import (
    UP,
    Component,
    GaveUp,
    RestartPolicy,
    Running,
    StartError,
    Supervisor,
    alive,
    family,
    process_table,
)
from tests.fixtures.net import free_port

# A component that leaves two grandchildren behind the group's back: one in its own
# session, one that ignores SIGTERM; then serves HTTP so it can become ready.
STUBBORN = """
import os, signal, subprocess, sys
a = subprocess.Popen(["sleep", "300"], start_new_session=True)
b = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"])
open(sys.argv[2], "w").write(f"{a.pid} {b.pid}")
os.execvp(sys.executable, [sys.executable, "-m", "http.server", sys.argv[1], "--bind", "127.0.0.1"])
"""


def http_component(tmp_path: Path, name: str, script: str | None = None, timeout: float = 30) -> Component:
    port = free_port()
    pids = tmp_path / f"{name}.pids"
    cmd = (
        [sys.executable, "-c", script, str(port), str(pids)]
        if script
        else [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    )
    return Component(name, cmd, f"http://127.0.0.1:{port}/", tmp_path / f"{name}.log", ready_timeout=timeout)


def test_stop_leaves_no_process_behind(tmp_path: Path) -> None:
    sup = Supervisor()
    comp = http_component(tmp_path, "stubborn", STUBBORN)
    running = sup.start(comp)
    sup.wait_ready(running)
    grandchildren = [int(p) for p in (tmp_path / "stubborn.pids").read_text().split()]
    table = process_table()
    ids = {(pid, table[pid][3]) for pid in grandchildren}
    assert ids <= family(running.proc.pid, table), "the escaped grandchild is part of the family"
    sup.check()  # records the family, as the stack's watch loop does

    t0 = time.monotonic()
    survivors = sup.stop_all(timeout=2.0)
    assert survivors == []
    assert not any(alive(p) for p in ids), "grandchildren survived the stop"
    assert running.proc.returncode is not None
    assert time.monotonic() - t0 < 15


def test_components_start_in_order_and_stop_in_reverse(tmp_path: Path) -> None:
    lines = io.StringIO()
    logs.setup("info", "inferwatch.stack", "logfmt", stream=lines)
    try:
        sup = Supervisor()
        for name in ("first", "second"):
            sup.wait_ready(sup.start(http_component(tmp_path, name)))
        assert [r.component.name for r in sup.running] == ["first", "second"]
        sup.stop_all()
    finally:
        logs.setup("info", "inferwatch.stack", "logfmt")
    events = [
        (line.split("msg=")[1].split()[0], line.split("component=")[1].split()[0])
        for line in lines.getvalue().splitlines()
    ]
    assert events == [
        ("starting", "first"),
        ("ready", "first"),
        ("starting", "second"),
        ("ready", "second"),
        ("stopped", "second"),
        ("stopped", "first"),
    ]
    assert not sup.running


def test_a_component_that_dies_while_starting_says_why(tmp_path: Path) -> None:
    sup = Supervisor()
    comp = Component(
        "broken",
        [
            sys.executable,
            "-c",
            "import sys; print('cannot open the model repository', file=sys.stderr); sys.exit(3)",
        ],
        f"http://127.0.0.1:{free_port()}/",
        tmp_path / "broken.log",
    )
    running = sup.start(comp)
    with pytest.raises(StartError) as err:
        sup.wait_ready(running)
    message = str(err.value)
    assert "broken exited with code 3" in message
    assert "cannot open the model repository" in message
    assert "\n" not in message
    sup.stop_all()


def test_a_component_that_never_gets_ready_times_out(tmp_path: Path) -> None:
    sup = Supervisor()
    comp = Component(
        "silent",
        [sys.executable, "-c", "import time; time.sleep(60)"],
        f"http://127.0.0.1:{free_port()}/",
        tmp_path / "silent.log",
        ready_timeout=1.0,
    )
    running = sup.start(comp)
    with pytest.raises(StartError, match=r"silent not ready after 1s"):
        sup.wait_ready(running)
    sup.stop_all(timeout=2.0)
    assert running.proc.returncode is not None


def test_check_reports_a_component_that_exited(tmp_path: Path) -> None:
    sup = Supervisor()
    running = sup.start(http_component(tmp_path, "web"))
    sup.wait_ready(running)
    assert sup.check() is None
    os.kill(running.proc.pid, 9)
    running.proc.wait()
    assert sup.check() is running
    sup.stop_all()


# The stack's own process, reduced to its supervisor: starts one component, then waits.
PARENT = """
import sys, threading
from pathlib import Path
from inferwatch.stack.supervisor import Component, Supervisor
port, log = sys.argv[1], Path(sys.argv[2])
cmd = [sys.executable, "-m", "http.server", port, "--bind", "127.0.0.1"]
sup = Supervisor()
running = sup.start(Component("web", cmd, f"http://127.0.0.1:{port}/", log))
sup.wait_ready(running)
print(running.proc.pid, flush=True)
threading.Event().wait()
"""


def test_components_die_with_a_stack_that_is_killed(tmp_path: Path) -> None:
    """SIGKILL gives the stack no chance to stop its components; the kernel still ends them."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(free_port()), str(tmp_path / "web.log")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        table = process_table()
        child_id = (child, table[child][3])
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 20
    while alive(child_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    survived = alive(child_id)
    if survived:
        os.kill(child, 9)  # leave nothing behind, then fail
    assert not survived, "the component outlived the stack's process"


# A web server that refuses to start while a "broken" file exists beside its log: how a
# component that keeps dying (a bad disk, a port someone else took) looks to the supervisor.
FRAGILE = """
import os, sys
if os.path.exists(sys.argv[2] + ".broken"):
    print("cannot open the database: disk I/O error", file=sys.stderr, flush=True)
    sys.exit(3)
os.execvp(sys.executable, [sys.executable, "-m", "http.server", sys.argv[1], "--bind", "127.0.0.1"])
"""


def supervise_until(sup: Supervisor, done, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "supervision did not get there in time"
        sup.supervise()
        time.sleep(0.05)


def log_lines(buf: io.StringIO, msg: str) -> list[str]:
    return [line for line in buf.getvalue().splitlines() if f"msg={msg} " in line or f'msg="{msg}"' in line]


def test_a_component_that_dies_is_restarted_with_backoff_and_counted(tmp_path: Path) -> None:
    lines = io.StringIO()
    logs.setup("info", "inferwatch.stack", "logfmt", stream=lines)
    sup = Supervisor(policy=RestartPolicy(backoff_s=0.3, max_restarts=5, stable_s=3.0))
    try:
        running = sup.start(http_component(tmp_path, "web"))
        sup.wait_ready(running)
        first = running.proc.pid
        assert sup.supervise() == []  # nothing to do while it runs

        os.kill(first, 9)
        running.proc.wait()
        t0 = time.monotonic()
        supervise_until(sup, lambda: running.state == UP and running.proc.pid != first)
        assert time.monotonic() - t0 >= 0.3  # not before its backoff
        second = running.proc.pid
        assert running.restarts == 1 and running.failures == 1

        # Dead again before it was stable: the backoff doubles.
        os.kill(second, 9)
        running.proc.wait()
        supervise_until(sup, lambda: running.state == UP and running.proc.pid != second)
        assert running.restarts == 2 and running.failures == 2
        # Up for stable_s: the count in a row clears, and the next backoff is the first again.
        supervise_until(sup, lambda: running.failures == 0, timeout=10)
        os.kill(running.proc.pid, 9)
        running.proc.wait()
        supervise_until(sup, lambda: running.state == UP and running.restarts == 3)
        assert sup.check() is None
    finally:
        sup.stop_all()
        logs.setup("info", "inferwatch.stack", "logfmt")
    exits = log_lines(lines, "component exited; restarting")
    assert len(exits) == 3
    assert [line.split("restart_in=")[1].split()[0] for line in exits] == ["0.3s", "0.6s", "0.3s"]
    assert 'reason="exited with code -9"' in exits[0] and "component=web" in exits[0]
    assert len(log_lines(lines, "restarted")) == 3
    assert not any(alive(p) for p in running.seen)


def test_a_component_that_keeps_dying_makes_the_supervisor_give_up(tmp_path: Path) -> None:
    sup = Supervisor(policy=RestartPolicy(backoff_s=0.1, max_restarts=3))
    comp = http_component(tmp_path, "fragile", FRAGILE)
    broken = Path(f"{tmp_path / 'fragile.pids'}.broken")
    try:
        running: Running = sup.start(comp)
        sup.wait_ready(running)
        broken.write_text("")
        os.kill(running.proc.pid, 9)
        t0 = time.monotonic()
        with pytest.raises(GaveUp) as err:
            supervise_until(sup, lambda: False)
        took = time.monotonic() - t0
    finally:
        survivors = sup.stop_all(timeout=2.0)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("fragile failed 4 times in a row (3 restarts with backoff did not keep it up)")
    assert "exited with code 3 while restarting" in message
    assert "cannot open the database: disk I/O error" in message and str(comp.log_path) in message
    assert running.restarts == 3
    assert took >= 0.1 + 0.2 + 0.4  # each restart waited its backoff
    assert survivors == []
