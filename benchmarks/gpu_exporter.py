"""GPU exporter benchmark: scrape latency, CPU per scrape and resident memory for 1, 8 and 64 simulated GPUs.

Runs ``inferwatch gpu-exporter --backend simulated --gpus N`` as a user would, scrapes it over one
keep-alive connection (as Prometheus does) and reads the exporter's CPU time and memory from
/proc. Usage:

    .venv/bin/python benchmarks/gpu_exporter.py [--gpus 1 8 64] [--scrapes 300] [--markdown]
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from procstat import cpu_seconds, memory_kib

from inferwatch.contract import GPU_SCRAPE_DURATION
from inferwatch.net import free_port

ROOT = Path(__file__).resolve().parents[1]
# The exporter's own measure of reading and converting every GPU (before rendering).
COLLECT = re.compile(rb"^" + re.escape(GPU_SCRAPE_DURATION.name.encode()) + rb" (\S+)$", re.M)


def scrape(conn: http.client.HTTPConnection) -> bytes:
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    body = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"/metrics answered {resp.status}")
    return body


def bench(gpus: int, scrapes: int) -> dict[str, float]:
    port = free_port()
    exe = ROOT / ".venv" / "bin" / "inferwatch"
    cmd = [str(exe), "gpu-exporter", "--backend", "simulated", "--gpus", str(gpus)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "error"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        deadline = time.monotonic() + 60
        while True:
            try:
                body = scrape(conn)
                break
            except (OSError, http.client.HTTPException):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the exporter did not start") from None
                conn.close()
                time.sleep(0.2)
        for _ in range(20):  # warm-up
            scrape(conn)
        idle_rss = memory_kib([proc.pid])
        cpu0 = cpu_seconds([proc.pid])
        latencies, collect = [], []
        for _ in range(scrapes):
            t0 = time.perf_counter()
            body = scrape(conn)
            latencies.append(time.perf_counter() - t0)
            m = COLLECT.search(body)
            collect.append(float(m.group(1)) if m else float("nan"))
        cpu = cpu_seconds([proc.pid]) - cpu0
        rss, peak = memory_kib([proc.pid]), memory_kib([proc.pid], "VmHWM")
        conn.close()
        latencies.sort()
        return {
            "process": "inferwatch gpu-exporter",
            "gpus": gpus,
            "series": sum(1 for line in body.split(b"\n") if line and not line.startswith(b"#")),
            "bytes": len(body),
            "p50_ms": statistics.median(latencies) * 1000,
            "p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000,
            "collect_ms": statistics.median(collect) * 1000,
            "cpu_ms_per_scrape": cpu / scrapes * 1000,
            "rss_mib_idle": idle_rss / 1024,
            "rss_mib": rss / 1024,
            "peak_rss_mib": peak / 1024,
        }
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)


COLUMNS = [
    ("process", "process", "{}"),
    ("gpus", "GPUs", "{:d}"),
    ("series", "series", "{:d}"),
    ("bytes", "bytes", "{:d}"),
    ("p50_ms", "scrape P50 ms", "{:.2f}"),
    ("p99_ms", "scrape P99 ms", "{:.2f}"),
    ("collect_ms", "collect P50 ms", "{:.2f}"),
    ("cpu_ms_per_scrape", "CPU ms/scrape", "{:.2f}"),
    ("rss_mib", "RSS MiB", "{:.1f}"),
    ("peak_rss_mib", "peak RSS MiB", "{:.1f}"),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 8, 64], help="GPU counts (default: 1 8 64)")
    ap.add_argument("--scrapes", type=int, default=300, help="timed scrapes per GPU count (default: 300)")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = ap.parse_args(argv)
    if args.scrapes < 10 or any(g < 1 for g in args.gpus):
        ap.error("--scrapes must be >= 10 and every --gpus >= 1")
    rows = []
    for n in args.gpus:
        print(f"benchmarking {n} simulated GPU(s), {args.scrapes} scrapes ...", file=sys.stderr)
        rows.append(bench(n, args.scrapes))
    cells = [[fmt.format(int(r[k]) if fmt == "{:d}" else r[k]) for k, _, fmt in COLUMNS] for r in rows]
    heads = [h for _, h, _ in COLUMNS]
    if args.markdown:
        print("| " + " | ".join(heads) + " |")
        print("|" + "|".join(" ---: " for _ in heads) + "|")
        for row in cells:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(heads)]
        print("  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True)))
        for row in cells:
            print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
