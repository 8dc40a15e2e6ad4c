"""Dynamic batching benchmark: throughput and P99 with and without Triton's dynamic batching,
and against the naive one-request-at-a-time FastAPI server, at concurrency 1, 8 and 32.

Starts a real Triton on the reference repository and ``inferwatch naive-server`` on free
loopback ports, drives each with ``reference_server.loadgen`` (closed loop over HTTP, so every
server gets the same client), and reads the achieved batch size from Triton's own counters
(inferences / executions). Two compute paths, each served three ways:

- float32: ``dense_batched`` (the seed configuration, preferred [4, 8]), ``dense_unbatched``, naive;
- int4-streaming: ``dense_int4_batched`` (max 32, preferred [16, 32]), ``dense_int4_unbatched``, naive.

Usage:

    .venv/bin/python benchmarks/batching.py [--duration 10] [--concurrency 1 8 32] [--write]

``--write`` replaces the "Dynamic batching (reference server)" section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from inferwatch import contract  # noqa: E402
from inferwatch.net import free_port  # noqa: E402
from reference_server import triton_metrics  # noqa: E402
from reference_server.launcher import TritonServer  # noqa: E402
from reference_server.loadgen import LoadConfig, LoadGenerator, Target, run_load  # noqa: E402

SECTION = "## Dynamic batching (reference server)"
COMMAND = ".venv/bin/python benchmarks/batching.py --write"
PATHS = {
    "float32": ("dense_batched", "dense_unbatched"),
    "int4-streaming": ("dense_int4_batched", "dense_int4_unbatched"),
}


@dataclass
class Row:
    path: str
    server: str  # "triton, dynamic batching" | "triton, no batching" | "naive FastAPI"
    model: str
    concurrency: int
    throughput: float  # ok requests/s
    p50_ms: float
    p99_ms: float
    errors: int
    avg_batch: float | None  # from Triton's counters; None for the naive server


@dataclass
class Cell:
    path: str
    server: str
    url: str
    model: str
    concurrency: int
    metrics_url: str | None
    ok: int = 0
    errors: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    inferences: float = 0.0
    executions: float = 0.0

    def row(self) -> Row:
        p50, p99 = (float(v) * 1e3 for v in np.percentile(self.latencies or [0.0], [50, 99]))
        return Row(
            self.path,
            self.server,
            self.model,
            self.concurrency,
            self.ok / self.seconds if self.seconds else 0.0,
            p50,
            p99,
            self.errors,
            self.inferences / self.executions if self.executions else None,
        )


def measure(cell: Cell, seconds: float, warmup: float) -> None:
    """One slice of closed-loop load on ``cell``, added to its totals."""

    def config(d: float) -> LoadConfig:
        return LoadConfig(
            url=cell.url,
            protocol="http",
            concurrency=cell.concurrency,
            duration=d,
            targets=[Target(cell.model)],
        )

    if warmup > 0:
        run_load(config(warmup))
    before = triton_metrics.scrape(cell.metrics_url) if cell.metrics_url else None
    gen = LoadGenerator(config(seconds))
    s = gen.run()
    if cell.metrics_url and before is not None:
        after = triton_metrics.scrape(cell.metrics_url)
        cell.inferences += triton_metrics.delta(
            before, after, contract.TRITON_INFERENCE_COUNT.name, cell.model
        )
        cell.executions += triton_metrics.delta(before, after, contract.TRITON_EXEC_COUNT.name, cell.model)
    cell.ok += s.ok
    cell.errors += sum(s.errors.values())
    cell.seconds += s.elapsed_s
    cell.latencies += gen.stats.latencies


def run(
    duration: float, warmup: float, concurrencies: list[int], paths: list[str], rounds: int
) -> tuple[list[Row], dict]:
    state = Path(tempfile.mkdtemp(prefix="inferwatch-bench-"))
    naive_port = free_port()
    naive_log = open(state / "naive.log", "wb")
    naive = subprocess.Popen(
        [sys.executable, "-m", "reference_server.naive", "--port", str(naive_port)],
        cwd=ROOT,
        stdout=naive_log,
        stderr=subprocess.STDOUT,
    )
    load_before = os.getloadavg()
    started = time.time()
    cells: list[Cell] = []
    try:
        with TritonServer(
            http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), state_dir_path=state
        ) as triton:
            naive_url = f"127.0.0.1:{naive_port}"
            _wait_naive(naive_url, naive)
            for path in paths:
                batched, unbatched = PATHS[path]
                for c in concurrencies:
                    group = [
                        Cell(
                            path, "triton, dynamic batching", triton.http_url, batched, c, triton.metrics_url
                        ),
                        Cell(path, "triton, no batching", triton.http_url, unbatched, c, triton.metrics_url),
                        Cell(path, "naive FastAPI", naive_url, unbatched, c, None),
                    ]
                    # The cells compared with each other take turns, slice by slice, so that the
                    # shared machine's load drifting over minutes hits all of them alike.
                    for r in range(rounds):
                        for cell in group if r % 2 == 0 else reversed(group):
                            measure(cell, duration / rounds, warmup if r == 0 else 0.0)
                    for cell in group:
                        row = cell.row()
                        print(
                            f"{path:15} {cell.server:25} c={c:<3} {row.throughput:7.1f} req/s  "
                            f"p50 {row.p50_ms:7.1f} ms  p99 {row.p99_ms:7.1f} ms  "
                            f"batch {row.avg_batch or 0:4.1f}  errors {row.errors}",
                            file=sys.stderr,
                            flush=True,
                        )
                    cells += group
    finally:
        naive.terminate()
        naive.wait(30)
        naive_log.close()
    env = {
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "cpus": os.cpu_count(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "duration": duration,
        "rounds": rounds,
    }
    return [c.row() for c in cells], env


def _wait_naive(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the naive server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the naive server did not start")


def markdown(rows: list[Row], env: dict, concurrencies: list[int]) -> str:
    top = max(concurrencies)
    lines = [
        SECTION,
        "",
        f"Command: `{COMMAND}` (closed loop over HTTP with `reference_server.loadgen`, "
        f"{env['duration']:g} s per cell after a warm-up, in {env['rounds']} slices taking turns with the "
        "cells it is compared with; all servers on one machine with the client).",
        f"Run {env['when']} on {env['cpus']} shared cores; load average "
        f"{env['loadavg_before'][0]:.1f} before, {env['loadavg_after'][0]:.1f} after "
        "(other engineers' test suites ran at the same time, so "
        "absolute figures move between runs; compare the ratios within the run).",
        "",
        "| compute path | server | model | concurrency | throughput (req/s) | P50 (ms) | P99 (ms) "
        "| avg batch |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        batch = f"{r.avg_batch:.1f}" if r.avg_batch else "-"
        err = f" ({r.errors} errors)" if r.errors else ""
        lines.append(
            f"| {r.path} | {r.server} | `{r.model}` | {r.concurrency} | {r.throughput:.1f}{err} | "
            f"{r.p50_ms:.0f} | {r.p99_ms:.0f} | {batch} |"
        )
    lines += [
        "",
        f"At concurrency {top} (target: at least 4x the unbatched throughput, with a lower P99):",
        "",
    ]
    for path in dict.fromkeys(r.path for r in rows):
        by = {r.server: r for r in rows if r.path == path and r.concurrency == top}
        b, u, n = by.get("triton, dynamic batching"), by.get("triton, no batching"), by.get("naive FastAPI")
        if not (b and u):
            continue
        ratio = b.throughput / u.throughput if u.throughput else float("inf")
        meets = ratio >= 4 and b.p99_ms < u.p99_ms
        naive = f"; {b.throughput / n.throughput:.1f}x the naive server (P99 {n.p99_ms:.0f} ms)" if n else ""
        lines.append(
            f"- {path} (`{b.model}`): {ratio:.1f}x the throughput of `{u.model}`, P99 {b.p99_ms:.0f} ms "
            f"against {u.p99_ms:.0f} ms{naive}: **{'meets' if meets else 'does not meet'} the 4x target**."
        )
    return "\n".join(lines) + "\n"


def write_section(text: str, results: Path = ROOT / "benchmarks" / "RESULTS.md") -> None:
    """Replace only this benchmark's section (from its heading to the next ``## ``)."""
    doc = results.read_text()
    start = doc.index(SECTION)
    nxt = doc.find("\n## ", start + len(SECTION))
    end = len(doc) if nxt == -1 else nxt + 1
    notes_marker = "<!-- batching notes -->"
    old = doc[start:end]
    notes = old[old.index(notes_marker) :] if notes_marker in old else ""
    results.write_text(doc[:start] + text + ("\n" + notes if notes else "\n") + doc[end:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--duration", type=float, default=10.0, help="seconds measured per cell (default: %(default)s)"
    )
    p.add_argument(
        "--warmup", type=float, default=2.0, help="seconds of warm-up per cell (default: %(default)s)"
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="slices each cell's time is cut into, in turns (default: %(default)s)",
    )
    p.add_argument("--paths", nargs="+", choices=sorted(PATHS), default=list(PATHS))
    p.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = p.parse_args()
    rows, env = run(args.duration, args.warmup, args.concurrency, args.paths, args.rounds)
    text = markdown(rows, env, args.concurrency)
    print(text)
    if args.write:
        write_section(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
