"""Adaptive concurrency (``limits.adaptive``) in the ``inferwatch sidecar`` process, in front of
the real Triton: under a closed loop of clients the limit grows while the ranker answers within
the target, shrinks to its ``min`` once an injected latency puts every answer past it, and grows
again when the fault is cleared. Read from the sidecar's own gauge
(``inferwatch_concurrency_limit``). Nothing here asserts on speed: each phase waits (with a
generous bound) for the limit to get where the controller must take it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
import yaml

from inferwatch import contract
from reference_server import faults
from reference_server.catalog import example_input
from tests.fixtures.sidecar import launch_sidecar

LIMIT = contract.CONCURRENCY_LIMIT.name
CLIENTS = 16
MIN, START, MAX = 2, 4, 24
SLA_MS = 200  # target: half of it, 100 ms in the server
FAULT_MS = 400  # per batch: every answer past the target
PHASE_S = 180.0  # a bound for a loaded machine, not a speed

pytestmark = pytest.mark.integration


def limit_now(sc) -> float | None:
    return sc.counts(LIMIT, "model").get(("ranker",))


def wait_limit(sc, ok, what: str, seen: list) -> float:
    deadline = time.monotonic() + PHASE_S
    while True:
        value = limit_now(sc)
        if not seen or seen[-1] != value:
            seen.append(value)
        if value is not None and ok(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"the limit did not {what}: went {seen}")
        time.sleep(0.2)


@pytest.mark.parametrize("engine", ["relay", "aio", "http"])
def test_adaptive_limit_shrinks_under_injected_latency_and_grows_back(triton, tmp_path: Path, engine) -> None:
    """``engine``: the gRPC engine the clients go through, or ``http``: the HTTP proxy (the
    sidecar's default gRPC engine beside it, unused)."""
    limits = {
        "concurrency": START,
        "queue": CLIENTS,  # the aio engine and HTTP queue; the relay sheds at once (the clients back off)
        "queue_timeout_ms": 60_000,
        "adaptive": {"min": MIN, "max": MAX},
    }
    spec = tmp_path / "fleet.yaml"
    spec.write_text(
        yaml.safe_dump({"models": [{"name": "ranker", "latency_sla_ms": SLA_MS, "limits": limits}]})
    )
    x = example_input("ranker", batch=1)["FEATURES"]
    stop = threading.Event()
    outcomes: dict[str, int] = {}
    lock = threading.Lock()

    with launch_sidecar(
        triton.http_url,
        triton.grpc_url,
        tmp_path,
        "--spec",
        str(spec),
        *(() if engine == "http" else ("--grpc-engine", engine)),
    ) as sc:

        def client() -> None:
            api = thttp if engine == "http" else tgrpc
            if engine == "http":
                c = thttp.InferenceServerClient(sc.http_url, network_timeout=120.0)
            else:
                c = tgrpc.InferenceServerClient(sc.grpc_url)
            inp = api.InferInput("FEATURES", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            try:
                while not stop.is_set():
                    try:
                        if engine == "http":
                            c.infer("ranker", [inp], model_version="1")
                        else:
                            c.infer("ranker", [inp], model_version="1", client_timeout=120)
                        got = "OK"
                    except Exception as exc:  # tritonclient wraps the RpcError
                        got = str(getattr(exc, "status", lambda: None)())
                    with lock:
                        outcomes[got] = outcomes.get(got, 0) + 1
                    if got != "OK":
                        time.sleep(0.01)  # shed by the relay: back off a little
            finally:
                c.close()

        threads = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
        seen: list = []
        try:
            assert limit_now(sc) is None  # no gate until the model's first request
            for t in threads:
                t.start()
            # Fast answers and the limit pressed by 16 clients: it grows.
            grown = wait_limit(sc, lambda v: v >= 10, "grow under fast answers", seen)
            # Every answer now takes over 400 ms, past the 100 ms target: down to min, no lower.
            faults.set_fault("ranker", "1", extra_latency_ms=FAULT_MS, state_dir=triton.state_dir)
            wait_limit(sc, lambda v: v == MIN, f"shrink to {MIN} from {grown}", seen)
            # Recovered: it grows again.
            faults.clear("ranker", state_dir=triton.state_dir)
            wait_limit(sc, lambda v: v >= 2 * MIN + 2, "grow back after the fault", seen)
        finally:
            faults.clear("ranker", state_dir=triton.state_dir)
            stop.set()
            for t in threads:
                t.join(150)
        log = sc.log()

    assert min(v for v in seen if v is not None) == MIN and max(v for v in seen if v is not None) <= MAX, seen
    # Admitted requests all succeeded; only the relay sheds (it has no queue), as RESOURCE_EXHAUSTED.
    allowed = {"OK"} | ({"StatusCode.RESOURCE_EXHAUSTED"} if engine == "relay" else set())
    assert set(outcomes) <= allowed, (outcomes, log[-2000:])
    assert outcomes.get("OK", 0) > 0
