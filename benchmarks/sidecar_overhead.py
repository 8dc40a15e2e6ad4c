"""Sidecar overhead: Triton direct vs through ``inferwatch sidecar`` vs through nginx, in one run.

Starts a real Triton (the reference ``ranker`` model; version 1 is a small JSON inference of
512 floats), the sidecar in front of it, and the Debian nginx configured as a plain reverse
proxy (one worker, keep-alive to the upstream: what a team would put there otherwise). Load
comes from ``wrk`` (C, cheaper than what it measures) with a Lua script:

- fixed open-loop rates (default 200, 500, 1000 requests/s): each connection waits an
  exponentially distributed time (mean: connections / rate) before each request, so the
  merged arrivals are a Poisson stream at the rate, wrk2-style; enough connections that a
  connection's mean gap (50 ms) is far above the latency, so a slow answer barely delays
  the schedule. Reported: P50/P99 per target and what each proxy adds against direct.
- maximum throughput: closed loop, 8 connections (the setting of the nginx and aiohttp-proxy
  reference points the sidecar was designed against).
- the proxy's CPU-seconds per 1,000 requests (utime + stime from /proc, every process of
  the proxy) and its resident memory (VmRSS at the end, VmHWM peak).

Usage (one command; about 7 minutes at the defaults):

    .venv/bin/python benchmarks/sidecar_overhead.py [--duration 8] [--rates 200 500 1000]
        [--repeat 3] [--json out.json]

Needs wrk and nginx (`scripts/bootstrap --bench` installs them). The machine is shared and
noisy: read the ratios measured side by side in one run.

A/B against an older sidecar (``--baseline-tree``): a second sidecar, run from another checkout
with this virtual environment, is one more target ("baseline") in the same interleaved rounds,
so old and new code are compared under the same load and drift:

    git worktree add /tmp/iw-base <commit>
    .venv/bin/python benchmarks/sidecar_overhead.py --baseline-tree /tmp/iw-base
    git worktree remove /tmp/iw-base
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nginx import binary as nginx_binary
from nginx import write_conf as write_nginx_conf
from procstat import cpu_seconds, memory_kib

from inferwatch.net import free_port

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PATH = "/v2/models/ranker/versions/1/infer"
MEAN_GAP_S = 0.05  # per-connection mean gap at the fixed rates
MAX_CONNECTIONS = 8

LUA = r"""
local f = assert(io.open(os.getenv("IW_BODY"), "rb")); local body = f:read("*a"); f:close()
wrk.method = "POST"; wrk.body = body; wrk.headers["Content-Type"] = "application/json"
local mean_ms = tonumber(os.getenv("IW_MEAN_MS") or "0")
math.randomseed(os.time())
if mean_ms > 0 then
  function delay() return -math.log(1 - math.random()) * mean_ms end
end
function done(s, lat, req)
  local e = s.errors
  io.write(string.format(
    'IWRESULT {"requests":%d,"duration_us":%d,"connect":%d,"read":%d,"write":%d,"timeout":%d,"non2xx":%d,'
    .. '"p50_us":%d,"p90_us":%d,"p99_us":%d,"p999_us":%d,"max_us":%d,"mean_us":%.1f}\n',
    s.requests, s.duration, e.connect, e.read, e.write, e.timeout, e.status,
    lat:percentile(50), lat:percentile(90), lat:percentile(99), lat:percentile(99.9), lat.max, lat.mean))
end
"""


def start_sidecar(work: Path, name: str, http: str, grpc: str, tree: Path | None = None) -> tuple:
    """A sidecar in front of Triton: (process, HTTP port, log file). ``tree``: another checkout whose own
    code runs (``python -m sidecar`` from it, with its fleet.yaml), with this virtual environment."""
    port = free_port()
    if tree is None:
        cmd, cwd, env = [str(ROOT / ".venv" / "bin" / "inferwatch"), "sidecar"], None, None
        spec = ROOT / "fleet.yaml"
    else:
        cmd, cwd = [str(ROOT / ".venv" / "bin" / "python"), "-m", "sidecar"], tree
        env = {**os.environ, "PYTHONPATH": str(tree)}  # before the venv's editable install of this tree
        spec = tree / "fleet.yaml"
    args = ["--upstream-http", http, "--upstream-grpc", grpc, "--host", "127.0.0.1", "--http-port", str(port)]
    # As deployed: the gRPC proxy runs too (its memory counts).
    args += ["--grpc-port", str(free_port()), "--metrics-port", str(free_port()), "--spec", str(spec)]
    log = work / f"{name}.log"
    proc = subprocess.Popen(cmd + args, cwd=cwd, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    return proc, port, log


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def wait_port(
    port: int, timeout: float = 30.0, proc: subprocess.Popen | None = None, log: Path | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{' '.join(map(str, proc.args[:3]))} exited ({proc.returncode}): see {log}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def wrk(port: int, duration: float, connections: int, env: dict[str, str], lua: Path) -> dict:
    cmd = [
        "wrk",
        "-t1",
        f"-c{connections}",
        f"-d{int(duration)}s",
        "--timeout",
        "10s",
        "-s",
        str(lua),
        f"http://127.0.0.1:{port}{PATH}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("IWRESULT "))
    res = json.loads(line.split(" ", 1)[1])
    res["errors"] = res["connect"] + res["read"] + res["write"] + res["timeout"] + res["non2xx"]
    res["rps"] = res["requests"] / (res["duration_us"] / 1e6)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__[__doc__.index("A/B against") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--duration", type=float, default=8.0, help="seconds per measurement (default 8)")
    ap.add_argument(
        "--rates", type=int, nargs="+", default=[200, 500, 1000], help="open-loop rates, requests/s"
    )
    ap.add_argument("--repeat", type=int, default=3, help="interleaved repetitions; medians are reported")
    ap.add_argument("--json", type=Path, help="also write the raw figures here")
    ap.add_argument(
        "--baseline-tree",
        type=Path,
        metavar="DIR",
        help="also measure the sidecar of this checkout (e.g. a git worktree of an older commit), "
        "interleaved as the target 'baseline'",
    )
    args = ap.parse_args()
    if args.duration < 1 or args.repeat < 1 or any(r < 1 for r in args.rates):
        ap.error("--duration, --repeat and --rates must be at least 1")
    if args.baseline_tree is not None:
        args.baseline_tree = args.baseline_tree.resolve()
        if not (args.baseline_tree / "sidecar" / "__main__.py").is_file():
            ap.error(f"--baseline-tree {args.baseline_tree}: no sidecar/__main__.py there (not a checkout)")
    for tool in ("wrk", "nginx"):
        if not shutil.which(tool) and not Path(f"/usr/sbin/{tool}").exists():
            print(
                f"sidecar_overhead: error: {tool} is not installed (scripts/bootstrap --bench installs it)",
                file=sys.stderr,
            )
            return 1

    from reference_server.catalog import example_input
    from reference_server.launcher import TritonServer

    work = Path(tempfile.mkdtemp(prefix="iw-overhead-"))
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
    (work / "body.json").write_text(json.dumps(body))
    lua = work / "post.lua"
    lua.write_text(LUA)

    procs: list[subprocess.Popen] = []
    triton = TritonServer(
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
        state_dir_path=work / "triton",
        extra_args=("--model-control-mode=explicit", "--load-model=ranker"),
    )
    print("starting Triton ...", file=sys.stderr, flush=True)
    triton.start()
    try:
        upstream = triton.http_url
        sidecar, sc_port, sc_log = start_sidecar(work, "sidecar", upstream, triton.grpc_url)
        procs.append(sidecar)
        baseline = None
        if args.baseline_tree is not None:
            baseline, bl_port, bl_log = start_sidecar(
                work, "baseline", upstream, triton.grpc_url, args.baseline_tree
            )
            procs.append(baseline)  # before nginx: the last process is nginx (SIGQUIT below)
        ng_port = free_port()
        (work / "nginx").mkdir()
        conf = write_nginx_conf(work / "nginx", upstream, ng_port, max_body="64m")
        nginx = subprocess.Popen(
            [str(nginx_binary()), "-c", str(conf), "-p", str(work / "nginx")],
            stdout=open(work / "nginx.log", "wb"),
            stderr=subprocess.STDOUT,
        )
        procs.append(nginx)
        wait_port(sc_port, proc=sidecar, log=sc_log)
        if baseline is not None:
            wait_port(bl_port, proc=baseline, log=bl_log)
        wait_port(ng_port)
        time.sleep(1.0)
        targets = {
            "direct": (int(upstream.rsplit(":", 1)[1]), []),
            "sidecar": (sc_port, [sidecar.pid]),
        }
        if baseline is not None:  # right after the sidecar: the two see the closest conditions
            targets["baseline"] = (bl_port, [baseline.pid])
        targets["nginx"] = (ng_port, [nginx.pid, *children(nginx.pid)])
        env_base = {"IW_BODY": str(work / "body.json")}
        print("warming up ...", file=sys.stderr, flush=True)
        for port, _ in targets.values():
            wrk(port, 3, MAX_CONNECTIONS, {**env_base, "IW_MEAN_MS": "0"}, lua)

        runs: dict = {"rates": {}, "max": {}}
        for rep in range(args.repeat):
            for rate in args.rates:
                conns = max(4, round(rate * MEAN_GAP_S))
                mean_ms = conns / rate * 1000.0
                for name, (port, pids) in targets.items():
                    print(
                        f"[{rep + 1}/{args.repeat}] open loop {rate}/s -> {name}", file=sys.stderr, flush=True
                    )
                    c0 = cpu_seconds(pids)
                    res = wrk(port, args.duration, conns, {**env_base, "IW_MEAN_MS": f"{mean_ms:.3f}"}, lua)
                    res["cpu_s"] = cpu_seconds(pids) - c0
                    runs["rates"].setdefault(rate, {}).setdefault(name, []).append(res)
            for name, (port, pids) in targets.items():
                print(f"[{rep + 1}/{args.repeat}] max throughput -> {name}", file=sys.stderr, flush=True)
                c0 = cpu_seconds(pids)
                res = wrk(port, args.duration, MAX_CONNECTIONS, {**env_base, "IW_MEAN_MS": "0"}, lua)
                res["cpu_s"] = cpu_seconds(pids) - c0
                res["rss_kib"] = memory_kib(pids, "VmRSS")
                res["hwm_kib"] = memory_kib(pids, "VmHWM")
                runs["max"].setdefault(name, []).append(res)
        results = {
            "rates": {
                rate: {n: median(rs) for n, rs in cell.items()} for rate, cell in runs["rates"].items()
            },
            "max": {n: median(rs) for n, rs in runs["max"].items()},
            "runs": runs,
        }
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM if p is not procs[-1] else signal.SIGQUIT)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        triton.stop()

    print(report(results, args))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


def median(runs: list[dict]) -> dict:
    """Per-field median over repeated runs (CPU per 1,000 requests is taken per run first)."""
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["cpu_per_1k"] = statistics.median(1000 * r["cpu_s"] / max(r["requests"], 1) for r in runs)
    out["rps_all"] = [round(r["rps"]) for r in runs]
    return out


def report(results: dict, args: argparse.Namespace) -> str:
    ms = lambda us: f"{us / 1000:.2f}"  # noqa: E731
    lines = [
        f"Open loop (median of {args.repeat} interleaved runs of {args.duration:g} s per cell; "
        "latency in ms; added = proxy minus direct at the same rate):",
        "",
        "| rate/s | achieved direct / sidecar / nginx | P50 direct | P50 sidecar (added) "
        "| P50 nginx (added) | P99 direct | P99 sidecar (added) | P99 nginx (added) "
        "| sidecar CPU-s/1k req | nginx CPU-s/1k req | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for rate, cell in results["rates"].items():
        d, s, n = cell["direct"], cell["sidecar"], cell["nginx"]
        lines.append(
            f"| {rate} | {d['rps']:.0f} / {s['rps']:.0f} / {n['rps']:.0f} "
            f"| {ms(d['p50_us'])} | {ms(s['p50_us'])} ({ms(s['p50_us'] - d['p50_us'])}) "
            f"| {ms(n['p50_us'])} ({ms(n['p50_us'] - d['p50_us'])}) "
            f"| {ms(d['p99_us'])} | {ms(s['p99_us'])} ({ms(s['p99_us'] - d['p99_us'])}) "
            f"| {ms(n['p99_us'])} ({ms(n['p99_us'] - d['p99_us'])}) "
            f"| {s['cpu_per_1k']:.3f} | {n['cpu_per_1k']:.3f} "
            f"| {d['errors']}/{s['errors']}/{n['errors']} |"
        )
    m = results["max"]
    lines += [
        "",
        f"Maximum throughput (closed loop, {MAX_CONNECTIONS} connections, median of {args.repeat} runs "
        f"of {args.duration:g} s; each run's requests/s in brackets):",
        "",
        "| target | requests/s | vs direct | P50 ms | P99 ms | proxy CPU-s/1k req "
        "| proxy RSS MB (peak) | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in m:
        r = m[name]
        cpu = "-" if name == "direct" else f"{r['cpu_per_1k']:.3f}"
        rss = "-" if name == "direct" else f"{r['rss_kib'] / 1024:.1f} ({r['hwm_kib'] / 1024:.1f})"
        lines.append(
            f"| {name} | {r['rps']:.0f} {r['rps_all']} | {r['rps'] / m['direct']['rps']:.2f} "
            f"| {ms(r['p50_us'])} | {ms(r['p99_us'])} "
            f"| {cpu} | {rss} | {r['errors']} |"
        )
    lines.append("")
    lines.append(f"sidecar / nginx throughput at saturation: {m['sidecar']['rps'] / m['nginx']['rps']:.2f}")
    if "baseline" in m:
        lines += [
            "",
            f"A/B: this sidecar against the baseline ({args.baseline_tree}), same rounds "
            "(CPU relative to nginx's in the same cell; added = minus direct):",
            "",
            "| rate/s | CPU-s/1k sidecar / baseline | vs nginx sidecar / baseline "
            "| P50 added sidecar / baseline | P99 added sidecar / baseline | errors |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        cells = [*results["rates"].items(), ("max", m)]
        for rate, cell in cells:
            d, s, b, n = cell["direct"], cell["sidecar"], cell["baseline"], cell["nginx"]
            # nginx's CPU in a short cell can be under one clock tick: no ratio then.
            vs_nginx = lambda r, n=n: f"{r['cpu_per_1k'] / n['cpu_per_1k']:.2f}" if n["cpu_per_1k"] else "-"  # noqa: E731
            lines.append(
                f"| {rate} | {s['cpu_per_1k']:.3f} / {b['cpu_per_1k']:.3f} "
                f"| {vs_nginx(s)} / {vs_nginx(b)} "
                f"| {ms(s['p50_us'] - d['p50_us'])} / {ms(b['p50_us'] - d['p50_us'])} "
                f"| {ms(s['p99_us'] - d['p99_us'])} / {ms(b['p99_us'] - d['p99_us'])} "
                f"| {s['errors']}/{b['errors']} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
