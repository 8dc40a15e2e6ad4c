#!/usr/bin/env python3
"""Counts the Prometheus series one model pod and one GPU add, from a real run.

    .venv/bin/python deploy/measure_series.py [--json]

Starts the real Triton on the reference models, the sidecar in front of it and the GPU
exporter (simulated backend, 1 and 8 GPUs) on free loopback ports; sends HTTP and gRPC
traffic to every model and version through the sidecar, with an injected error rate on
one version and requests for a model that does not exist (so successes, server errors
and client errors all appear); then scrapes each /metrics once and counts the series
per metric family, per model and per GPU. deploy/SCALING.md quotes its output.
It also reads the resident memory of the sidecar and of each exporter after the
scrapes. Takes about a minute and a half; nothing is left running.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from inferwatch.net import free_port

ROOT = Path(__file__).resolve().parents[1]
INFERWATCH = [str(ROOT / ".venv" / "bin" / "inferwatch")]
if not Path(INFERWATCH[0]).exists():
    INFERWATCH = [sys.executable, "-m", "inferwatch.cli"]
MODELS = ("dense_batched", "dense_unbatched", "ranker:1", "ranker:2")


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"measure_series: a process exited ({proc.args}) before {url} answered")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"measure_series: {url} did not answer within {timeout:.0f}s")


@contextmanager
def started(args: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    with log.open("wb") as out:
        env = {**os.environ, **(env or {})}
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def series(url: str) -> list[tuple[str, str, dict[str, str]]]:
    """(family, sample name, labels) of every sample a /metrics page exposes."""
    text = httpx.get(url, timeout=10.0).text
    return [(f.name, s.name, s.labels) for f in text_string_to_metric_families(text) for s in f.samples]


def rss_mib(proc: subprocess.Popen) -> float:
    """Resident memory of a started process (the footprint the Kubernetes requests follow)."""
    for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def count(samples: list[tuple[str, str, dict[str, str]]]) -> dict:
    by_family = Counter(f for f, _, _ in samples)
    by_model = Counter(labels.get("model") for _, _, labels in samples if labels.get("model") is not None)
    return {"total": len(samples), "by_family": dict(by_family.most_common()), "by_model": dict(by_model)}


def measure(duration: float) -> dict:
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="inferwatch-series-") as tmp:
        state = Path(tmp)
        p = {k: free_port() for k in ("t_http", "t_grpc", "t_metrics", "s_http", "s_grpc", "s_metrics")}
        triton = [
            *INFERWATCH, "triton", "--host", "127.0.0.1", "--http-port", str(p["t_http"]),
            "--grpc-port", str(p["t_grpc"]), "--metrics-port", str(p["t_metrics"]), "--state-dir", str(state),
        ]  # fmt: skip
        sidecar = [
            *INFERWATCH, "sidecar", "--host", "127.0.0.1",
            "--upstream-http", f"127.0.0.1:{p['t_http']}", "--upstream-grpc", f"127.0.0.1:{p['t_grpc']}",
            "--http-port", str(p["s_http"]), "--grpc-port", str(p["s_grpc"]),
            "--metrics-port", str(p["s_metrics"]), "--spec", str(ROOT / "fleet.yaml"),
        ]  # fmt: skip
        print("starting Triton and the sidecar ...", file=sys.stderr)
        with started(triton, state / "triton.out") as t_proc:
            wait_http(f"http://127.0.0.1:{p['t_http']}/v2/health/ready", t_proc)
            with started(sidecar, state / "sidecar.out") as s_proc:
                wait_http(f"http://127.0.0.1:{p['s_metrics']}/readyz", s_proc)
                subprocess.run(
                    [*INFERWATCH, "fault", "set", "--state-dir", str(state), "--model", "ranker",
                     "--version", "2", "--error-rate", "0.3"],
                    check=True, capture_output=True,
                )  # fmt: skip
                for proto, port in (("http", p["s_http"]), ("grpc", p["s_grpc"])):
                    print(f"sending {proto} traffic for {duration:.0f}s ...", file=sys.stderr)
                    load = [*INFERWATCH, "load", "--url", f"127.0.0.1:{port}", "--protocol", proto,
                            "--rate", "20", "--duration", str(duration), "--json"]  # fmt: skip
                    for m in MODELS:
                        load += ["--model", m]
                    subprocess.run(load, check=True, capture_output=True, timeout=duration + 120)
                # A client error: a model the server does not have.
                missing = f"http://127.0.0.1:{p['s_http']}/v2/models/no_such_model/infer"
                for _ in range(3):
                    httpx.post(missing, json={}, timeout=5)
                out["sidecar"] = count(series(f"http://127.0.0.1:{p['s_metrics']}/metrics"))
                out["sidecar"]["rss_mib"] = rss_mib(s_proc)
                out["triton"] = count(series(f"http://127.0.0.1:{p['t_metrics']}/metrics"))
        for gpus in (1, 8, 64):
            port = free_port()
            exporter = [*INFERWATCH, "gpu-exporter", "--host", "127.0.0.1", "--port", str(port),
                        "--backend", "simulated", "--gpus", str(gpus)]  # fmt: skip
            with started(exporter, state / f"exporter-{gpus}.out") as e_proc:
                wait_http(f"http://127.0.0.1:{port}/healthz", e_proc)
                for _ in range(5):  # a few scrapes, as Prometheus would, before reading memory
                    samples = series(f"http://127.0.0.1:{port}/metrics")
                    time.sleep(0.2)
                per_gpu = Counter(labels["gpu"] for _, _, labels in samples if "gpu" in labels)
                out[f"gpu_exporter_{gpus}"] = {
                    **count(samples),
                    "with_gpu_label": sum(per_gpu.values()),
                    "rss_mib": rss_mib(e_proc),
                }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=8.0, help="seconds of traffic per protocol")
    parser.add_argument("--json", action="store_true", help="print the full counts as JSON")
    args = parser.parse_args()
    result = measure(args.duration)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return 0
    for name, data in result.items():
        rss = f", {data['rss_mib']} MiB resident" if "rss_mib" in data else ""
        print(f"{name}: {data['total']} series{rss}")
        for fam, n in data["by_family"].items():
            print(f"  {fam}: {n}")
        if data["by_model"]:
            print(f"  by model label: {data['by_model']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
