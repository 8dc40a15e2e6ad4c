"""Real-GPU check: the exporter's NVML figures against ``nvidia-smi``, printed as a table.

On a machine with an NVIDIA GPU and driver:

    .venv/bin/python -m exporters.gpu_check            # starts the exporter with --backend nvml
    .venv/bin/python -m exporters.gpu_check --url http://127.0.0.1:9400   # checks a running one

It scrapes /metrics, queries ``nvidia-smi --query-gpu`` at the same moment, compares each figure
within a tolerance (utilization, power and clocks move between the two reads), checks that the
energy counter grows and that per-process memory matches ``--query-compute-apps``, and reports
the scrape latency and the exporter's resident memory. Exit code 0 when every row agrees.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from inferwatch import contract as c
from inferwatch.net import free_port

MIB = 1024 * 1024
QUERY = [
    "index",
    "uuid",
    "name",
    "memory.total",
    "memory.used",
    "memory.free",
    "memory.reserved",
    "utilization.gpu",
    "utilization.memory",
    "clocks.sm",
    "clocks.mem",
    "temperature.gpu",
    "temperature.memory",
    "power.draw",
]
OPTIONAL = {"memory.reserved", "temperature.memory"}  # older drivers do not know these


@dataclass(frozen=True)
class Check:
    name: str
    metric: str
    smi: str
    abs_tol: float
    rel_tol: float = 0.0


CHECKS = [
    Check("FB total (MiB)", "fb_total_mib", "memory.total", 1),
    Check("FB used (MiB)", c.DCGM_FB_USED.name, "memory.used", 64, 0.02),
    Check("FB free (MiB)", c.DCGM_FB_FREE.name, "memory.free", 64, 0.02),
    Check("FB reserved (MiB)", c.DCGM_FB_RESERVED.name, "memory.reserved", 1),
    Check("GPU util (%)", c.DCGM_GPU_UTIL.name, "utilization.gpu", 15),
    Check("mem copy util (%)", c.DCGM_MEM_COPY_UTIL.name, "utilization.memory", 15),
    Check("SM clock (MHz)", c.DCGM_SM_CLOCK.name, "clocks.sm", 30, 0.1),
    Check("mem clock (MHz)", c.DCGM_MEM_CLOCK.name, "clocks.mem", 30, 0.02),
    Check("GPU temp (C)", c.DCGM_GPU_TEMP.name, "temperature.gpu", 3),
    Check("memory temp (C)", c.DCGM_MEMORY_TEMP.name, "temperature.memory", 3),
    Check("power (W)", c.DCGM_POWER_USAGE.name, "power.draw", 20, 0.15),
]


def nvidia_smi(fields: list[str]) -> list[dict[str, str]]:
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stdout.strip() or out.stderr.strip())
    return [
        dict(zip(fields, (v.strip() for v in row), strict=True))
        for row in csv.reader(io.StringIO(out.stdout))
    ]


def query_gpus() -> list[dict[str, str]]:
    try:
        return nvidia_smi(QUERY)
    except RuntimeError:
        return nvidia_smi([f for f in QUERY if f not in OPTIONAL])


def compute_apps() -> dict[str, float]:
    """MiB used by compute processes, summed per GPU UUID."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=gpu_uuid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    sums: dict[str, float] = {}
    for row in csv.reader(io.StringIO(out.stdout)):
        if len(row) == 2 and row[1].strip().isdigit():
            sums[row[0].strip()] = sums.get(row[0].strip(), 0) + float(row[1])
    return sums


def scrape(url: str) -> tuple[dict[str, dict[str, float]], dict, float]:
    """Per-UUID metric values, the parsed families, and the scrape's latency in seconds."""
    t0 = time.perf_counter()
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    latency = time.perf_counter() - t0
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    per_gpu: dict[str, dict[str, float]] = {}
    for fam in fams.values():
        for s in fam.samples:
            uuid = s.labels.get(c.L_UUID)
            if uuid and fam.name.startswith("DCGM_"):
                per_gpu.setdefault(uuid, {})[fam.name] = s.value
            if uuid and fam.name == c.GPU_FB_TOTAL_BYTES.name:
                per_gpu.setdefault(uuid, {})["fb_total_mib"] = s.value / MIB
                per_gpu[uuid]["modelName"] = s.labels.get(c.L_MODEL_NAME, "")  # type: ignore[assignment]
    return per_gpu, fams, latency


def start_exporter() -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "exporters", "--backend", "nvml", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    health: object = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exporter exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=2) as resp:
                health = json.load(resp)
            if health["backend_up"]:  # type: ignore[index]
                return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGTERM)
    raise RuntimeError(f"NVML did not come up within 60 s (last /healthz: {health})")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="check a running exporter at this URL instead of starting one")
    args = ap.parse_args(argv)
    if shutil.which("nvidia-smi") is None:
        print(
            "gpu_check: error: nvidia-smi not found; this check needs a machine with an NVIDIA GPU",
            file=sys.stderr,
        )
        return 2
    proc = None
    try:
        if args.url:
            url = args.url.rstrip("/")
        else:
            proc, url = start_exporter()
        scrape(url)  # warm-up
        per_gpu, fams, _ = scrape(url)
        smi = query_gpus()
        time.sleep(1.0)
        per_gpu2, _, _ = scrape(url)
        latencies = sorted(scrape(url)[2] for _ in range(30))
        apps = compute_apps()

        rows: list[tuple[str, str, str, str, str]] = []
        bad = 0

        def row(gpu: str, name: str, ours: object, theirs: object, ok: bool) -> None:
            nonlocal bad
            bad += not ok
            rows.append((gpu, name, str(ours), str(theirs), "ok" if ok else "DIFF"))

        for g in smi:
            ours = per_gpu.get(g["uuid"])
            if ours is None:
                row(g["index"], "present", "missing", g["uuid"], False)
                continue
            row(g["index"], "modelName", ours.get("modelName"), g["name"], ours.get("modelName") == g["name"])
            for chk in CHECKS:
                theirs = g.get(chk.smi, "")
                mine = ours.get(chk.metric)
                if theirs in ("", "[N/A]", "N/A", "[Not Supported]"):
                    row(g["index"], chk.name, mine, theirs or "not queried", mine is None)
                    continue
                if mine is None:
                    row(g["index"], chk.name, "absent", theirs, False)
                    continue
                tol = max(chk.abs_tol, chk.rel_tol * float(theirs))
                row(g["index"], chk.name, f"{mine:g}", theirs, abs(mine - float(theirs)) <= tol)
            e1 = ours.get(c.DCGM_TOTAL_ENERGY.name)
            e2 = per_gpu2.get(g["uuid"], {}).get(c.DCGM_TOTAL_ENERGY.name)
            row(
                g["index"],
                "energy grows (mJ)",
                f"{e1:g} -> {e2:g}" if e1 and e2 else "absent",
                "",
                bool(e1 and e2 and e2 > e1),
            )
            procs = fams.get(c.GPU_PROCESS_MEMORY.name)
            mine_apps = (
                sum(s.value for s in procs.samples if s.labels.get(c.L_UUID) == g["uuid"]) / MIB
                if procs
                else 0
            )
            theirs_apps = apps.get(g["uuid"], 0)
            row(
                g["index"],
                "process memory (MiB)",
                f"{mine_apps:g}",
                f"{theirs_apps:g}",
                abs(mine_apps - theirs_apps) <= 64,
            )

        table = [("gpu", "figure", "exporter", "nvidia-smi", ""), *rows]
        widths = [max(len(r[i]) for r in table) for i in range(5)]
        for r in table:
            print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))
        p50, worst = statistics.median(latencies) * 1000, latencies[-1] * 1000
        print(f"\nscrape latency over 30 scrapes: P50 {p50:.2f} ms, max {worst:.2f} ms")
        if proc is not None:
            print(f"exporter resident memory: {rss_mib(proc.pid):.1f} MiB")
        up = fams.get(c.GPU_BACKEND_UP.name)
        print(f"backend up: {[s.value for s in up.samples] if up else 'absent'}; rows differing: {bad}")
        return 0 if bad == 0 else 1
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)


if __name__ == "__main__":
    sys.exit(main())
