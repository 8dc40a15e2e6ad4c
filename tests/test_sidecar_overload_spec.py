"""Per-model limits: the fleet spec's ``limits`` (strict, one-line errors, one test per bad value)
and ``sidecar.core.admission.Admission`` enforcing them, on a fake clock."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from inferwatch import contract
from inferwatch.spec import Limits, SpecError, load_spec, parse_spec
from sidecar.core.admission import (
    IN_FLIGHT,
    SHED_QUEUE_FULL,
    SHED_QUEUE_TIMEOUT,
    SHED_REQUESTS,
    SHED_TOKENS,
    Admission,
    Waiting,
)

ROOT = Path(__file__).resolve().parents[1]


def spec_with(defaults: dict | None = None, model: dict | None = None):
    data: dict = {"models": [{"name": "m", "latency_sla_ms": 100}]}
    if defaults is not None:
        data["defaults"] = {"limits": defaults}
    if model is not None:
        data["models"][0]["limits"] = model
    return parse_spec(data)


# --------------------------------------------------------------------------- the spec


def test_limits_merge_model_keys_over_the_defaults() -> None:
    spec = spec_with(
        {"requests": {"capacity": 100, "fill_rate": 10}, "concurrency": 4, "queue": 8},
        {"requests": None, "concurrency": 2, "queue_timeout_ms": 50},
    )
    own = spec.limits_for("m")
    assert own is not None and own.requests is None and own.concurrency == 2 and own.queue == 8
    assert own.queue_timeout_ms == 50
    other = spec.limits_for("unlisted")  # the defaults apply to every model
    assert other is not None and other.requests is not None and other.requests.capacity == 100
    assert other.concurrency == 4
    assert spec_with().limits_for("m") is None and not spec_with().has_limits()
    assert spec_with(model={"concurrency": 1}).limits_for("other") is None


def test_issue_example_parses() -> None:
    limits = {
        "requests": {"capacity": 10000, "fill_rate": 500},
        "tokens": {"capacity": 200000, "fill_rate": 5000},
        "concurrency": 64,
        "queue": 256,
        "queue_timeout_ms": 500,
    }
    got = spec_with(model=limits).limits_for("m")
    assert got == Limits.model_validate(limits)


BAD_LIMITS = {
    "capacity 0": (
        {"defaults": {"requests": {"capacity": 0, "fill_rate": 1}}},
        "defaults.limits.requests.capacity: must be greater than 0",
    ),
    "capacity not an integer": (
        {"model": {"requests": {"capacity": 1.5, "fill_rate": 1}}},
        "models[0].limits.requests.capacity: must be a valid integer",
    ),
    "fill_rate negative": (
        {"model": {"tokens": {"capacity": 10, "fill_rate": -1}}},
        "models[0].limits.tokens.fill_rate: must be greater than 0",
    ),
    "fill_rate infinite": (
        {"model": {"tokens": {"capacity": 10, "fill_rate": float("inf")}}},
        "models[0].limits.tokens.fill_rate: must be a finite number",
    ),
    "bucket without fill_rate": (
        {"model": {"requests": {"capacity": 10}}},
        "models[0].limits.requests.fill_rate: required field is missing",
    ),
    "bucket key misspelt": (
        {"model": {"requests": {"capacity": 10, "fill_rate": 1, "burst": 3}}},
        "models[0].limits.requests.burst: unknown key",
    ),
    "limits key misspelt": ({"model": {"concurency": 3}}, "models[0].limits.concurency: unknown key"),
    "concurrency 0": ({"model": {"concurrency": 0}}, "models[0].limits.concurrency: must be greater than"),
    "concurrency a word": (
        {"model": {"concurrency": "lots"}},
        "models[0].limits.concurrency: must be a valid integer",
    ),
    "queue negative": (
        {"model": {"concurrency": 1, "queue": -1}},
        "models[0].limits.queue: must be greater than or equal to 0",
    ),
    "queue_timeout 0": (
        {"model": {"concurrency": 1, "queue": 1, "queue_timeout_ms": 0}},
        "models[0].limits.queue_timeout_ms: must be greater than 0",
    ),
    "queue without concurrency (defaults)": (
        {"defaults": {"queue": 4}},
        "defaults.limits.queue: a queue waits for a concurrency slot; set concurrency too",
    ),
    "queue without concurrency (model)": (
        {"model": {"queue": 4}},
        "models[0].limits.queue: a queue waits for a concurrency slot; set concurrency too",
    ),
    "limits not a mapping": ({"model": 64}, "models[0].limits: must be a valid dictionary"),
    "adaptive without concurrency": (
        {"model": {"adaptive": {"max": 8}}},
        "models[0].limits.adaptive: the limit starts at concurrency; set concurrency too",
    ),
    "adaptive without concurrency (defaults)": (
        {"defaults": {"adaptive": {"max": 8}}},
        "defaults.limits.adaptive: the limit starts at concurrency; set concurrency too",
    ),
    "adaptive without max": (
        {"model": {"concurrency": 4, "adaptive": {"min": 2}}},
        "models[0].limits.adaptive.max: required field is missing",
    ),
    "adaptive min 0": (
        {"model": {"concurrency": 4, "adaptive": {"min": 0, "max": 8}}},
        "models[0].limits.adaptive.min: must be greater than or equal to 1",
    ),
    "adaptive min above max": (
        {"model": {"concurrency": 4, "adaptive": {"min": 9, "max": 8}}},
        "models[0].limits.adaptive.min: 9 is above max (8)",
    ),
    "concurrency outside adaptive's bounds": (
        {"model": {"concurrency": 16, "adaptive": {"min": 2, "max": 8}}},
        "models[0].limits.concurrency: 16 is outside adaptive's min..max (2..8)",
    ),
    "adaptive target_ms 0": (
        {"model": {"concurrency": 4, "adaptive": {"max": 8, "target_ms": 0}}},
        "models[0].limits.adaptive.target_ms: must be greater than 0",
    ),
    "adaptive target_ms a word": (
        {"model": {"concurrency": 4, "adaptive": {"max": 8, "target_ms": "fast"}}},
        "models[0].limits.adaptive.target_ms: must be a valid number",
    ),
    "adaptive key misspelt": (
        {"model": {"concurrency": 4, "adaptive": {"max": 8, "target": 0.5}}},
        "models[0].limits.adaptive.target: unknown key",
    ),
    "adaptive a word": (
        {"model": {"concurrency": 4, "adaptive": "yes"}},
        "models[0].limits.adaptive: must be a valid dictionary",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_LIMITS))
def test_bad_limits_give_one_line(case: str, tmp_path: Path) -> None:
    where, expected = BAD_LIMITS[case]
    data: dict = {"models": [{"name": "m", "latency_sla_ms": 100}]}
    if "defaults" in where:
        data["defaults"] = {"limits": where["defaults"]}
    if "model" in where:
        data["models"][0]["limits"] = where["model"]
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError) as excinfo:
        load_spec(path)
    assert str(excinfo.value).startswith(f"{path}: {expected}"), str(excinfo.value)
    assert "\n" not in str(excinfo.value)


def test_spec_check_cli_refuses_bad_limits_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump({"defaults": {"limits": {"queue": 4}}}))
    proc = subprocess.run(
        [sys.executable, "-m", "inferwatch.cli", "spec", "check", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert (
        proc.stderr.strip()
        == f"{path}: defaults.limits.queue: a queue waits for a concurrency slot; set concurrency too"
    )


# --------------------------------------------------------------------------- Admission


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def admission(limits: dict | None, max_in_flight: int = 0, registry=None) -> tuple[Admission, Clock]:
    spec = spec_with(defaults=limits)
    clock = Clock()
    return Admission(
        max_in_flight, spec.limits_for if spec.has_limits() else None, None, registry, clock
    ), clock


def shed(registry: CollectorRegistry, model: str, reason: str) -> float:
    value = registry.get_sample_value(contract.REQUESTS_SHED.name, {"model": model, "reason": reason})
    return value or 0.0


def test_request_bucket_admits_the_burst_then_the_fill_rate() -> None:
    reg = CollectorRegistry()
    a, clock = admission({"requests": {"capacity": 5, "fill_rate": 2}}, registry=reg)
    got = [a.acquire("m") for _ in range(8)]
    assert got[:5] == [None] * 5
    assert all(r is not None and r.reason == SHED_REQUESTS and r.retry_after == 1 for r in got[5:])
    assert shed(reg, "m", SHED_REQUESTS) == 3
    clock.now += 1.0  # two tokens back
    assert [a.acquire("m") is None for _ in range(3)] == [True, True, False]
    assert a.acquire("other") is None  # each model has its own bucket
    assert a.acquire("") is None  # no model: only the global limit applies
    assert shed(reg, "m", SHED_REQUESTS) == 4 and shed(reg, "other", SHED_REQUESTS) == 0


def test_retry_after_is_the_refill_time_of_one_request() -> None:
    a, _ = admission({"requests": {"capacity": 1, "fill_rate": 0.2}})
    assert a.acquire("m") is None
    refusal = a.acquire("m")
    assert refusal is not None and refusal.retry_after == 5 and "0.2 requests/s" in refusal.message


def test_token_bucket_charges_the_request_cost() -> None:
    reg = CollectorRegistry()
    a, clock = admission({"tokens": {"capacity": 1000, "fill_rate": 100}}, registry=reg)
    assert a.acquire("m", tokens=600) is None
    refusal = a.acquire("m", tokens=600)
    assert refusal is not None and refusal.reason == SHED_TOKENS
    assert a.acquire("m", tokens=400) is None
    clock.now += 3.0
    assert a.acquire("m", tokens=300) is None and a.acquire("m", tokens=1) is not None
    assert a.acquire("m") is None  # no cost given (not an LLM request): the bucket is not read
    assert shed(reg, "m", SHED_TOKENS) == 2


def test_a_cost_over_the_capacity_takes_the_whole_bucket() -> None:
    a, clock = admission({"tokens": {"capacity": 1000, "fill_rate": 100}})
    assert a.acquire("m", tokens=5000) is None  # a full bucket: charged its capacity, not refused forever
    assert a.acquire("m", tokens=1) is not None
    clock.now += 10.0
    assert a.acquire("m", tokens=10**12) is None


def test_transfer_trades_the_global_slot_for_the_models_admission() -> None:
    """The HTTP proxy holds an LLM body as MODEL_NONE, then transfers it to the model it names."""

    async def main() -> None:
        reg = CollectorRegistry()
        limits = {"tokens": {"capacity": 100, "fill_rate": 0.01}, "concurrency": 1, "queue": 1}
        a, _ = admission(limits, max_in_flight=2, registry=reg)
        assert a.charges_tokens("m") and not a.charges_tokens(contract.MODEL_NONE)
        assert a.acquire(contract.MODEL_NONE) is None and a.active == 1
        assert a.transfer("m", 60) is None and a.active == 1  # the same slot, now the model's
        assert a.acquire(contract.MODEL_NONE) is None and a.active == 2  # the global limit is full
        refusal = a.transfer("m", 60)  # 40 tokens left: shed, and the slot is given back
        assert refusal is not None and refusal.reason == SHED_TOKENS and a.active == 1  # type: ignore[union-attr]
        assert shed(reg, "m", SHED_TOKENS) == 1
        assert a.acquire(contract.MODEL_NONE) is None
        woken: list[object] = []
        waiting = a.transfer("m", 10, woken.append)  # the model's one slot is taken: queued
        assert isinstance(waiting, Waiting) and a.active == 1
        assert a.acquire(contract.MODEL_NONE) is None
        # A body that names no model stays under the global limit only, whatever its cost.
        assert a.transfer(contract.MODEL_NONE, 10**6) is None and a.active == 2
        a.release(contract.MODEL_NONE)
        a.release("m")
        assert woken == [None] and a.active == 1
        a.release("m")
        assert a.active == 0
        assert not admission(None)[0].charges_tokens("m")  # no limits at all

    asyncio.run(main())


def test_concurrency_without_queue_sheds_queue_full() -> None:
    reg = CollectorRegistry()
    a, _ = admission({"concurrency": 2}, registry=reg)
    assert a.acquire("m") is None and a.acquire("m") is None
    refusal = a.acquire("m")
    assert refusal is not None and refusal.reason == SHED_QUEUE_FULL and refusal.retry_after == 1
    a.release("m")
    assert a.acquire("m") is None and a.active == 2
    assert shed(reg, "m", SHED_QUEUE_FULL) == 1


def test_queue_admits_in_order_on_release_and_times_out() -> None:
    async def main() -> None:
        reg = CollectorRegistry()
        a, _ = admission({"concurrency": 1, "queue": 2, "queue_timeout_ms": 100}, registry=reg)
        woken: list[tuple[str, object]] = []
        assert a.acquire("m") is None
        w1 = a.acquire("m", wake=lambda r: woken.append(("w1", r)))
        w2 = a.acquire("m", wake=lambda r: woken.append(("w2", r)))
        assert isinstance(w1, Waiting) and isinstance(w2, Waiting)
        full = a.acquire("m", wake=lambda r: woken.append(("w3", r)))
        assert full is not None and full.reason == SHED_QUEUE_FULL
        a.release("m")
        assert woken == [("w1", None)] and a.active == 1
        await asyncio.sleep(0.2)
        assert len(woken) == 2 and woken[1][0] == "w2"
        assert woken[1][1].reason == SHED_QUEUE_TIMEOUT  # type: ignore[union-attr]
        assert shed(reg, "m", SHED_QUEUE_TIMEOUT) == 1 and shed(reg, "m", SHED_QUEUE_FULL) == 1
        w4 = a.acquire("m", wake=lambda r: woken.append(("w4", r)))
        assert isinstance(w4, Waiting)
        w4.cancel()  # its client left
        a.release("m")
        await asyncio.sleep(0.15)
        assert len(woken) == 2 and a.active == 0

    asyncio.run(main())


def test_admit_awaits_its_turn() -> None:
    async def main() -> None:
        a, _ = admission({"concurrency": 1, "queue": 1, "queue_timeout_ms": 1000})
        assert await a.admit("m") is None
        waiter = asyncio.ensure_future(a.admit("m"))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        a.release("m")
        assert await waiter is None and a.active == 1
        cancelled = asyncio.ensure_future(a.admit("m"))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        a.release("m")
        assert a.active == 0

    asyncio.run(main())


def test_global_limit_comes_first() -> None:
    a, _ = admission({"requests": {"capacity": 1, "fill_rate": 1}}, max_in_flight=1)
    assert a.acquire("m") is None
    refusal = a.acquire("m")
    assert refusal is not None and refusal.reason == IN_FLIGHT  # no bucket token spent on it
    a.release("m")
    assert a.acquire("other") is None


def test_reload_changes_limits_and_keeps_state() -> None:
    async def main() -> None:
        a, clock = admission({"requests": {"capacity": 2, "fill_rate": 1}, "concurrency": 1, "queue": 4})
        assert a.acquire("m") is None
        woken: list[object] = []
        assert isinstance(a.acquire("m", wake=woken.append), Waiting)
        assert a.acquire("m") is not None  # the bucket is empty
        spec = spec_with(defaults={"requests": {"capacity": 10, "fill_rate": 100}, "concurrency": 2})
        a.reload(spec.limits_for)
        assert woken == [None] and a.active == 2  # the raised concurrency took the waiter
        clock.now += 1.0
        assert a.acquire("m") is not None and a.acquire("m").reason == SHED_QUEUE_FULL  # type: ignore[union-attr]
        a.reload(None)  # limits removed: everything is admitted, the counts stay right
        assert a.acquire("m") is None
        for _ in range(3):
            a.release("m")
        assert a.active == 0

    asyncio.run(main())


def test_model_labels_bound_the_gates() -> None:
    spec = spec_with(defaults={"requests": {"capacity": 1, "fill_rate": 1}})
    a = Admission(0, spec.limits_for, lambda name: name if name == "m" else contract.MODEL_OVERFLOW)
    assert a.acquire("invented-1") is None
    refusal = a.acquire("invented-2")  # shares the overflow label's bucket
    assert refusal is not None and refusal.reason == SHED_REQUESTS and "__other__" in refusal.message
    assert a.acquire("m") is None


# --------------------------------------------------------------------------- adaptive concurrency


def test_adaptive_target_defaults_to_half_of_each_models_sla() -> None:
    spec = spec_with(defaults={"concurrency": 4, "adaptive": {"max": 16}})
    own = spec.limits_for("m")  # latency_sla_ms 100
    assert own is not None and own.adaptive is not None and own.adaptive.target_ms == 50
    other = spec.limits_for("unlisted")  # the defaults' SLA, 500 ms
    assert other is not None and other.adaptive is not None and other.adaptive.target_ms == 250
    assert spec.defaults.limits.adaptive.target_ms is None  # type: ignore[union-attr]  # not mutated
    fixed = spec_with(model={"concurrency": 4, "adaptive": {"min": 2, "max": 16, "target_ms": 30}})
    got = fixed.limits_for("m")
    assert got is not None and got.adaptive is not None
    assert (got.adaptive.min, got.adaptive.max, got.adaptive.target_ms) == (2, 16, 30)


def limit_of(reg: CollectorRegistry, model: str = "m") -> float | None:
    return reg.get_sample_value(contract.CONCURRENCY_LIMIT.name, {"model": model})


def answer(a: Admission, n: int, latency: float | None, pressed: bool = True) -> None:
    """``n`` requests admitted and answered one by one, each after ``latency`` seconds in the
    server; ``pressed``: a further request finds the limit reached before each answer."""
    for _ in range(n):
        a.acquire("m")
        if pressed:
            while a.acquire("m") is None:  # fill the free slots; the refusal marks the limit reached
                pass
        a.release("m", latency)
    while a.active:  # what the filling admitted, answered too fast to count
        a.release("m")


def test_adaptive_grows_by_one_per_fast_window_while_the_limit_is_reached() -> None:
    reg = CollectorRegistry()
    a, _ = admission({"concurrency": 10, "adaptive": {"min": 2, "max": 12, "target_ms": 50}}, registry=reg)
    assert a.acquire("m") is None  # the gate exists and exports its limit
    a.release("m")
    assert limit_of(reg) == 10
    answer(a, 9, 0.010)
    assert limit_of(reg) == 10  # a window is max(limit, 10) answers
    answer(a, 1, 0.010)
    assert limit_of(reg) == 11
    answer(a, 11, 0.010)
    assert limit_of(reg) == 12
    answer(a, 100, 0.010)
    assert limit_of(reg) == 12  # max


def test_adaptive_does_not_grow_a_limit_nobody_reaches() -> None:
    reg = CollectorRegistry()
    a, _ = admission({"concurrency": 4, "adaptive": {"max": 64, "target_ms": 50}}, registry=reg)
    answer(a, 200, 0.001, pressed=False)  # one request at a time, fast
    assert limit_of(reg) == 4


def test_adaptive_shrinks_by_a_fifth_when_a_tenth_are_slow_and_skips_what_was_in_flight() -> None:
    reg = CollectorRegistry()
    a, _ = admission({"concurrency": 20, "adaptive": {"min": 5, "max": 20, "target_ms": 50}}, registry=reg)
    for _ in range(20):
        assert a.acquire("m") is None
    a.release("m", 0.200)
    a.release("m", 0.200)
    assert limit_of(reg) == 20  # 2 slow of a 20-answer window: its P90 may still be under
    a.release("m", 0.200)
    assert limit_of(reg) == 16  # 3: over a tenth
    # The 17 still in flight ran under the old limit: their answers are skipped.
    for _ in range(17):
        a.release("m", 0.200)
    assert limit_of(reg) == 16 and a.active == 0
    for _ in range(16):
        assert a.acquire("m") is None
    assert a.acquire("m") is not None  # the new limit holds
    a.release("m", 0.200)
    a.release("m", 0.200)  # over 1.6 of a 16-answer window
    assert limit_of(reg) == 12
    while a.active:
        a.release("m", 0.200)
    assert limit_of(reg) == 12
    answer(a, 100, 1.0, pressed=False)
    assert limit_of(reg) == 5  # min


def test_adaptive_needs_the_latency_a_caller_passes() -> None:
    reg = CollectorRegistry()
    a, _ = admission({"concurrency": 8, "adaptive": {"max": 16, "target_ms": 50}}, registry=reg)
    answer(a, 50, None)  # streams, or a caller that does not time its requests
    assert limit_of(reg) == 8


def test_adaptive_growth_admits_waiters_and_a_reload_keeps_the_limit_within_new_bounds() -> None:
    async def main() -> None:
        reg = CollectorRegistry()
        limits = {"concurrency": 10, "queue": 4, "adaptive": {"max": 20, "target_ms": 50}}
        a, _ = admission(limits, registry=reg)
        woken: list[object] = []
        for _ in range(10):
            assert a.acquire("m") is None
        for _ in range(9):  # 9 fast answers, each slot taken again at once
            a.release("m", 0.001)
            assert a.acquire("m") is None
        assert isinstance(a.acquire("m", wake=woken.append), Waiting)  # the limit is reached
        assert isinstance(a.acquire("m", wake=woken.append), Waiting)
        a.release("m", 0.001)  # the 10th: the window grows the limit to 11
        assert limit_of(reg) == 11 and woken == [None, None] and a.active == 11  # freed + grown
        while a.active:
            a.release("m")
        # Grow it further, then reload with a lower max: the limit found stays, clamped.
        answer(a, 40, 0.001)
        assert limit_of(reg) >= 13  # type: ignore[operator]
        spec = spec_with(defaults={"concurrency": 10, "adaptive": {"max": 12, "target_ms": 50}})
        a.reload(spec.limits_for)
        assert limit_of(reg) == 12
        a.reload(spec_with(defaults={"concurrency": 6}).limits_for)  # static again: its value
        assert limit_of(reg) == 6
        a.reload(spec_with(defaults={"requests": {"capacity": 5, "fill_rate": 1}}).limits_for)
        assert limit_of(reg) is None  # no concurrency limit: no series

    asyncio.run(main())


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"threshold": 0}, "alerts.load_shedding.threshold: must be greater than 0"),
        ({"threshold": 1}, "alerts.load_shedding.threshold: must be less than 1"),
        ({"window": "0s"}, "alerts.load_shedding.window: must be a positive duration"),
        ({"for": "soon"}, "alerts.load_shedding.for: 'soon' is not a duration"),
        ({"treshold": 0.1}, "alerts.load_shedding.treshold: unknown key"),
    ],
)
def test_bad_load_shedding_alert_settings(value: dict, expected: str) -> None:
    with pytest.raises(SpecError) as excinfo:
        parse_spec({"alerts": {"load_shedding": value}})
    assert str(excinfo.value).startswith(f"fleet.yaml: {expected}"), str(excinfo.value)
