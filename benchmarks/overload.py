"""Overload: one model at 1x, 2x and 3x its measured capacity, through the sidecar without and
with per-model limits, side by side in one run.

Starts a real Triton serving the reference ``ranker`` (version 1, dynamic batching up to 8,
one instance) with an injected per-batch latency (``--extra-latency-ms``, default 40 ms: the
model then sleeps instead of computing, so its capacity is set by the batch size and the sleep
rather than by the shared CPU), and two ``inferwatch sidecar`` processes in front of it: one with
a spec without limits, one whose spec limits ``ranker``. Then:

1. capacity: closed loop, 32 concurrent requests through the sidecar without limits;
   ``C`` = answers per second;
2. the limits, from the model, ``C`` and the SLA (``derive_limits``; ``--concurrency`` and
   ``--bucket`` override them to compare):

   - ``concurrency``: 4 batches of the model's ``max_batch_size`` (8), so 32, the concurrency
     ``C`` was measured at: one batch running and three in Triton's queue. A released slot's
     replacement must reach Triton before the batches ahead of it are done, or the batcher
     starts a short batch (after its 0.5 ms delay), capacity lost for good. Two batches (16)
     leave one batch time (40 ms) for that round trip, and at 3x the sidecar spends most of
     its CPU answering the shed requests (each a new connection): at 3x, Triton's achieved
     batch was 6.9 at 16, 6.4 at 24 and 7.9 at 32 (one short run each, 2026-11-30, so read
     them as a direction). More only adds latency: with the batcher full a request spends
     about ``concurrency / C`` in the server (Little's law), 170 ms at 32 for ``C`` = 185/s,
     so a tighter SLA needs fewer (see the queue).
   - the queue: under sustained overload it is always full, so every admitted request waits
     about ``queue / C`` in it: latency is ``(concurrency + queue) / C`` plus the sidecar and
     the client. Those get 0.7 of the SLA (``BUDGET``; the rest is headroom for a server
     that runs below ``C`` when the sender and the sidecar's shedding share its cores, and
     for the tail): ``queue_timeout_ms`` is that budget less the server time, at least 10 ms,
     ``queue`` is ``C`` x the timeout (10 ms and 2 for a 250 ms SLA and ``C`` = 185/s: the
     server's own queue holds the work). A longer queue adds its wait to every admitted
     request under overload and then times out; it helps only with bursts below capacity.
   - no ``requests`` bucket: concurrency already bounds the load by what the server
     completes, at whatever rate it completes it. A bucket refilled at exactly ``C``/s (the
     first runs in RESULTS.md, burst ``C``/10) sheds Poisson bursts at 1x (about 2.6% in a
     simulation of that bucket) and at 3x caps what is admitted at ``C``, so anything lost
     after it (a short batch, a queue timeout) takes goodput below ``C`` with no headroom
     left to make it up; the short batches above cost more. A bucket is a quota (a rate a
     model is sold), not capacity protection: ``--bucket 1`` adds that one to compare.
3. open loop (Poisson arrivals, each request's latency counted from its scheduled time, so a
   late sender does not hide a slow server) at 1x, 2x and 3x ``C``, each load against both
   sidecars in turn, ``--repeat`` times interleaved.

Reported per cell: goodput (200 answers within the SLA per second of the run), admitted P50 and
P99 (latency of the 200 answers), shed answers (429), other failures, and Triton's own view:
inferences per second (over the run and the drain of what was in flight) and the achieved batch
size. Usage:

    .venv/bin/python benchmarks/overload.py [--duration 10] [--loads 1 2 3] [--repeat 2]
        [--sla-ms 250] [--extra-latency-ms 40] [--concurrency N] [--bucket X]
        [--json out.json] [--admission-only]

A short check at 3x only: ``--loads 3 --repeat 1 --duration 5``.

The sender is Python (aiohttp) on the same 2 shared cores as Triton and the sidecars: read the
columns side by side, and the "late" column (arrivals sent more than 10 ms after their slot).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from inferwatch.net import free_port  # noqa: E402

PATH = "/v2/models/ranker/versions/1/infer"
CAPACITY_CONCURRENCY = 32
MAX_BATCH = 8  # the reference ranker's max_batch_size
BUDGET = 0.7  # of the SLA, for the server time and the queue wait (derive_limits)
MAX_OUTSTANDING = 4000  # the sender's own bound; arrivals past it are counted as skipped
LATE_S = 0.010
REQUEST_TIMEOUT_S = 30.0


def body_bytes() -> bytes:
    from reference_server.catalog import example_input

    x = example_input("ranker", 1, seed=7)["FEATURES"]
    body = {
        "inputs": [
            {
                "name": "FEATURES",
                "shape": list(x.shape),
                "datatype": "FP32",
                "data": [round(float(v), 4) for v in x.ravel()],
            }
        ]
    }
    return json.dumps(body).encode()


def start_sidecar(work: Path, name: str, triton, spec: Path) -> tuple[subprocess.Popen, int]:
    port, metrics = free_port(), free_port()
    proc = subprocess.Popen(
        [
            str(ROOT / ".venv" / "bin" / "inferwatch"),
            "sidecar",
            "--upstream-http",
            triton.http_url,
            "--upstream-grpc",
            triton.grpc_url,
            "--host",
            "127.0.0.1",
            "--http-port",
            str(port),
            "--grpc-port",
            str(free_port()),
            "--metrics-port",
            str(metrics),
            "--spec",
            str(spec),
            "--request-timeout",
            str(REQUEST_TIMEOUT_S),
        ],
        stdout=open(work / f"{name}.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    import httpx

    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{metrics}/readyz", timeout=2).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"sidecar {name} did not become ready; see {work / name}.log")
        time.sleep(0.2)


async def _post(session, url: str, body: bytes) -> int:
    async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
        await resp.read()
        return resp.status


async def closed_loop(port: int, body: bytes, seconds: float, concurrency: int) -> float:
    import aiohttp

    url = f"http://127.0.0.1:{port}{PATH}"
    done = 0
    stop = time.monotonic() + seconds

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < stop:
                if await _post(session, url, body) == 200:
                    done += 1

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.monotonic() - t0)


async def open_loop(port: int, body: bytes, rate: float, seconds: float, seed: int) -> dict:
    import aiohttp

    url = f"http://127.0.0.1:{port}{PATH}"
    rng = random.Random(seed)
    results: list[tuple[int | str, float]] = []
    late = skipped = 0
    tasks: set[asyncio.Task] = set()
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def one(slot: float) -> None:
            try:
                status: int | str = await _post(session, url, body)
            except Exception as exc:  # a failure is a result too
                status = type(exc).__name__
            results.append((status, time.monotonic() - slot))

        start = time.monotonic()
        slot = start
        while True:
            slot += rng.expovariate(rate)
            if slot - start >= seconds:
                break
            delay = slot - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            elif -delay > LATE_S:
                late += 1
            if len(tasks) >= MAX_OUTSTANDING:
                skipped += 1
                continue
            task = asyncio.create_task(one(slot))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks)
        elapsed = time.monotonic() - start  # with the drain of what was still in flight
    return {"results": results, "late": late, "skipped": skipped, "seconds": seconds, "elapsed": elapsed}


def triton_counts(metrics_url: str) -> tuple[float, float]:
    """Triton's own (inferences, executions) of ranker: what the server did in a run, and its
    achieved batch size (inferences / executions)."""
    import httpx

    from inferwatch import contract

    count = execs = 0.0
    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        if 'model="ranker"' not in line:
            continue
        if line.startswith(contract.TRITON_INFERENCE_COUNT.name + "{"):
            count += float(line.rsplit(" ", 1)[1])
        elif line.startswith(contract.TRITON_EXEC_COUNT.name + "{"):
            execs += float(line.rsplit(" ", 1)[1])
    return count, execs


def summarise(run: dict, sla_s: float) -> dict:
    results = run["results"]
    ok = sorted(lat for status, lat in results if status == 200)
    shed = sum(1 for status, _ in results if status == 429)
    failed = len(results) - len(ok) - shed
    kinds: dict[str, int] = {}
    for status, _ in results:
        if status not in (200, 429):
            kinds[str(status)] = kinds.get(str(status), 0) + 1

    def pct(q: float) -> float:
        return ok[min(len(ok) - 1, int(q * len(ok)))] * 1000 if ok else float("nan")

    return {
        "sent": len(results),
        "ok": len(ok),
        "shed": shed,
        "failed": failed,
        "failed_by_kind": kinds,
        "goodput": sum(1 for lat in ok if lat <= sla_s) / run["seconds"],
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "late": run["late"],
        "skipped": run["skipped"],
        "server_per_s": run.get("server", (0.0, 0.0))[0] / run["elapsed"],
        "batch": run["server"][0] / run["server"][1] if run.get("server", (0, 0))[1] else float("nan"),
    }


def derive_limits(capacity: float, sla_ms: float, concurrency: int = 0, bucket: float = 0.0) -> dict:
    """The recommended limits for one model (the module docstring says why): ``concurrency``
    (0: 4 batches); a queue timeout of the SLA's ``BUDGET`` less the server time at that
    concurrency (``concurrency / capacity``), at least 10 ms; a queue of ``capacity`` x that
    timeout; a request bucket only when ``bucket`` > 0 (refilled at ``bucket`` x ``capacity``,
    burst ``capacity``/10)."""
    concurrency = concurrency or 4 * MAX_BATCH
    server_ms = concurrency / capacity * 1000.0
    timeout_ms = max(10.0, BUDGET * sla_ms - server_ms)
    limits: dict = {
        "concurrency": concurrency,
        "queue": max(1, math.ceil(capacity * timeout_ms / 1000.0)),
        "queue_timeout_ms": round(timeout_ms, 1),
    }
    if bucket > 0:
        limits["requests"] = {
            "capacity": max(1, round(capacity / 10)),
            "fill_rate": round(bucket * capacity, 1),
        }
    return limits


def admission_cost() -> dict[str, float]:
    """CPU per admitted request of ``Admission`` itself (acquire + release, microseconds, best
    of 5), without limits and with a request bucket and a concurrency cap that never refuse."""
    import timeit

    from prometheus_client import CollectorRegistry

    from inferwatch.spec import parse_spec
    from sidecar.core.admission import Admission

    limits = {"requests": {"capacity": 10**9, "fill_rate": 10**9}, "concurrency": 10**6, "queue": 10}
    spec = parse_spec({"models": [{"name": "ranker", "latency_sla_ms": 100, "limits": limits}]})
    out = {}
    for name, adm in (
        ("no limits", Admission(1024)),
        ("limits", Admission(1024, spec.limits_for, lambda m: m, CollectorRegistry())),
    ):

        def one(adm: Admission = adm) -> None:
            adm.acquire("ranker")
            adm.release("ranker")

        out[name] = min(timeit.repeat(one, number=200_000, repeat=5)) / 200_000 * 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per open-loop run")
    ap.add_argument("--loads", type=float, nargs="+", default=[1.0, 2.0, 3.0], help="x the capacity")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--sla-ms", type=float, default=250.0, help="the SLA goodput is judged against")
    ap.add_argument("--extra-latency-ms", type=float, default=40.0)
    ap.add_argument(
        "--concurrency",
        type=int,
        default=0,
        help="the limited sidecar's concurrency (default: 4 batches: 32)",
    )
    ap.add_argument(
        "--bucket",
        type=float,
        default=0.0,
        help="add a request bucket refilled at this x C per second, burst C/10 (default: none)",
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument("--admission-only", action="store_true", help="only the in-process cost of admission")
    args = ap.parse_args(argv)
    cost = admission_cost()
    print(
        "admission, acquire + release per request: "
        + ", ".join(f"{name} {us:.2f} us" for name, us in cost.items()),
        flush=True,
    )
    if args.admission_only:
        return 0

    import yaml

    from reference_server import faults
    from reference_server.launcher import TritonServer

    work = Path(tempfile.mkdtemp(prefix="iw-overload-"))
    body = body_bytes()
    sla_s = args.sla_ms / 1000.0
    triton = TritonServer(
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
        state_dir_path=work / "triton",
        extra_args=("--model-control-mode=explicit", "--load-model=ranker"),
    )
    procs: list[subprocess.Popen] = []
    print("starting Triton ...", file=sys.stderr, flush=True)
    triton.start()
    try:
        faults.set_fault("ranker", "1", extra_latency_ms=args.extra_latency_ms, state_dir=work / "triton")
        model = {"name": "ranker", "latency_sla_ms": args.sla_ms}
        plain = work / "plain.yaml"
        plain.write_text(yaml.safe_dump({"models": [model]}))
        no_limits, plain_port = start_sidecar(work, "sidecar-plain", triton, plain)
        procs.append(no_limits)

        print("measuring capacity ...", file=sys.stderr, flush=True)
        asyncio.run(closed_loop(plain_port, body, 2.0, CAPACITY_CONCURRENCY))  # warm-up
        capacity = asyncio.run(closed_loop(plain_port, body, 8.0, CAPACITY_CONCURRENCY))
        limits = derive_limits(capacity, args.sla_ms, args.concurrency, args.bucket)
        limited_spec = work / "limited.yaml"
        limited_spec.write_text(yaml.safe_dump({"models": [{**model, "limits": limits}]}))
        limited, limited_port = start_sidecar(work, "sidecar-limited", triton, limited_spec)
        procs.append(limited)
        print(f"capacity {capacity:.1f} req/s; limits {limits}", file=sys.stderr, flush=True)

        targets = {"no limits": plain_port, "limits": limited_port}
        cells: dict[str, dict[str, list[dict]]] = {}
        for rep in range(args.repeat):
            for load in args.loads:
                for name, port in targets.items():
                    rate = load * capacity
                    print(
                        f"[{rep + 1}/{args.repeat}] {load:g}x ({rate:.0f}/s) -> {name}",
                        file=sys.stderr,
                        flush=True,
                    )
                    before = triton_counts(triton.metrics_url)
                    run = asyncio.run(
                        open_loop(port, body, rate, args.duration, seed=rep * 100 + int(load * 10))
                    )
                    after = triton_counts(triton.metrics_url)
                    run["server"] = (after[0] - before[0], after[1] - before[1])
                    cells.setdefault(f"{load:g}", {}).setdefault(name, []).append(summarise(run, sla_s))
                    time.sleep(2.0)  # the server's queue drains between runs
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        triton.stop()

    report = {"capacity": capacity, "limits": limits, "sla_ms": args.sla_ms, "cells": cells}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print(
        f"\ncapacity C = {capacity:.1f} req/s (closed loop, {CAPACITY_CONCURRENCY} concurrent); "
        f"SLA {args.sla_ms:g} ms"
    )
    print(f"limits: {json.dumps(limits)}\n")
    print(
        "| load | sidecar | offered/s | goodput/s (x C) | admitted P50 ms | admitted P99 ms "
        "| 200 | 429 | failed | late | server/s | batch |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    failures: dict[str, int] = {}
    for load, by_target in cells.items():
        for name, runs in by_target.items():
            for r in runs:
                for kind, n in r["failed_by_kind"].items():
                    failures[f"{load}x {name}: {kind}"] = failures.get(f"{load}x {name}: {kind}", 0) + n

            def med(key: str, runs: list[dict] = runs) -> float:
                return statistics.median(r[key] for r in runs)

            goodputs = ", ".join(f"{r['goodput']:.0f}" for r in runs)
            print(
                f"| {load}x | {name} | {float(load) * capacity:.0f} | {med('goodput'):.0f} [{goodputs}] "
                f"({med('goodput') / capacity:.2f}) | {med('p50_ms'):.0f} | {med('p99_ms'):.0f} | "
                f"{med('ok'):.0f} | {med('shed'):.0f} | {med('failed'):.0f} | {med('late'):.0f} | "
                f"{med('server_per_s'):.0f} | {med('batch'):.1f} |"
            )
    if failures:
        print("\nfailures (all runs): " + ", ".join(f"{k} x{v}" for k, v in failures.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
