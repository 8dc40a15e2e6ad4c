"""``inferwatch demo``: an incident played on the local stack, from fault to page.

The scenario: steady traffic through the sidecar (every model, the ranker's stable and
canary versions side by side); then three faults, one per alert tier (an error burst in
one model, a latency regression in the ranker canary, GPU memory pressure on the
simulated exporter); then recovery. Every page is read back from the pager receiver, so
what the table reports is what an on-call engineer would have received. The ranker canary
is also judged as a deploy pipeline would (``inferwatch.canary.judge``, the spec's canary
window): once while its latency fault holds, once when a whole window has passed since
recovery.

Timing comes from the fleet spec alone (``timing.py``); what the stack shows comes from
``observe.py``; what a person sees is ``demo_view.py``. This module plays the scenario.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import httpx

from inferwatch import contract, logs
from inferwatch.canary import CanaryError, judge
from inferwatch.spec import FleetSpec, duration_seconds
from inferwatch.stack.core import StackInfo
from inferwatch.stack.observe import AlertState, Observer, Page
from inferwatch.stack.timing import (
    deadline_after,
    default_steady,
    next_error_window_start,
    resolve_bound,
    theoretical_minimum,
)

log = logs.get("inferwatch.demo")

DEFAULT_RATE = 20.0  # requests per second of the steady traffic

PHASE_STEADY = "steady"
PHASE_FAULTS = "faults"
PHASE_RECOVERY = "recovery"
PHASE_DONE = "done"

# The steady traffic: (model, version, relative weight). Every version is named, so each
# page's version label is known in advance. The dense models read 64 MiB of weights per
# request (tens of ms of CPU here), so they get a small share; the cheap ranker gets more,
# which also gives its P99 enough samples per window to be more than one request's noise.
TRAFFIC_MIX = (
    ("dense_batched", "1", 1.0),
    ("dense_unbatched", "1", 1.0),
    ("ranker", "1", 4.0),
    ("ranker", "2", 4.0),
)


@dataclass
class Fault:
    key: str
    title: str
    alertname: str
    severity: str
    match: dict[str, str]  # labels the page must carry
    minimum_s: float
    resolve_bound_s: float
    injected_at: float | None = None
    active_at: float | None = None  # Prometheus' activeAt of the alert: pending (or firing) since
    page_at: float | None = None
    cleared_at: float | None = None
    resolved_at: float | None = None
    page: Page | None = None
    firing_pages: int = 0
    resolved_pages: int = 0
    skipped: str = ""

    def matches(self, page: Page) -> bool:
        return page.alertname == self.alertname and all(
            page.labels.get(k) == v for k, v in self.match.items()
        )

    @property
    def delay_s(self) -> float | None:
        if self.injected_at is None or self.page_at is None:
            return None
        return self.page_at - self.injected_at

    @property
    def resolve_delay_s(self) -> float | None:
        if self.cleared_at is None or self.resolved_at is None:
            return None
        return self.resolved_at - self.cleared_at


@dataclass
class CanaryVerdict:
    """``inferwatch canary`` on the latency fault's model: its canary against the baseline."""

    when: str  # CANARY_DURING or CANARY_AFTER
    model: str
    baseline: str
    canary: str
    window: str
    at: float
    verdict: str  # pass, fail, inconclusive, or "error" when Prometheus could not answer
    why: str
    checks: list[dict] = field(default_factory=list)


CANARY_DURING = "during the latency fault"
CANARY_AFTER = "after recovery"


@dataclass
class DemoResult:
    spec_path: str
    started_at: float
    steady_s: float
    faults: list[Fault]
    steady_pages: list[Page] = field(default_factory=list)
    unexpected_pages: list[Page] = field(default_factory=list)
    pages: list[Page] = field(default_factory=list)
    traffic: dict = field(default_factory=dict)
    canary: list[CanaryVerdict] = field(default_factory=list)
    faults_started_at: float | None = None
    ended_at: float = 0.0
    aborted: str = ""

    @property
    def ok(self) -> bool:
        return not self.aborted and all(
            f.skipped or (f.page_at is not None and f.resolved_at is not None) for f in self.faults
        )

    def problems(self) -> list[str]:
        out = []
        if self.aborted:
            out.append(self.aborted)
        for f in self.faults:
            if f.skipped or (self.aborted and f.injected_at is None):
                continue
            if f.page_at is None:
                out.append(f"{f.title}: no {f.alertname} page arrived")
            elif f.resolved_at is None:
                out.append(f"{f.title}: no resolved notification arrived after recovery")
        return out

    def to_json(self) -> dict:
        def page(p: Page) -> dict:
            return asdict(p)

        return {
            "spec": self.spec_path,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "steady_s": self.steady_s,
            "ok": self.ok,
            "problems": self.problems(),
            "faults": [
                {
                    **{k: v for k, v in asdict(f).items() if k != "page"},
                    "delay_s": f.delay_s,
                    "resolve_delay_s": f.resolve_delay_s,
                    "page": page(f.page) if f.page else None,
                }
                for f in self.faults
            ],
            "steady_pages": [page(p) for p in self.steady_pages],
            "unexpected_pages": [page(p) for p in self.unexpected_pages],
            "pages": [page(p) for p in self.pages],
            "traffic": self.traffic,
            "canary": [asdict(v) for v in self.canary],
        }


# ---------------------------------------------------------------------------------------
# Actions on the stack
# ---------------------------------------------------------------------------------------
class Traffic:
    """Steady open-loop traffic through the sidecar (reference_server.loadgen in its own
    thread) until stopped."""

    def __init__(self, info: StackInfo, rate: float, mix: tuple[tuple[str, str, float], ...]) -> None:
        from reference_server.loadgen import LoadConfig, LoadGenerator, Target

        targets = [Target(model, version, weight) for model, version, weight in mix]
        config = LoadConfig(url=info.sidecar_http, protocol="http", targets=targets, rate=rate, duration=None)
        self._gen = LoadGenerator(config)
        self.summary: dict = {}
        self.error = ""

    def start(self) -> None:
        self._gen.start()

    def stop(self) -> None:
        try:
            self.summary = self._gen.stop(timeout=30).to_dict()
        except Exception as exc:  # the load generator's own failure, reported by the demo
            self.error = f"{type(exc).__name__}: {exc}"

    @property
    def alive(self) -> bool:
        return self._gen.running

    def snapshot(self) -> dict:
        return self._gen.snapshot().to_dict()


def set_fault(info: StackInfo, model: str, version: str | None, **knobs: float | int) -> None:
    """One of Triton's fault knobs (reference_server.faults.set_fault's keywords)."""
    from reference_server import faults

    faults.set_fault(model, version=version, state_dir=info.faults_state_dir, **knobs)


def clear_faults(info: StackInfo) -> None:
    from reference_server import faults

    faults.clear(state_dir=info.faults_state_dir)


def simulate_gpu(info: StackInfo, body: dict) -> bool:
    """POST /simulate on the GPU exporter; False when its backend is not the simulated one."""
    resp = httpx.post(info.url("gpu_exporter", "/simulate"), json=body, timeout=5.0, trust_env=False)
    if resp.status_code == 404:
        return False
    resp.raise_for_status()
    return True


# ---------------------------------------------------------------------------------------
# The scenario
# ---------------------------------------------------------------------------------------
@dataclass
class Scenario:
    steady_s: float | None = None  # default: default_steady(spec)
    rate: float = DEFAULT_RATE
    mix: tuple[tuple[str, str, float], ...] = TRAFFIC_MIX
    error_model: str = "dense_unbatched"
    error_version: str = "1"
    error_rate: float = 0.5
    latency_model: str = "ranker"
    latency_version: str = "2"
    baseline_version: str = "1"  # what the canary verdict compares latency_version with
    canary: bool = True  # judge the latency fault's canary against its baseline
    extra_latency_ms: float = 300.0
    gpu: str = "0"
    gpu_fb_used_ratio: float = 0.97
    stagger_s: float = 5.0  # between injections, so each page is told apart in time


def plan_faults(spec: FleetSpec, sc: Scenario) -> list[Fault]:
    def fault(key: str, title: str, alertname: str, match: dict[str, str]) -> Fault:
        return Fault(
            key,
            title,
            alertname,
            contract.TIERED_ALERTS[alertname],
            match,
            theoretical_minimum(spec, alertname),
            resolve_bound(spec, alertname),
        )

    return [
        fault(
            "error-burst",
            f"error burst: {sc.error_model} v{sc.error_version} fails {sc.error_rate:.0%}",
            contract.ALERT_HIGH_ERROR_RATE,
            {contract.L_MODEL: sc.error_model, contract.L_VERSION: sc.error_version},
        ),
        fault(
            "latency-regression",
            f"latency regression: {sc.latency_model} v{sc.latency_version} (canary) "
            f"+{sc.extra_latency_ms:g} ms",
            contract.ALERT_HIGH_P99_LATENCY,
            {contract.L_MODEL: sc.latency_model, contract.L_VERSION: sc.latency_version},
        ),
        fault(
            "gpu-memory",
            f"GPU memory pressure: gpu {sc.gpu} at {sc.gpu_fb_used_ratio:.0%} framebuffer",
            contract.ALERT_GPU_MEMORY_PRESSURE,
            {contract.L_GPU: sc.gpu},
        ),
    ]


class Reporter:
    """What the demo tells a person; the live view and the line log implement it."""

    def phase(self, name: str, text: str) -> None: ...
    def event(self, text: str) -> None: ...
    def tick(self) -> None: ...
    def close(self) -> None: ...


class Demo:
    def __init__(
        self,
        info: StackInfo,
        spec: FleetSpec,
        scenario: Scenario,
        stop: threading.Event,
        watch: Callable[[], None] | None = None,
    ) -> None:
        self.info = info
        self.watch = watch  # called between the demo's waits: the stack's supervision round
        self.spec = spec
        self.sc = scenario
        self.stop_event = stop
        self.faults = self._plan()
        steady = scenario.steady_s if scenario.steady_s is not None else default_steady(spec)
        self.result = DemoResult(str(info.spec_path), time.time(), steady, self.faults)
        self.phase = PHASE_STEADY
        self.phase_started = time.time()
        self.reporter: Reporter = Reporter()
        self.observer = Observer(info, spec, self._on_page, self._on_alert)
        self.traffic: Traffic | None = None
        self._lock = threading.Lock()

    def _plan(self) -> list[Fault]:
        return plan_faults(self.spec, self.sc)

    def expected_seconds(self) -> float:
        """Roughly how long the incident plays when every page comes at its minimum."""
        faults = self.faults
        stagger = self.sc.stagger_s * (len(faults) - 1)
        return (
            self.result.steady_s
            + stagger
            + max(f.minimum_s for f in faults)
            + max(f.resolve_bound_s for f in faults)
        )

    # -- callbacks from the observer thread --------------------------------------------
    def _on_page(self, page: Page, event: str) -> None:
        """A new alert occurrence (``firing``) or its resolution (``resolved``)."""
        r = self.result
        with self._lock:
            if event == "firing":
                r.pages.append(page)
                fault = next((f for f in self.faults if f.matches(page)), None)
                faults_at = r.faults_started_at
                if faults_at is None or page.received_at < faults_at:
                    r.steady_pages.append(page)
                elif fault is None or fault.injected_at is None or page.received_at < fault.injected_at:
                    r.unexpected_pages.append(page)
                else:
                    fault.firing_pages += 1
                    if fault.page is None:
                        fault.page_at, fault.page = page.received_at, page
            else:
                # The stored occurrence changed state: keep the latest copy.
                r.pages = [page if p.key == page.key else p for p in r.pages]
                for f in self.faults:
                    if f.page is not None and f.page.key == page.key:
                        f.page = page
                        if f.cleared_at is not None and f.resolved_at is None:
                            f.resolved_at = page.last_received_at
                        f.resolved_pages += 1
        at = page.received_at if event == "firing" else page.last_received_at
        self.reporter.event(f"page {event}: {page.describe()} (t+{at - r.started_at:.1f}s)")
        log.info("page received", status=event, alert=page.alertname, labels=page.ident())

    def _on_alert(self, alert: AlertState, old: str) -> None:
        with self._lock:
            for f in self.faults:
                if (
                    f.active_at is None
                    and f.injected_at is not None
                    and alert.state in ("pending", "firing")
                    and alert.alertname == f.alertname
                    and all(alert.labels.get(k) == v for k, v in f.match.items())
                ):
                    f.active_at = alert.active_at
        self.reporter.event(f"alert {alert.alertname} {{{alert.ident()}}}: {old} -> {alert.state}")

    # -- phases ----------------------------------------------------------------------------
    def _set_phase(self, phase: str, text: str) -> None:
        self.phase = phase
        self.phase_started = time.time()
        self.reporter.phase(phase, text)
        log.info("demo phase", phase=phase, detail=text)

    def _sleep(self, seconds: float) -> bool:
        """Sleep while ticking the view; False when stopped or the traffic died."""
        end = time.time() + seconds
        while time.time() < end:
            if self.stop_event.is_set():
                self.result.aborted = "interrupted"
                return False
            if self.traffic is not None and not self.traffic.alive:
                self.result.aborted = f"the demo's traffic stopped: {self.traffic.error or 'unknown reason'}"
                return False
            self.reporter.tick()
            if self.watch is not None:
                self.watch()
            self.stop_event.wait(min(0.5, max(0.0, end - time.time())))
        return True

    def _wait_for(self, done: Callable[[], bool], deadline: float) -> bool:
        while not done():
            if time.time() > deadline:
                return False
            if not self._sleep(0.5):
                return False
        return True

    def run(self, reporter: Reporter | None = None) -> DemoResult:
        if reporter is not None:
            self.reporter = reporter
        r = self.result
        self.observer.start()
        self.traffic = self._make_traffic()
        try:
            self._reset()
            self._prepare()
            self.traffic.start()
            self._set_phase(
                PHASE_STEADY, f"{r.steady_s:g}s of steady traffic ({self._traffic_text()}): nothing may page"
            )
            if not self._sleep(r.steady_s):
                return self._finish()
            for faults in self._rounds():
                if not self._play(faults):
                    break
            return self._finish()
        finally:
            self.traffic.stop()
            r.traffic = self.traffic.summary
            self.observer.stop()
            # A demo stopped half-way must not leave the stack faulty.
            try:
                self._reset()
            except (httpx.HTTPError, OSError):
                pass

    def _play(self, faults: list[Fault]) -> bool:
        """One round: inject its faults, wait for their pages, clear them, wait for the
        resolved notifications. False when the demo was stopped."""
        r = self.result
        # The error burst starts at a fixed place in its rule's window (error_burst_lead).
        aligned = faults and faults[0].alertname == contract.ALERT_HIGH_ERROR_RATE
        if aligned and not self._sleep(next_error_window_start(self.spec, time.time()) - time.time()):
            return False
        if r.faults_started_at is None:
            r.faults_started_at = time.time()
        self._set_phase(PHASE_FAULTS, f"injecting {', '.join(f.alertname for f in faults)}")
        for i, f in enumerate(faults):
            if i and not self._sleep(self.sc.stagger_s):
                return False
            self._inject(f)
        active = [f for f in faults if not f.skipped]
        last = max((f.injected_at or 0) + deadline_after(f.minimum_s) for f in active) if active else 0
        self._wait_for(lambda: all(f.page_at is not None for f in active), last)
        if r.aborted:
            return False
        canary = self.sc.canary and any(f.key == "latency-regression" for f in active)
        if canary:
            self._judge_canary(CANARY_DURING)
        self._set_phase(PHASE_RECOVERY, "clearing the faults: each alert must resolve")
        self._recover()
        cleared = time.time()
        for f in active:
            f.cleared_at = cleared
            self.reporter.event(f"cleared: {f.title}")
        last = cleared + max((deadline_after(f.resolve_bound_s) for f in active), default=0)
        fired = [f for f in active if f.page_at is not None]
        self._wait_for(lambda: all(f.resolved_at is not None for f in fired), last)
        # The verdict after recovery judges a window that holds no faulty request: it
        # ends a whole window and two scrapes (the last slow requests scraped) after the clear.
        scrape = duration_seconds(self.spec.prometheus.scrape_interval)
        window = duration_seconds(self.spec.canary.window)
        if canary and not r.aborted and self._sleep(cleared + window + 2 * scrape - time.time()):
            self._judge_canary(CANARY_AFTER)
        return not r.aborted

    # -- what this scenario does to the stack (the LLM scenario overrides these) -----------
    def _rounds(self) -> list[list[Fault]]:
        """The faults played together, round after round (the main demo: one round)."""
        return [self.faults]

    def _make_traffic(self) -> Traffic:
        return Traffic(self.info, self.sc.rate, self.sc.mix)

    def _traffic_text(self) -> str:
        return f"{self.sc.rate:g} req/s"

    def _reset(self) -> None:
        clear_faults(self.info)
        simulate_gpu(self.info, {"fb_used_ratio": None})

    def _prepare(self) -> None:
        """Anything the servers need before the measured traffic starts."""

    def _recover(self) -> None:
        clear_faults(self.info)
        if not any(f.key == "gpu-memory" and f.skipped for f in self.faults):
            simulate_gpu(self.info, {"fb_used_ratio": None})

    def _inject(self, f: Fault) -> None:
        sc = self.sc
        if f.key == "error-burst":
            set_fault(self.info, sc.error_model, sc.error_version, error_rate=sc.error_rate)
        elif f.key == "latency-regression":
            set_fault(self.info, sc.latency_model, sc.latency_version, extra_latency_ms=sc.extra_latency_ms)
        elif f.key == "gpu-memory" and not simulate_gpu(
            self.info, {"fb_used_ratio": sc.gpu_fb_used_ratio, "gpus": [int(sc.gpu)]}
        ):
            f.skipped = "the GPU exporter reads a real GPU (NVML): memory pressure cannot be simulated"
            self.reporter.event(f"skipped: {f.title}: {f.skipped}")
            return
        self._injected(f)

    def _injected(self, f: Fault) -> None:
        f.injected_at = time.time()
        self.reporter.event(
            f"injected: {f.title} (expect {f.alertname} [{f.severity}] in >= {f.minimum_s:g}s)"
        )
        log.info("fault injected", fault=f.key, alert=f.alertname, minimum_s=f"{f.minimum_s:g}")

    def _judge_canary(self, when: str) -> None:
        sc = self.sc
        at = time.time()
        args = (sc.latency_model, sc.baseline_version, sc.latency_version)
        try:
            report = judge(self.info.prometheus_url, *args, self.spec, at=at)
        except CanaryError as exc:
            v = CanaryVerdict(when, *args, self.spec.canary.window, at, "error", str(exc))
        else:
            checks = [{"name": ch.name, "verdict": ch.verdict, "reason": ch.reason} for ch in report.checks]
            v = CanaryVerdict(when, *args, report.window, at, report.verdict, report.why, checks)
        self.result.canary.append(v)
        self.reporter.event(
            f"canary {v.model} v{v.canary} against v{v.baseline} ({when}, last {v.window}): "
            f"{v.verdict}: {v.why}"
        )
        log.info("canary verdict", when=when, verdict=v.verdict, why=v.why)

    def _finish(self) -> DemoResult:
        self.result.ended_at = time.time()
        self._set_phase(PHASE_DONE, "finished" if self.result.ok else "; ".join(self.result.problems()))
        return self.result


def results_table_rows(result: DemoResult) -> list[list[str]]:
    """Rows of the final table: fault, injected, page, delay, minimum, ratio, resolved, and
    on the latency fault's row the canary verdicts (during the fault, then after recovery)."""

    def rel(t: float | None) -> str:
        return f"t+{t - result.started_at:.1f}s" if t is not None else "-"

    rows = []
    for f in result.faults:
        delay = f.delay_s
        rows.append(
            [
                f.title,
                f"{f.alertname} [{f.severity}]",
                rel(f.injected_at),
                rel(f.page_at) if not f.skipped else "skipped",
                f"{delay:.1f}s" if delay is not None else "-",
                f"{f.minimum_s:g}s",
                f"{delay / f.minimum_s:.2f}x" if delay is not None else "-",
                f"{f.resolve_delay_s:.1f}s" if f.resolve_delay_s is not None else "-",
                canary_cell(result) if f.key == "latency-regression" else "",
            ]
        )
    return rows


def canary_cell(result: DemoResult) -> str:
    """``fail → pass``: the canary's verdict during its fault, then after recovery."""
    by_when = {v.when: v.verdict for v in result.canary}
    return " → ".join(by_when.get(w, "-") for w in (CANARY_DURING, CANARY_AFTER))


RESULT_COLUMNS = [
    "fault",
    "page",
    "injected",
    "page arrived",
    "delay",
    "theoretical min",
    "delay/min",
    "resolved after",
    "canary verdict",
]
