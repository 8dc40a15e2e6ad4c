"""A small process supervisor: ordered start with readiness gates, restarts with backoff,
and a stop that leaves nothing behind.

Why not honcho or supervisord: honcho starts everything at once and has no readiness
gate, so Prometheus would start scraping (and Alertmanager delivering) before their
targets exist; supervisord is a daemon driven over XML-RPC with its own config format,
which would outlive a Ctrl-C. What the stack needs is narrow: start in order, wait on
each component's health endpoint, put each in its own process group, and on stop
terminate every process it ever spawned, including grandchildren that left the group
(the Triton launcher runs ``tritonserver`` as its own child). That is what this module
does, on ``subprocess`` and ``/proc``, in one place that tests exercise directly.

Once everything is up, ``supervise()`` (called periodically by the thread that started
the components) restarts a component that died, after a backoff that doubles with each
failure in a row, and gives up (``GaveUp``) when one has failed too many times in a row:
a crash loop is a broken stack, and saying so beats restarting it forever.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from inferwatch import logs
from inferwatch.process import die_with_parent

log = logs.get("inferwatch.stack")

# A process identity that survives pid reuse: (pid, start time in clock ticks since boot).
ProcId = tuple[int, int]


class StartError(Exception):
    """A component that could not be started or did not become ready; one line."""


class GaveUp(Exception):
    """A component kept failing after restarts; the stack must stop. One line."""


@dataclass(frozen=True)
class RestartPolicy:
    """How a component that died is restarted.

    A failure is an exit, or a restart that exits or is not ready in time. The n-th failure
    in a row waits ``backoff_s * 2**(n-1)`` (at most ``backoff_max_s``) before the restart;
    the failure after ``max_restarts`` restarts in a row gives up. A component that stays
    ready for ``stable_s`` has its count of failures in a row cleared."""

    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    max_restarts: int = 5
    stable_s: float = 60.0

    def delay(self, failures: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * 2 ** max(0, failures - 1))


@dataclass
class Component:
    """One long-running process of the stack."""

    name: str
    cmd: Sequence[str]
    ready_url: str
    log_path: Path
    env: Mapping[str, str] = field(default_factory=dict)
    ready_timeout: float = 120.0
    # What the summary shows (the address a user opens).
    url: str = ""


def _read_stat(pid: int) -> tuple[int, int, int, int] | None:
    """(ppid, pgid, sid, starttime) of ``pid``, or None when it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read().decode(errors="replace")
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields start after the last ')'.
    fields = raw[raw.rfind(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19])


def process_table() -> dict[int, tuple[int, int, int, int]]:
    """Every live process: pid -> (ppid, pgid, sid, starttime)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _read_stat(int(entry))
            if stat is not None:
                table[int(entry)] = stat
    return table


def family(root: int, table: Mapping[int, tuple[int, int, int, int]] | None = None) -> set[ProcId]:
    """``root``, its descendants, and whatever still sits in its session or process group
    (orphans reparented to init keep those)."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_rest) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = {pid for pid, (_pp, pgid, sid, _st) in table.items() if root in (pgid, sid)}
    stack = [root, *found]
    while stack:
        pid = stack.pop()
        if pid in table and pid not in found:
            found.add(pid)
        for child in children.get(pid, ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return {(pid, table[pid][3]) for pid in found if pid in table}


def alive(proc_id: ProcId) -> bool:
    stat = _read_stat(proc_id[0])
    return stat is not None and stat[3] == proc_id[1]


def _signal(proc_id: ProcId, sig: int) -> None:
    if alive(proc_id):
        try:
            os.kill(proc_id[0], sig)
        except ProcessLookupError:
            pass


UP, BACKOFF, RESTARTING = "up", "backoff", "restarting"


@dataclass
class Running:
    component: Component
    proc: subprocess.Popen
    # Every process ever seen in this component's family; what stop() must see gone.
    seen: set[ProcId] = field(default_factory=set)
    state: str = UP
    since: float = field(default_factory=time.monotonic)  # entered ``state`` at
    restarts: int = 0  # restarts started since the stack started
    failures: int = 0  # failures in a row (cleared once stable)
    restart_at: float = 0.0  # monotonic time of the next restart, in BACKOFF
    last_failure: str = ""

    def snapshot(self, table: Mapping[int, tuple[int, int, int, int]] | None = None) -> None:
        self.seen |= family(self.proc.pid, table)


def log_tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:])


class Supervisor:
    """Starts components in order, each in its own session (so its process group is its
    own, and a Ctrl-C on the terminal reaches only us), and stops them in reverse."""

    def __init__(
        self, stop_event: threading.Event | None = None, policy: RestartPolicy | None = None
    ) -> None:
        self.running: list[Running] = []
        self.stop_event = stop_event or threading.Event()
        self.policy = policy or RestartPolicy()

    def start(self, component: Component) -> Running:
        proc = self._spawn(component)
        running = Running(component, proc)
        running.snapshot()
        self.running.append(running)
        log.info("starting", component=component.name, pid=proc.pid, log=str(component.log_path))
        return running

    def wait_ready(self, running: Running, on_wait: Callable[[float], None] | None = None) -> float:
        """Poll the component's ready URL; raise StartError if it exits or times out."""
        comp = running.component
        t0 = time.monotonic()
        deadline = t0 + comp.ready_timeout
        last = "no answer yet"
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while True:
                if self.stop_event.is_set():
                    raise StartError(f"{comp.name}: start interrupted")
                code = running.proc.poll()
                if code is not None:
                    tail = log_tail(comp.log_path)
                    raise StartError(
                        f"{comp.name} exited with code {code} while starting; its log {comp.log_path} "
                        f"ends: {tail or '(empty)'}"
                    )
                try:
                    resp = client.get(comp.ready_url)
                    if resp.status_code == 200:
                        break
                    last = f"HTTP {resp.status_code}"
                except httpx.HTTPError as exc:
                    last = type(exc).__name__
                now = time.monotonic()
                if now > deadline:
                    raise StartError(
                        f"{comp.name} not ready after {comp.ready_timeout:.0f}s ({comp.ready_url}: {last}); "
                        f"see {comp.log_path}"
                    )
                if on_wait:
                    on_wait(now - t0)
                self.stop_event.wait(0.2)
        running.snapshot()
        took = time.monotonic() - t0
        log.info("ready", component=comp.name, pid=running.proc.pid, seconds=f"{took:.1f}")
        return took

    def check(self) -> Running | None:
        """The first component that exited on its own, if any; also records new descendants."""
        table = process_table()
        for running in self.running:
            if running.proc.poll() is not None:
                return running
            running.snapshot(table)
        return None

    def _spawn(self, component: Component) -> subprocess.Popen:
        component.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(component.log_path, "ab") as out:
            return subprocess.Popen(
                # SIGTERM when the stack's process dies without stopping it (SIGKILL, a crash)
                die_with_parent(list(component.cmd)),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **component.env},
                start_new_session=True,
            )

    def supervise(self, now: float | None = None) -> list[Running]:
        """One round of supervision: restart what died (after its backoff), watch restarts
        become ready. Returns the components whose process changed or became ready this
        round; raises GaveUp when one failed again after ``policy.max_restarts`` restarts
        in a row. Call it from the thread that started the components (die_with_parent)."""
        now = time.monotonic() if now is None else now
        table = process_table()
        changed = []
        for running in self.running:
            comp = running.component
            code = running.proc.poll()
            if running.state == UP:
                if code is not None:
                    self._failed(running, f"exited with code {code}", now)
                    changed.append(running)
                    continue
                running.snapshot(table)
                if running.failures and now - running.since >= self.policy.stable_s:
                    running.failures = 0  # stable again: the next failure starts the backoff afresh
            elif running.state == BACKOFF and now >= running.restart_at:
                running.proc = self._spawn(comp)
                running.restarts += 1
                running.state, running.since = RESTARTING, now
                running.snapshot(table)
                log.warning(
                    "restarting", component=comp.name, pid=running.proc.pid, restarts=running.restarts
                )
                changed.append(running)
            elif running.state == RESTARTING:
                if code is not None:
                    self._failed(running, f"exited with code {code} while restarting", now)
                elif self._ready(comp):
                    running.state, running.since = UP, now
                    running.snapshot()
                    log.warning(
                        "restarted",
                        component=comp.name,
                        pid=running.proc.pid,
                        restarts=running.restarts,
                        seconds=f"{now - running.restart_at:.1f}",
                    )
                    changed.append(running)
                elif now - running.since > comp.ready_timeout:
                    self._failed(running, f"not ready {comp.ready_timeout:.0f}s after its restart", now)
                else:
                    running.snapshot(table)
        return changed

    def _ready(self, comp: Component) -> bool:
        try:
            return httpx.get(comp.ready_url, timeout=1.0, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def _failed(self, running: Running, what: str, now: float) -> None:
        """Count a failure; schedule the restart, or raise GaveUp past the limit."""
        comp = running.component
        # What the process left (grandchildren holding its ports) goes before a restart; a
        # restart that is not ready in time is still running, and is stopped here too.
        self.stop_one(running, 5.0)
        running.failures += 1
        tail = log_tail(comp.log_path, 3)
        running.last_failure = f"{what}; its log {comp.log_path} ends: {tail or '(empty)'}"
        if running.failures > self.policy.max_restarts:
            log.error(
                "component keeps failing; giving up",
                component=comp.name,
                failures=running.failures,
                reason=what,
                tail=tail,
            )
            raise GaveUp(
                f"{comp.name} failed {running.failures} times in a row ({self.policy.max_restarts} restarts "
                f"with backoff did not keep it up), the stack stops: last {running.last_failure}"
            )
        delay = self.policy.delay(running.failures)
        running.state, running.since, running.restart_at = BACKOFF, now, now + delay
        log.warning(
            "component exited; restarting",
            component=comp.name,
            reason=what,
            failures_in_a_row=running.failures,
            restart_in=f"{delay:g}s",
            log=str(comp.log_path),
            tail=tail,
        )

    def stop_one(self, running: Running, timeout: float = 15.0) -> list[ProcId]:
        """SIGTERM the component's process group, SIGKILL it after ``timeout``; then end any
        process of its family that escaped the group. Returns what survived (nothing, unless
        the kernel refuses)."""
        name = running.component.name
        pid = running.proc.pid
        if running.proc.poll() is None:
            running.snapshot()
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            running.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("did not stop in time; killing", component=name, pid=pid, seconds=timeout)
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            running.proc.wait()
        # Grandchildren in their own sessions (or that ignored SIGTERM) are ended one by one,
        # giving each the same grace period first.
        left = [p for p in running.seen if alive(p)]
        for proc_id in left:
            _signal(proc_id, signal.SIGTERM)
        deadline = time.monotonic() + min(timeout, 5.0)
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = [p for p in left if alive(p)]
        for proc_id in left:
            log.warning("killing a leftover process", component=name, pid=proc_id[0])
            _signal(proc_id, signal.SIGKILL)
        time.sleep(0.05 if left else 0)
        survivors = [p for p in running.seen if alive(p)]
        log.info("stopped", component=name, pid=pid, code=running.proc.returncode)
        return survivors

    def stop_all(self, timeout: float = 15.0) -> list[ProcId]:
        survivors: list[ProcId] = []
        while self.running:
            running = self.running.pop()
            try:
                survivors += self.stop_one(running, timeout)
            except Exception as exc:  # one component's trouble must not leave the others running
                log.error("stop failed", component=running.component.name, error=repr(exc))
                survivors += [p for p in running.seen if alive(p)]
        return survivors

    def all_seen(self) -> set[ProcId]:
        out: set[ProcId] = set()
        for running in self.running:
            out |= running.seen
        return out
