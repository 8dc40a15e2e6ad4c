"""A load generator for KServe v2 servers (Triton, the sidecar, the naive server) via tritonclient.

Two modes:

- open loop (``rate``): Poisson arrivals at the asked rate, each request sent at its scheduled
  time whatever the server does, on asyncio clients, so a slow server cannot slow the sender
  (and hide its latency). Latency is measured from the scheduled time, so a sender that falls
  behind shows it in the numbers instead of hiding it. When the sender cannot keep up (more than
  ``max_in_flight`` requests outstanding, or requests going out late) it says so in the summary.
- closed loop (``concurrency``): that many workers, each sending its next request when the
  previous one answered.

Python use (the local stack's background traffic)::

    gen = LoadGenerator(LoadConfig(url="127.0.0.1:8001", protocol="grpc", rate=20, duration=None,
                                   targets=[Target.parse("ranker:1=9"), Target.parse("ranker:2=1")]))
    gen.start()           # runs in a background thread
    gen.snapshot()        # a Summary so far, from any thread
    summary = gen.stop()  # stop sending, wait for in-flight requests, final Summary
"""

from __future__ import annotations

import asyncio
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np

from reference_server import catalog
from reference_server.defaults import LOAD_PROTOCOLS, STREAM_PROTOCOLS

Protocol = Literal["http", "grpc", "openai", "triton-generate"]
# Token streams (openai, triton-generate) are measured by reference_server/stream_load.py.
PROTOCOLS = LOAD_PROTOCOLS
LATE_AFTER_S = 0.010  # an open-loop request leaving later than this after its slot counts as late
LATE_TOLERANCE = 0.01  # up to 1% late requests still counts as keeping up
_TARGET = re.compile(r"^(?P<model>[A-Za-z0-9_.-]+)(?::(?P<version>[0-9]+))?(?:=(?P<weight>[0-9.eE+-]+))?$")
# An OpenAI served name may hold ":" and "/" (e.g. "org/model:tag"); it has no version.
_SERVED_NAME = re.compile(r"^(?P<model>[^\s=]+)(?:=(?P<weight>[0-9.eE+-]+))?$")


class LoadError(ValueError):
    """Bad load settings; one line for the user."""


@dataclass(frozen=True, slots=True)
class Target:
    model: str
    version: str = ""  # "" lets the server pick (Triton: the newest)
    weight: float = 1.0

    @classmethod
    def parse(cls, text: str, protocol: str = "http") -> Target:
        """``NAME[:VERSION][=WEIGHT]``, e.g. ``ranker:2=0.1``: a reference model (a streaming one
        for ``triton-generate``); for ``openai``, ``SERVED_NAME[=WEIGHT]`` with any served name."""
        if protocol == "openai":
            m = _SERVED_NAME.match(text.strip())
            if not m:
                raise LoadError(f"model {text!r}: expected SERVED_NAME[=WEIGHT], e.g. tiny-llm=9")
            return cls(m["model"], "", _weight(text, m["weight"]))
        m = _TARGET.match(text.strip())
        if not m:
            raise LoadError(f"model {text!r}: expected NAME[:VERSION][=WEIGHT], e.g. ranker:2=0.1")
        weight = _weight(text, m["weight"])
        models = catalog.STREAM_MODELS if protocol == "triton-generate" else catalog.MODELS
        if m["model"] not in models:
            kind = "a streaming reference model" if protocol == "triton-generate" else "a reference model"
            raise LoadError(f"model {m['model']!r} is not {kind} ({', '.join(sorted(models))})")
        version = m["version"] or ""
        if version and version not in models[m["model"]].versions:
            raise LoadError(f"model {m['model']!r} has no version {version}")
        return cls(m["model"], version, weight)

    @property
    def label(self) -> str:
        return f"{self.model}:{self.version}" if self.version else self.model


def _weight(text: str, given: str | None) -> float:
    try:
        weight = float(given) if given else 1.0
    except ValueError:
        raise LoadError(f"model {text!r}: weight {given!r} is not a number") from None
    if not weight > 0:
        raise LoadError(f"model {text!r}: weight must be positive")
    return weight


@dataclass
class LoadConfig:
    url: str  # host:port, as tritonclient takes it
    protocol: Protocol = "http"
    targets: Sequence[Target] = (Target("dense_batched"),)
    rate: float | None = None  # open loop, requests/s
    concurrency: int | None = None  # closed loop
    duration: float | None = 10.0  # seconds; None runs until stop()
    batch: int = 1  # rows per request
    max_in_flight: int = 1024  # open loop: beyond this the sender skips (and says so)
    timeout: float = 30.0  # per request, seconds
    seed: int | None = None
    # Token streams only (protocols openai and triton-generate; stream_load.py):
    stream: bool = True  # server-sent events, one per token; False: one answer per request
    endpoint: Literal["chat", "completions"] = "chat"  # openai: /v1/chat/completions or /v1/completions
    prompt_tokens: str = "32"  # length distributions: "N", "A-B" (uniform) or "normal:MEAN:SD"
    output_tokens: str = "64"
    ignore_eos: bool = False  # openai: vLLM's ignore_eos, so every answer has the asked length

    def validate(self) -> LoadConfig:
        if (self.rate is None) == (self.concurrency is None):
            raise LoadError("give exactly one of a rate (open loop) or a concurrency (closed loop)")
        if self.rate is not None and not 0 < self.rate <= 100_000:
            raise LoadError(f"rate must be in (0, 100000] requests/s, got {self.rate:g}")
        if self.concurrency is not None and not 0 < self.concurrency <= 10_000:
            raise LoadError(f"concurrency must be 1..10000, got {self.concurrency}")
        if self.duration is not None and not self.duration > 0:
            raise LoadError(f"duration must be positive, got {self.duration:g}")
        if self.protocol not in PROTOCOLS:
            raise LoadError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if not self.targets:
            raise LoadError("no model to send to")
        if self.protocol in STREAM_PROTOCOLS:
            from reference_server.stream_load import Lengths

            if self.batch != 1:
                raise LoadError("batch applies to KServe v2 tensors (http, grpc), not to token streams")
            Lengths.parse(self.prompt_tokens, "prompt tokens")
            Lengths.parse(self.output_tokens, "output tokens")
            if self.endpoint not in ("chat", "completions"):
                raise LoadError(f"endpoint must be chat or completions, got {self.endpoint!r}")
        elif not 1 <= self.batch <= min(catalog.model_info(t.model).max_batch_size for t in self.targets):
            raise LoadError(f"batch {self.batch} is outside what the models accept")
        if "://" in self.url or not re.match(r"^[^\s/:]+:[0-9]+$", self.url):
            raise LoadError(f"url must be HOST:PORT without a scheme, got {self.url!r}")
        return self


@dataclass
class Summary:
    mode: str
    protocol: str
    target_rate: float | None
    concurrency: int | None
    elapsed_s: float
    sent: int
    ok: int
    errors: dict[str, int]  # by HTTP status ("500"), gRPC code ("INTERNAL") or client-side reason
    in_flight: int
    achieved_rate: float  # requests sent per second
    ok_rate: float
    latency_s: dict[str, float]  # p50, p90, p99, max (successful and failed requests)
    by_target: dict[str, dict[str, int]]  # {"ranker:2": {"sent": n, "ok": n}}
    skipped: int  # open loop: arrivals not sent because max_in_flight requests were outstanding
    late: int  # open loop: requests sent more than LATE_AFTER_S after their slot
    max_lag_s: float
    kept_up: bool
    warnings: list[str] = field(default_factory=list)
    # Token streams only (stream_load.py), client-side: time to the first token, time per output
    # token (per request), gaps between tokens, each as p50/p90/p99/max; token totals from usage
    # where the answer has it, else counted from the events.
    ttft_s: dict[str, float] | None = None
    tpot_s: dict[str, float] | None = None
    inter_token_s: dict[str, float] | None = None
    prompt_tokens: int = 0
    generation_tokens: int = 0
    generation_tokens_per_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def percentiles(latencies: Sequence[float]) -> dict[str, float]:
    if not latencies:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    arr = np.asarray(latencies)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "max": float(arr.max())}


class Stats:
    """Counters shared between the sending loop and readers in other threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.ended: float | None = None
        self.sent = 0
        self.ok = 0
        self.in_flight = 0
        self.errors: Counter[str] = Counter()
        self.latencies: list[float] = []
        self.by_target: dict[str, Counter[str]] = {}
        self.skipped = 0
        self.late = 0
        self.max_lag = 0.0

    def on_send(self, label: str) -> None:
        with self.lock:
            self.sent += 1
            self.in_flight += 1
            self.by_target.setdefault(label, Counter())["sent"] += 1

    def on_done(self, label: str, latency: float, error: str | None) -> None:
        with self.lock:
            self.in_flight -= 1
            self.latencies.append(latency)
            if error is None:
                self.ok += 1
                self.by_target[label]["ok"] += 1
            else:
                self.errors[error] += 1


def error_label(exc: BaseException) -> str:
    """HTTP status ("503"), gRPC code ("UNAVAILABLE"), or what went wrong on the client side."""
    from tritonclient.utils import InferenceServerException

    if isinstance(exc, InferenceServerException):
        status = str(exc.status() or "")
        if status.startswith("StatusCode."):
            return status.removeprefix("StatusCode.")
        if status:
            return status
        msg = exc.message() or ""
        return "connection_error" if "connect" in msg.lower() else "client_error"
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return "timeout"
    if isinstance(exc, OSError) or "Connection" in type(exc).__name__:
        return "connection_error"
    return type(exc).__name__


class LoadGenerator:
    def __init__(self, config: LoadConfig, stop_event: threading.Event | None = None) -> None:
        self.config = config.validate()
        self.stats = Stats()
        self._stop = stop_event or threading.Event()
        self._thread: threading.Thread | None = None
        self._summary: Summary | None = None
        self._error: BaseException | None = None
        self._rng = random.Random(config.seed)
        weights = [t.weight for t in config.targets]
        self._cum = list(np.cumsum(weights) / sum(weights))

    # -- public API ------------------------------------------------------------------------
    def run(self) -> Summary:
        """Send load in this thread until the duration ends or ``stop()`` (or the stop event)."""
        asyncio.run(self._main())
        self._summary = self.snapshot()
        return self._summary

    def start(self) -> LoadGenerator:
        """Run in a background thread; read ``snapshot()`` any time, end with ``stop()``/``join()``."""

        def body() -> None:
            try:
                self.run()
            except BaseException as exc:  # reported by join()
                self._error = exc

        self._thread = threading.Thread(target=body, name="inferwatch-loadgen", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> Summary:
        self._stop.set()
        return self.join(timeout)

    def join(self, timeout: float | None = None) -> Summary:
        """Wait up to ``timeout`` for the run to end; the final Summary, or a snapshot if still running."""
        if self._thread is not None:
            self._thread.join(timeout)
        if self._error is not None:
            raise self._error
        return self._summary or self.snapshot()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def snapshot(self) -> Summary:
        c = self.config
        s = self.stats
        with s.lock:
            end = s.ended or time.monotonic()
            elapsed = max(end - s.started, 1e-9)
            latencies = list(s.latencies)
            sent, ok, in_flight = s.sent, s.ok, s.in_flight
            errors = dict(s.errors)
            by_target = {k: dict(v) for k, v in s.by_target.items()}
            skipped, late, max_lag = s.skipped, s.late, s.max_lag
        warnings = []
        if c.rate is not None:
            if skipped:
                warnings.append(
                    f"could not keep up: skipped {skipped} requests because {c.max_in_flight} were "
                    "already in flight (the server is slower than the asked rate)"
                )
            if late > LATE_TOLERANCE * max(sent, 1):
                warnings.append(
                    f"could not keep up: {late} of {sent} requests left more than "
                    f"{LATE_AFTER_S * 1e3:g} ms late (max {max_lag * 1e3:.0f} ms); the sender is CPU-bound"
                )
        return Summary(
            mode="open" if c.rate is not None else "closed",
            protocol=c.protocol,
            target_rate=c.rate,
            concurrency=c.concurrency,
            elapsed_s=elapsed,
            sent=sent,
            ok=ok,
            errors=errors,
            in_flight=in_flight,
            achieved_rate=sent / elapsed,
            ok_rate=ok / elapsed,
            latency_s=percentiles(latencies),
            by_target=by_target,
            skipped=skipped,
            late=late,
            max_lag_s=max_lag,
            kept_up=not warnings,
            warnings=warnings,
        )

    # -- the sending loop ----------------------------------------------------------------------
    def _pick(self) -> Target:
        r = self._rng.random()
        for target, edge in zip(self.config.targets, self._cum, strict=True):
            if r < edge:
                return target
        return self.config.targets[-1]

    def _make_client(self):
        c = self.config
        limit = c.concurrency or c.max_in_flight
        if c.protocol == "http":
            import tritonclient.http.aio as client_mod

            client = client_mod.InferenceServerClient(c.url, conn_limit=limit, conn_timeout=c.timeout)
        else:
            import tritonclient.grpc.aio as client_mod

            client = client_mod.InferenceServerClient(c.url)
        # Inputs are built once per target and reused: the sender's CPU goes to sending.
        inputs = {}
        for t in c.targets:
            info = catalog.model_info(t.model)
            data = catalog.example_input(t.model, batch=c.batch, seed=0)
            ins = []
            for spec in info.inputs:
                inp = client_mod.InferInput(spec.name, list(data[spec.name].shape), spec.datatype)
                inp.set_data_from_numpy(data[spec.name])
                ins.append(inp)
            inputs[t] = ins
        return client, inputs

    async def _one(self, client, inputs, target: Target, t0: float) -> None:
        label = target.label
        error = None
        try:
            await asyncio.wait_for(
                client.infer(target.model, inputs[target], model_version=target.version), self.config.timeout
            )
        except asyncio.CancelledError:
            error = "cancelled"
            raise
        except Exception as exc:
            error = error_label(exc)
        finally:
            self.stats.on_done(label, time.monotonic() - t0, error)

    async def _main(self) -> None:
        c = self.config
        client, inputs = self._make_client()
        loop = asyncio.get_running_loop()
        with self.stats.lock:
            self.stats.started = time.monotonic()
        deadline = None if c.duration is None else self.stats.started + c.duration
        try:
            if c.rate is not None:
                await self._open_loop(client, inputs, deadline, loop)
            else:
                await self._closed_loop(client, inputs, deadline)
        finally:
            with self.stats.lock:
                self.stats.ended = time.monotonic()
            await client.close()

    def _should_stop(self, deadline: float | None) -> bool:
        return self._stop.is_set() or (deadline is not None and time.monotonic() >= deadline)

    async def _open_loop(self, client, inputs, deadline: float | None, loop) -> None:
        c = self.config
        assert c.rate is not None
        tasks: set[asyncio.Task] = set()
        slot = time.monotonic()
        while True:
            slot += self._rng.expovariate(c.rate)
            if deadline is not None and slot >= deadline:
                break
            delay = slot - time.monotonic()
            while delay > 0:
                if self._stop.is_set():
                    break
                await asyncio.sleep(min(delay, 0.1))
                delay = slot - time.monotonic()
            if self._stop.is_set():
                break
            lag = -delay
            if lag > LATE_AFTER_S:
                with self.stats.lock:
                    self.stats.late += 1
                    self.stats.max_lag = max(self.stats.max_lag, lag)
            if len(tasks) >= c.max_in_flight:
                with self.stats.lock:
                    self.stats.skipped += 1
                continue
            target = self._pick()
            self.stats.on_send(target.label)
            task = loop.create_task(self._one(client, inputs, target, slot))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await self._drain(tasks)

    async def _closed_loop(self, client, inputs, deadline: float | None) -> None:
        async def worker() -> None:
            while not self._should_stop(deadline):
                target = self._pick()
                self.stats.on_send(target.label)
                await self._one(client, inputs, target, time.monotonic())

        assert self.config.concurrency is not None
        await asyncio.gather(*(worker() for _ in range(self.config.concurrency)))

    async def _drain(self, tasks: set[asyncio.Task]) -> None:
        """Let requests in flight finish (they count), up to the request timeout."""
        if tasks:
            _done, pending = await asyncio.wait(set(tasks), timeout=self.config.timeout)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)


def make_generator(config: LoadConfig, stop_event: threading.Event | None = None) -> LoadGenerator:
    """The generator for ``config.protocol``: KServe v2 tensors, or token streams."""
    if config.protocol in STREAM_PROTOCOLS:
        from reference_server.stream_load import StreamLoadGenerator

        return StreamLoadGenerator(config, stop_event)
    return LoadGenerator(config, stop_event)


def run_load(
    config: LoadConfig,
    stop_event: threading.Event | None = None,
    on_progress: Callable[[Summary], None] | None = None,
    interval: float = 0.5,
) -> Summary:
    """Run ``config`` to the end (or until ``stop_event``), calling ``on_progress`` with a
    snapshot every ``interval`` seconds; returns the final Summary."""
    gen = make_generator(config, stop_event).start()
    try:
        while gen.running:
            gen.join(interval)
            if on_progress is not None and gen.running:
                on_progress(gen.snapshot())
    except KeyboardInterrupt:
        return gen.stop()
    return gen.join()
