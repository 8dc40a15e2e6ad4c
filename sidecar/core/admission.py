"""Admission: whether the sidecar takes one more request, the same decision for every protocol.

One ``Admission`` per process, shared by the HTTP proxy and the gRPC side (both engines), so
``--max-in-flight`` is the total across protocols, as the README says::

    refusal = admission.acquire(model)   # None: admitted; hold it until release()
    if refusal is not None:
        ...the protocol's fixed overload answer (HTTP 429/503, gRPC RESOURCE_EXHAUSTED), counted...
    ...
    admission.release(model)             # exactly once per admitted request

Per-model limits (the fleet spec's ``limits``, inferwatch.spec.Limits) live here too, behind the
same two calls, checked in this order after the global limit:

- ``requests``: a token bucket, one token per request (reason ``requests``);
- ``tokens``: a token bucket for LLM requests, ``tokens=`` prompt estimate + max_tokens
  (reason ``tokens``; ``sidecar.apis.charge`` computes it; a cost over the capacity takes the
  whole bucket). ``refund(model, charged, used)`` gives back, at an admitted request's end,
  what it took and did not use; a request charged and then shed by the queue (full, timed out,
  or its client left while it waited) gets its whole charge back: it never reached the server;
- ``concurrency``: requests of the model in flight to the server; past it a request waits in the
  model's ``queue`` (FIFO) for at most ``queue_timeout_ms`` (reason ``queue_timeout``), or is shed
  at once when the queue is full (reason ``queue_full``).

A request is queued only when its caller passes ``wake``: ``acquire`` then returns a
``Waiting`` and later calls ``wake(None)`` (admitted: release it as usual) or
``wake(refusal)`` (timed out); a caller that gives up first calls ``Waiting.cancel()``. A caller
without ``wake`` finds a full model as ``queue_full``. Each shed request is counted in
the shed counter (``contract.REQUESTS_SHED``, by model and reason); the protocol counts it in the
requests counter as it answers. A caller that does not know the model passes ``MODEL_NONE``:
only the global limit applies to it. The gRPC side does so for a call whose method names no
model, and, while no per-model limits are set, for every call, admitted on its header block
before the message that names the model. With per-model limits both engines admit a unary call
once its message names the model (the relay holds its header block until then) and a stream on
its first message; the aio engine may queue it (``admit``), the relay does not (no ``wake``), so
a full model sheds it at once. The HTTP proxy passes ``MODEL_NONE`` while it holds an LLM
request's body, then ``transfer``s the slot to the model the body names, with its cost.
Refusals are prebuilt per model, so refusing allocates nothing: under overload the answer stays
cheap.

Models are keyed by their label (``model_label``, the telemetry's bounded label), so a client
inventing names shares one overflow model's limits rather than minting buckets. ``reload``
swaps the limits (SIGHUP): bucket levels and what is in flight or waiting carry over.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inferwatch import contract
from inferwatch.spec import Limits

_UNLIMITED = Limits()
# Adaptive concurrency (Limits.adaptive): a window's answers slower than the target past this
# share shrink the limit at once (the window's P90 is above it); the limit then keeps this
# share of itself. 0.8 rather than TCP's 0.5: a batching server's latency is a step function
# of the batches ahead, so a fifth usually takes it back under the target.
_OVER_SHARE = 0.1
_BACKOFF = 0.8
_MIN_WINDOW = 10  # answers per decision at least: one slow answer of four is not a P90
# Model names kept as aliases of their label's gate at most: a client may invent names.
MAX_GATE_ALIASES = 4096


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request was refused: ``reason`` is a short stable key (logs, the shed counter's
    label), ``message`` the text for the client's overload answer, ``retry_after`` seconds a
    client should wait (0: the global limit, answered 503 without Retry-After)."""

    reason: str
    message: str
    retry_after: int = 0


IN_FLIGHT = "in_flight"  # the global limit of concurrent requests
# Per-model limits, the values of the shed counter's reason label.
SHED_REQUESTS = "requests"
SHED_TOKENS = "tokens"
SHED_QUEUE_FULL = "queue_full"
SHED_QUEUE_TIMEOUT = "queue_timeout"
SHED_REASONS = (SHED_REQUESTS, SHED_TOKENS, SHED_QUEUE_FULL, SHED_QUEUE_TIMEOUT)


class Waiting:
    """A queued request; ``cancel()`` when its client leaves before it is woken."""

    __slots__ = ("gate", "handle", "tokens", "wake")

    def __init__(self, gate: _Gate, wake: Callable[[Refusal | None], Any]) -> None:
        self.gate = gate
        self.wake = wake
        self.handle: asyncio.TimerHandle | None = None
        self.tokens = 0  # what its tokens bucket was charged, given back if it never gets a slot

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
            try:
                self.gate.queue.remove(self)
            except ValueError:
                return
            if self.gate.tokens is not None:  # it never reached the server: the charge comes back
                self.gate.tokens.give(self.tokens)


class _Bucket:
    __slots__ = ("capacity", "level", "rate", "stamp")

    def __init__(self, capacity: float, rate: float, now: float) -> None:
        self.capacity = capacity
        self.rate = rate
        self.level = capacity  # a new bucket starts full: the burst is allowed at once
        self.stamp = now

    def take(self, cost: float, now: float) -> bool:
        level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        if level >= cost:
            self.level = level - cost
            return True
        self.level = level
        return False

    def give(self, tokens: float) -> None:
        """Put back ``tokens`` (a refund), never above the capacity. No settling needed: for a
        refill x >= 0 later, min(cap, min(cap, level + tokens) + x) == min(cap, level + tokens + x)."""
        if tokens > 0:
            level = self.level + tokens
            self.level = level if level < self.capacity else self.capacity


class _Gate:
    """One model's limits and state."""

    __slots__ = (
        "active",
        "adaptive",
        "concurrency",
        "label",
        "limit_gauge",
        "over",
        "queue",
        "queue_cap",
        "queue_timeout",
        "r_full",
        "r_requests",
        "r_timeout",
        "r_tokens",
        "requests",
        "samples",
        "saturated",
        "shed",
        "skip",
        "target",
        "tokens",
    )

    def __init__(
        self, label: str, limits: Limits, now: float, shed: dict[str, Any] | None, limit_gauge: Any = None
    ) -> None:
        self.active = 0
        self.queue: deque[Waiting] = deque()
        self.requests: _Bucket | None = None
        self.tokens: _Bucket | None = None
        self.shed = shed  # reason -> the shed counter's child (None: not counted)
        self.limit_gauge = limit_gauge  # the concurrency-limit gauge's family (None: not exported)
        self.label = label
        self.adaptive = None
        self.concurrency = 0
        self.configure(label, limits, now)

    def configure(self, label: str, limits: Limits, now: float) -> None:
        self.requests = _rebucket(self.requests, limits.requests, now)
        self.tokens = _rebucket(self.tokens, limits.tokens, now)
        adaptive = limits.adaptive
        if adaptive is not None and self.adaptive is not None and self.concurrency:
            # Still adaptive after a reload: the limit it found stays, within the new bounds.
            self.concurrency = min(adaptive.max, max(adaptive.min, self.concurrency))
        else:
            self.concurrency = limits.concurrency or 0
        self.adaptive = adaptive
        # spec.limits_for resolves target_ms from the model's SLA when the spec leaves it unset.
        self.target = (adaptive.target_ms or 0.0) / 1000.0 if adaptive is not None else 0.0
        self._new_window(0)
        self._export()
        self.queue_cap = limits.queue if self.concurrency else 0
        self.queue_timeout = limits.queue_timeout_ms / 1000.0
        who = f"inferwatch sidecar: model {label!r}"
        r = limits.requests
        self.r_requests = Refusal(
            SHED_REQUESTS, f"{who}: over {r.fill_rate:g} requests/s" if r else "", _retry(1, r)
        )
        t = limits.tokens
        self.r_tokens = Refusal(
            SHED_TOKENS, f"{who}: over {t.fill_rate:g} tokens/s" if t else "", _retry(1, t)
        )
        self.r_full = Refusal(
            SHED_QUEUE_FULL, f"{who}: {self.concurrency} in flight and the queue is full", 1
        )
        self.r_timeout = Refusal(
            SHED_QUEUE_TIMEOUT, f"{who}: waited {limits.queue_timeout_ms:g} ms for a slot", 1
        )

    def _export(self) -> None:
        if self.limit_gauge is None:
            return
        if self.concurrency:
            self.limit_gauge.labels(self.label).set(self.concurrency)
        else:
            try:
                self.limit_gauge.remove(self.label)
            except KeyError:
                pass

    def _new_window(self, skip: int) -> None:
        self.samples = self.over = 0
        self.saturated = False
        self.skip = skip

    def observe(self, latency: float) -> None:
        """Adaptive concurrency: one admitted request's time in the server. Additive increase
        (one per window of ``concurrency`` answers, at least ``_MIN_WINDOW``, whose P90 stayed
        under the target, only if the limit was reached in it: a limit nobody presses against
        proves nothing), multiplicative decrease (``_BACKOFF``, as soon as the window's P90 is
        over the target). After a decrease the answers of what was already in flight are
        skipped: they ran under the old limit."""
        if self.skip:
            self.skip -= 1
            return
        self.samples += 1
        window = max(self.concurrency, _MIN_WINDOW)
        if latency > self.target:
            self.over += 1
            if self.over > _OVER_SHARE * window:
                adaptive = self.adaptive
                lower = max(adaptive.min, int(self.concurrency * _BACKOFF))  # type: ignore[union-attr]
                if lower < self.concurrency:
                    self.concurrency = lower
                    self._export()
                self._new_window(self.active)
                return
        if self.samples >= window:
            if self.saturated and self.concurrency < self.adaptive.max:  # type: ignore[union-attr]
                self.concurrency += 1
                self._export()
            self._new_window(0)


def _rebucket(old: _Bucket | None, spec: Any, now: float) -> _Bucket | None:
    if spec is None:
        return None
    if old is None:
        return _Bucket(spec.capacity, spec.fill_rate, now)
    old.take(0, now)  # settle the level at the old rate, then keep it within the new capacity
    old.capacity, old.rate = spec.capacity, spec.fill_rate
    old.level = min(old.level, spec.capacity)
    return old


def _retry(cost: float, spec: Any) -> int:
    """Whole seconds until ``cost`` tokens have refilled (HTTP Retry-After), at least 1."""
    return max(1, math.ceil(cost / spec.fill_rate)) if spec is not None else 1


class Admission:
    """The global limit of requests in flight (0: none) and the per-model limits. Not
    thread-safe: every proxy runs on the sidecar's one event loop."""

    __slots__ = (
        "_full",
        "_gates",
        "_label",
        "_limit_gauge",
        "_limits",
        "_shed",
        "active",
        "clock",
        "limit",
    )

    def __init__(
        self,
        max_in_flight: int,
        limits: Callable[[str], Limits | None] | None = None,
        model_label: Callable[[str], str] | None = None,
        registry: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = max_in_flight
        self.active = 0
        self.clock = clock
        self._full = Refusal(IN_FLIGHT, f"inferwatch sidecar: more than {max_in_flight} requests in flight")
        self._limits = limits
        self._label = model_label
        # model label -> its gate, or None when the model has no limits (looked up once).
        self._gates: dict[str, _Gate | None] = {}
        self._shed = None
        self._limit_gauge = None
        if registry is not None:
            from prometheus_client import Counter, Gauge

            m = contract.REQUESTS_SHED
            self._shed = Counter(m.name, m.help, m.labels, registry=registry)
            m = contract.CONCURRENCY_LIMIT
            self._limit_gauge = Gauge(m.name, m.help, m.labels, registry=registry)

    @property
    def per_model(self) -> bool:
        """Whether any per-model limit is configured (the gRPC relay then reads the model first)."""
        return self._limits is not None

    def _gate(self, model: str) -> _Gate | None:
        gate = self._gates.get(model, False)
        if gate is not False:
            return gate  # type: ignore[return-value]
        label = self._label(model) if self._label is not None else model
        gate = self._gates.get(label, False) if label != model else False
        if gate is False:
            # Every model gets a gate, limited or not, so what it has in flight is always known
            # (a reload may limit it later).
            limits = (self._limits(label) if self._limits is not None else None) or _UNLIMITED
            shed = None
            if self._shed is not None:
                shed = {r: self._shed.labels(label, r) for r in SHED_REASONS}
            gate = _Gate(label, limits, self.clock(), shed, self._limit_gauge)
            self._gates[label] = gate
        if label == model:
            return gate  # type: ignore[return-value]
        if len(self._gates) < MAX_GATE_ALIASES:
            self._gates[model] = gate  # type: ignore[assignment]
        return gate  # type: ignore[return-value]

    def acquire(
        self, model: str = "", tokens: int = 0, wake: Callable[[Refusal | None], Any] | None = None
    ) -> Refusal | Waiting | None:
        """Admit one request (None), queue it (a ``Waiting``; only with ``wake``), or say why
        not; an admitted request is released once."""
        if self.limit and self.active >= self.limit:
            return self._full
        if self._limits is None or model == contract.MODEL_NONE:
            self.active += 1
            return None
        gate = self._gate(model)
        now = self.clock()
        if gate.requests is not None and not gate.requests.take(1, now):
            return self._refuse(gate, gate.r_requests)
        # A cost over the capacity takes the whole bucket: it passes when the bucket is full
        # rather than never.
        taken = 0
        if gate.tokens is not None and tokens:
            taken = min(tokens, gate.tokens.capacity)
            if not gate.tokens.take(taken, now):
                return self._refuse(gate, gate.r_tokens)
        if gate.concurrency and gate.active >= gate.concurrency:
            gate.saturated = True  # adaptive: the limit is what held this request back
            if wake is None or len(gate.queue) >= gate.queue_cap:
                if taken:
                    gate.tokens.give(taken)  # type: ignore[union-attr]  # shed: it cost nothing
                return self._refuse(gate, gate.r_full)
            waiting = Waiting(gate, wake)
            waiting.tokens = taken
            waiting.handle = asyncio.get_running_loop().call_later(gate.queue_timeout, self._expire, waiting)
            gate.queue.append(waiting)
            return waiting
        gate.active += 1
        self.active += 1
        return None

    def charges_tokens(self, model: str) -> bool:
        """Whether ``model`` has a ``tokens`` bucket (the HTTP proxy then reads its cost first)."""
        if self._limits is None or model == contract.MODEL_NONE:
            return False
        return self._gate(model).tokens is not None  # type: ignore[union-attr]

    def transfer(
        self, model: str, tokens: int = 0, wake: Callable[[Refusal | None], Any] | None = None
    ) -> Refusal | Waiting | None:
        """A request admitted as ``MODEL_NONE`` (held while its body names its model and cost)
        now knows them: its global slot is traded for ``acquire(model, tokens, wake)``'s
        answer. The global limit cannot refuse it (its own slot was just freed); a refusal or a
        ``Waiting`` holds no slot, as from ``acquire``."""
        self.active -= 1
        return self.acquire(model, tokens, wake)

    def refund(self, model: str, charged: int, used: int) -> None:
        """An admitted request of ``model`` that was charged ``charged`` tokens (``acquire``'s
        ``tokens``) ended having used ``used``: its tokens bucket gets back what it took and
        was not used, ``min(charged, capacity) - used`` (a cost over the capacity took the
        capacity), never less than 0, the level never above the capacity. Once per request, at
        its end (sidecar.apis.charge.used says what was used); a model without a tokens bucket
        (or none any more after a reload) is left alone."""
        if self._limits is None or model == contract.MODEL_NONE or charged <= 0:
            return
        bucket = self._gate(model).tokens  # type: ignore[union-attr]
        if bucket is not None:
            bucket.give((charged if charged < bucket.capacity else bucket.capacity) - used)

    def _refuse(self, gate: _Gate, refusal: Refusal) -> Refusal:
        if gate.shed is not None:
            gate.shed[refusal.reason].inc()
        return refusal

    def _expire(self, waiting: Waiting) -> None:
        waiting.handle = None
        gate = waiting.gate
        try:
            gate.queue.remove(waiting)
        except ValueError:
            return
        if gate.tokens is not None:
            gate.tokens.give(waiting.tokens)  # shed: it never reached the server
        waiting.wake(self._refuse(gate, gate.r_timeout))

    def release(self, model: str = "", latency: float | None = None) -> None:
        """``latency``: seconds from admission (a slot given, after any queue wait) to the end,
        what an adaptive limit (``Limits.adaptive``) steers by; None: not a sample (a stream,
        or a caller that does not time it)."""
        self.active -= 1
        if self._limits is None or model == contract.MODEL_NONE:
            return
        gate = self._gate(model)
        if gate.active > 0:  # 0: admitted before limits were first configured (reload)
            gate.active -= 1
        if latency is not None and gate.adaptive is not None:
            gate.observe(latency)
        self._pump(gate)

    def _pump(self, gate: _Gate) -> None:
        """Free slots go to the longest waiters."""
        while gate.queue and gate.active < (gate.concurrency or math.inf):
            waiting = gate.queue.popleft()
            if waiting.handle is not None:
                waiting.handle.cancel()
                waiting.handle = None
            gate.active += 1
            self.active += 1
            waiting.wake(None)

    async def admit(self, model: str = "", tokens: int = 0) -> Refusal | None:
        """``acquire`` for a coroutine: waits in the queue; cancelled, it leaves the queue or
        releases what it was given."""
        fut: asyncio.Future[Refusal | None] | None = None

        def wake(result: Refusal | None) -> None:
            if fut is not None and not fut.done():
                fut.set_result(result)
            elif result is None:
                self.release(model)  # woken after its waiter was cancelled: give it back

        got = self.acquire(model, tokens, wake)
        if not isinstance(got, Waiting):
            return got
        fut = asyncio.get_running_loop().create_future()
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.result() is None:
                self.release(model)  # admitted in the same moment it was cancelled
            else:
                got.cancel()
            raise

    def reload(self, limits: Callable[[str], Limits | None] | None) -> None:
        """New limits (a re-read spec): each model keeps its bucket levels (within the new
        capacity), in-flight count and queue; a raised concurrency admits waiters at once."""
        self._limits = limits
        now = self.clock()
        seen: set[int] = set()
        for gate in self._gates.values():
            if gate is None or id(gate) in seen:
                continue
            seen.add(id(gate))
            gate.configure(
                gate.label, (limits(gate.label) if limits is not None else None) or _UNLIMITED, now
            )
            self._pump(gate)
