"""gRPC overhead of the sidecar: Triton direct, through ``inferwatch sidecar``, through nginx
(``grpc_pass``, what a team would put there otherwise) and through a bare grpc.aio relay (the
floor of any Python gRPC proxy: the same generic handler with no parsing and no metrics), in one run.

Starts a Triton serving ``ranker`` (a small model, so the proxy's cost is visible) and each proxy
in front of it, then for each target: open-loop ``ModelInfer`` at fixed rates (latency measured
from the intended send time, so a stall cannot hide queued requests), then a closed loop at fixed
concurrency for the maximum throughput. Each proxy's CPU-seconds per 1,000 requests and resident
memory come from /proc. The load generator is a grpc.aio client sending pre-serialized request
bytes (no tritonclient, no per-request protobuf work).

    .venv/bin/python benchmarks/sidecar_grpc.py [--rates 200 500 1000] [--duration 10]
        [--concurrency 8] [--markdown]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import grpc.aio  # noqa: E402
import numpy as np  # noqa: E402
from procstat import cpu_seconds, memory_kib  # noqa: E402
from tritonclient.grpc import service_pb2 as pb  # noqa: E402

from inferwatch.net import free_port  # noqa: E402
from reference_server.catalog import MODELS, example_input  # noqa: E402
from reference_server.launcher import TritonServer  # noqa: E402

NGINX_CONF = """daemon off; worker_processes 1; pid {dir}/nginx.pid; error_log {dir}/nginx.err warn;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {dir}; proxy_temp_path {dir}; fastcgi_temp_path {dir};
  uwsgi_temp_path {dir}; scgi_temp_path {dir};
  server {{ listen 127.0.0.1:{port} http2; location / {{ grpc_pass grpc://{upstream}; }} }}
}}
"""
BARE_RELAY = """
import sys, grpc, grpc.aio, uvloop
async def main():
    channel = grpc.aio.insecure_channel(sys.argv[1])
    def handler(method):
        call = channel.unary_unary(method)
        async def relay(request, context):
            return await call(request)
        return grpc.unary_unary_rpc_method_handler(relay)
    handlers = {}
    class Router(grpc.GenericRpcHandler):
        def service(self, details):
            if details.method not in handlers:
                handlers[details.method] = handler(details.method)
            return handlers[details.method]
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((Router(),))
    server.add_insecure_port("127.0.0.1:" + sys.argv[2])
    await server.start()
    await server.wait_for_termination()
uvloop.run(main())
"""
METHOD = "/inference.GRPCInferenceService/ModelInfer"
MODEL = "ranker"


def request_bytes() -> bytes:
    req = pb.ModelInferRequest(model_name=MODEL, model_version="1")
    for t in MODELS[MODEL].inputs:
        data = example_input(MODEL, seed=0)[t.name]
        req.inputs.add(name=t.name, datatype=t.datatype, shape=list(data.shape))
        req.raw_input_contents.append(data.tobytes())
    return req.SerializeToString()


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) * 1000 if values else float("nan")


async def open_loop(url: str, payload: bytes, rate: float, duration: float) -> dict[str, float]:
    async with grpc.aio.insecure_channel(url) as channel:
        call = channel.unary_unary(METHOD)
        await call(payload, timeout=10)  # connection up before the clock starts
        latencies: list[float] = []
        errors = 0
        loop = asyncio.get_running_loop()

        async def one(intended: float) -> None:
            nonlocal errors
            try:
                await call(payload, timeout=10)
                latencies.append(loop.time() - intended)
            except grpc.RpcError:
                errors += 1

        n = int(rate * duration)
        start = loop.time() + 0.05
        tasks = []
        for i in range(n):
            intended = start + i / rate
            delay = intended - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(intended)))
        await asyncio.gather(*tasks)
        achieved = len(latencies) / max(loop.time() - start, 1e-9)
    return {"p50_ms": pct(latencies, 50), "p99_ms": pct(latencies, 99), "errors": errors, "rps": achieved}


async def closed_loop(url: str, payload: bytes, concurrency: int, duration: float) -> dict[str, float]:
    async with grpc.aio.insecure_channel(url) as channel:
        call = channel.unary_unary(METHOD)
        await call(payload, timeout=10)
        done = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + duration

        async def worker() -> None:
            nonlocal done
            while loop.time() < deadline:
                await call(payload, timeout=10)
                done += 1

        start = loop.time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return {"rps": done / (loop.time() - start), "requests": done}


def measure(url: str, pid: int | None, payload: bytes, args: argparse.Namespace) -> dict[str, dict]:
    out: dict[str, dict] = {}
    asyncio.run(closed_loop(url, payload, 4, 2.0))  # warm-up
    for rate in args.rates:
        before = cpu_seconds([pid]) if pid else 0.0
        res = asyncio.run(open_loop(url, payload, rate, args.duration))
        if pid:
            res["cpu_per_1k"] = (cpu_seconds([pid]) - before) / (rate * args.duration) * 1000
        out[f"rate {rate:g}"] = res
        print(f"  {url} rate {rate:g}/s: {res}", file=sys.stderr)
    before = cpu_seconds([pid]) if pid else 0.0
    res = asyncio.run(closed_loop(url, payload, args.concurrency, args.duration))
    if pid:
        res["cpu_per_1k"] = (cpu_seconds([pid]) - before) / res["requests"] * 1000
        res["rss_mib"] = memory_kib([pid]) / 1024
    out["max"] = res
    print(f"  {url} max: {res}", file=sys.stderr)
    return out


def wait_grpc(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    with grpc.insecure_channel(url) as channel:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                grpc.channel_ready_future(channel).result(timeout=1)
                return
            except grpc.FutureTimeoutError:
                pass
    raise SystemExit(f"nothing answered on {url}")


def start_proxies(triton: TritonServer, tmp: str) -> dict[str, tuple[str, subprocess.Popen]]:
    """name -> (gRPC address, process) for the sidecar, nginx and the bare relay."""
    out = {}
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    # fmt: off
    sidecar = subprocess.Popen(
        [str(ROOT / ".venv" / "bin" / "inferwatch"), "sidecar", "--upstream-http", triton.http_url,
         "--upstream-grpc", triton.grpc_url, "--host", "127.0.0.1", "--http-port", str(http_port),
         "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port), "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    # fmt: on
    out["sidecar"] = (f"127.0.0.1:{grpc_port}", sidecar)
    port = free_port()
    conf = Path(tmp) / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=tmp, port=port, upstream=triton.grpc_url))
    nginx = subprocess.Popen(
        ["nginx", "-c", str(conf), "-e", f"{tmp}/nginx.err"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    out["nginx"] = (f"127.0.0.1:{port}", nginx)
    port = free_port()
    bare = subprocess.Popen(
        [sys.executable, "-c", BARE_RELAY, triton.grpc_url, str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    out["bare grpc.aio relay"] = (f"127.0.0.1:{port}", bare)
    for url, proc in out.values():
        wait_grpc(url, proc)
    return out


def worker_pid(name: str, proc: subprocess.Popen) -> int:
    """The process doing the work: nginx's single worker, else the process itself."""
    if name != "nginx":
        return proc.pid
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    return int(children[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[200, 500, 1000])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per measurement")
    parser.add_argument(
        "--concurrency", type=int, default=8, help="closed-loop concurrency for max throughput"
    )
    args = parser.parse_args()

    payload = request_bytes()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ports = {"http_port": free_port(), "grpc_port": free_port(), "metrics_port": free_port()}
        print("starting Triton (ranker only)...", file=sys.stderr)
        triton = TritonServer(
            **ports, state_dir_path=tmp, extra_args=("--model-control-mode=explicit", "--load-model=ranker")
        ).start()
        proxies = {}
        try:
            proxies = start_proxies(triton, tmp)
            results["direct"] = measure(triton.grpc_url, None, payload, args)
            for name, (url, proc) in proxies.items():
                results[name] = measure(url, worker_pid(name, proc), payload, args)
        finally:
            for _, proc in proxies.values():
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(30)
            triton.stop()

    names = list(results)
    head = "| load | " + " | ".join(f"{n} P50 / P99 ms" for n in names) + " | "
    head += " | ".join(f"{n} CPU-s/1k" for n in names[1:]) + " |"
    rows = [head, "|" + " --- |" * (1 + len(names) + len(names) - 1)]
    for key in results["direct"]:
        if key == "max":
            continue
        lat = " | ".join(f"{results[n][key]['p50_ms']:.2f} / {results[n][key]['p99_ms']:.2f}" for n in names)
        cpu = " | ".join(f"{results[n][key]['cpu_per_1k']:.3f}" for n in names[1:])
        rows.append(f"| {key}/s | {lat} | {cpu} |")
    tput = " | ".join(f"{results[n]['max']['rps']:.0f} req/s" for n in names)
    cpu = " | ".join(f"{results[n]['max']['cpu_per_1k']:.3f}" for n in names[1:])
    rows.append(f"| max, {args.concurrency} in flight | {tput} | {cpu} |")
    rss = ", ".join(f"{n} {results[n]['max']['rss_mib']:.0f} MiB" for n in names[1:])
    rows.append(f"\nResident memory after the run: {rss}.")
    added = "; ".join(
        f"{key}: +{results['sidecar'][key]['p50_ms'] - results['direct'][key]['p50_ms']:.2f} / "
        f"+{results['sidecar'][key]['p99_ms'] - results['direct'][key]['p99_ms']:.2f} ms"
        for key in results["direct"]
        if key != "max"
    )
    rows.append(f"Added by the sidecar (P50 / P99): {added}.")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
