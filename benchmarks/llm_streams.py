"""LLM streams: direct vs through ``inferwatch sidecar`` vs through nginx, side by side in one run.

Two parts, each with its own server, sidecar and nginx:

- **vLLM** (``inferwatch vllm``: the real vLLM on the tiny local model): 128-token streaming chat
  completions (``ignore_eos``, so every stream has the asked length) at 8 and 32 concurrent
  streams. Reported: output tokens/s and its ratio to direct, client-side TTFT and inter-token
  P50/P99, and the proxy's CPU-seconds per 1,000 streamed tokens (sidecar against nginx). vLLM
  computes on the same 2 cores as the client and the proxies, so its latency moves by more than
  a millisecond from round to round (calibrated here: two interleaved 15 s rounds through nginx
  differed by +-15%):
  tokens/s and CPU per token are this part's figures.
- **Triton** (``tiny_stream`` version 1 on Triton's ``generate_stream``): a decoupled model that
  sleeps a fixed time to the first token and between tokens (set here through the fault file,
  as ``inferwatch fault set --ttft-ms --per-token-ms`` does), so the engine costs almost no CPU
  and what a proxy adds to TTFT and to the gaps stands out against a known pace: at 1, 8 and 32
  streams.

Load is closed loop (N streams, each sending its next request when its stream ends) from
``reference_server/stream_load.py``, the client behind ``inferwatch load --protocol openai`` and
``--protocol triton-generate``, run in this process: the same requests and the same client-side
TTFT (request start to the first event with generated text; vLLM's role-only first event does
not count) and inter-token gaps as the CLI reports, with the per-round figures kept here. Every
measurement cell is run once per round, the three targets one after another in an order that
rotates each round, so the machine's noise falls on all three alike; figures are medians over
rounds, and "added" is proxy minus direct within a round, then the median (with the spread). The
proxy's CPU is user + system time from /proc (nginx: master and worker; one worker, keep-alive to
the upstream, ``proxy_buffering off`` as SSE needs). At the end the sidecar's own count of
generated tokens (``contract.TOKENS_TOTAL``) is held against the tokens the client received
through it.

Usage (one command; about 15 minutes at the defaults, 2 with --quick):

    .venv/bin/python benchmarks/llm_streams.py [--quick] [--parts vllm triton] [--rounds 3]
        [--duration 15] [--streams 8 32] [--triton-streams 1 8 32] [--ttft-ms 20]
        [--per-token-ms 10] [--json out.json]

Needs nginx (``scripts/bootstrap --bench``) and vLLM's environment (``scripts/bootstrap``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from nginx import binary as nginx_binary  # noqa: E402
from nginx import write_conf as write_nginx_conf  # noqa: E402
from procstat import cpu_seconds, memory_kib  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from inferwatch import contract  # noqa: E402
from inferwatch.net import free_port  # noqa: E402

TARGETS = ("direct", "sidecar", "nginx")
PROMPT_WORDS = "32"


class BenchError(Exception):
    """A server would not start; one line for the user."""


def log(msg: str) -> None:
    print(f"llm_streams: {msg}", file=sys.stderr, flush=True)


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def wait_http(url: str, proc: subprocess.Popen, timeout: float, what: str, log_path: Path, ok=(200,)) -> None:
    """Poll ``url`` until it answers with a status in ``ok`` (any status: ``ok=None``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"{what} exited with code {proc.returncode} before ready: {last_line(log_path)}")
        try:
            status = httpx.get(url, timeout=2.0).status_code
            if ok is None or status in ok:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise BenchError(f"{what} not ready after {timeout:g}s: {last_line(log_path)}")


def last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        lines = []
    return f"{(lines or ['no output'])[-1][:300]} (log: {path})"


class Procs:
    """Processes this run starts, each in its own group; ``stop_all`` ends them in reverse order."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, cmd: list[str]) -> tuple[subprocess.Popen, Path]:
        path = self.work / f"{name}.log"
        with open(path, "wb") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self.procs.append(proc)
        return proc, path

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        for proc in reversed(self.procs):
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()


def start_sidecar(procs: Procs, name: str, upstream_http: str, upstream_grpc: str | None) -> dict:
    port, metrics = free_port(), free_port()
    grpc = ["--upstream-grpc", upstream_grpc, "--grpc-port", str(free_port())] if upstream_grpc else None
    proc, path = procs.start(
        name,
        [
            str(ROOT / ".venv" / "bin" / "inferwatch"),
            "sidecar",
            "--upstream-http",
            upstream_http,
            # In front of vLLM as sidecar/README.md runs it (no gRPC side); in front of Triton as
            # deployed there (the gRPC proxy runs too, idle here).
            *(grpc or ["--upstream-grpc", "127.0.0.1:1", "--grpc-port", "0"]),
            "--host",
            "127.0.0.1",
            "--http-port",
            str(port),
            "--metrics-port",
            str(metrics),
            "--spec",
            str(ROOT / "fleet.yaml"),
        ],
    )
    wait_http(f"http://127.0.0.1:{metrics}/readyz", proc, 60, "the sidecar", path)
    return {"port": port, "metrics": f"http://127.0.0.1:{metrics}/metrics", "pids": [proc.pid]}


def start_nginx(procs: Procs, name: str, upstream: str) -> dict:
    port = free_port()
    folder = procs.work / name
    folder.mkdir()
    conf = write_nginx_conf(folder, upstream, port, streaming=True)
    proc, path = procs.start(name, [str(nginx_binary()), "-c", str(conf), "-p", str(folder)])
    # Any answer but nginx's own 502 means it listens and reaches the upstream.
    wait_http(f"http://127.0.0.1:{port}/", proc, 15, "nginx", path, ok=range(200, 502))
    return {"port": port, "pids": [proc.pid, *children(proc.pid)]}


def tokens_counted(metrics_url: str) -> float:
    """The sidecar's own count of generated tokens (every model, every protocol)."""
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(metrics_url, timeout=10).text):
        for s in family.samples:
            if (
                s.name == contract.TOKENS_TOTAL.name
                and s.labels.get(contract.L_TOKEN_TYPE) == contract.TOKEN_GENERATION
            ):
                total += s.value
    return total


def stream_run(
    port: int, protocol: str, model: str, streams: int, tokens: int, duration: float, pids: list[int]
) -> dict:
    """One closed-loop run of ``streams`` concurrent streams for ``duration`` seconds."""
    from reference_server.loadgen import LoadConfig, Target
    from reference_server.stream_load import StreamLoadGenerator

    gen = StreamLoadGenerator(
        LoadConfig(
            url=f"127.0.0.1:{port}",
            protocol=protocol,  # type: ignore[arg-type]
            targets=[Target.parse(model, protocol)],
            concurrency=streams,
            duration=duration,
            prompt_tokens=PROMPT_WORDS,
            output_tokens=str(tokens),
            ignore_eos=protocol == "openai",
            timeout=120.0,
            seed=streams,
        )
    )
    c0 = cpu_seconds(pids)
    s = gen.run()
    cpu = cpu_seconds(pids) - c0
    ttft, gaps = s.ttft_s or {}, s.inter_token_s or {}
    return {
        "tokens": s.generation_tokens,
        "tokens_per_s": s.generation_tokens_per_s,
        "streams_ok": s.ok,
        "errors": sum(s.errors.values()),
        "error_kinds": s.errors,
        "ttft_p50_ms": ttft.get("p50", 0.0) * 1e3,
        "ttft_p99_ms": ttft.get("p99", 0.0) * 1e3,
        "itl_p50_ms": gaps.get("p50", 0.0) * 1e3,
        "itl_p99_ms": gaps.get("p99", 0.0) * 1e3,
        "cpu_s": cpu,
        "cpu_per_1k_tokens": 1000 * cpu / max(s.generation_tokens, 1) if pids else None,
    }


def run_part(
    name: str,
    targets: dict[str, dict],
    protocol: str,
    model: str,
    streams_list: list[int],
    tokens: int,
    args: argparse.Namespace,
    on_tokens: Callable[[str, int], None],
) -> dict:
    """Warm up, then ``args.rounds`` interleaved rounds of every (streams, target) cell."""
    log(f"{name}: warming up")
    for n in streams_list:
        for t in TARGETS:
            r = stream_run(targets[t]["port"], protocol, model, n, tokens, args.warmup, [])
            on_tokens(t, r["tokens"])
    runs: dict[int, dict[str, list[dict]]] = {n: {t: [] for t in TARGETS} for n in streams_list}
    for rnd in range(args.rounds):
        order = TARGETS[rnd % 3 :] + TARGETS[: rnd % 3]
        for n in streams_list:
            for t in order:
                log(f"{name}: round {rnd + 1}/{args.rounds}, {n} streams -> {t}")
                r = stream_run(
                    targets[t]["port"], protocol, model, n, tokens, args.duration, targets[t]["pids"]
                )
                on_tokens(t, r["tokens"])
                runs[n][t].append(r)
    return {"cells": {n: summarize(cell) for n, cell in runs.items()}, "runs": runs}


def summarize(cell: dict[str, list[dict]]) -> dict:
    """Medians over rounds; ratios and added latency taken within each round first."""
    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    d = cell["direct"]
    out: dict = {}
    for t, rs in cell.items():
        row = {
            k: med(rs, k) for k in ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
        }
        row["tokens_per_s_all"] = [round(r["tokens_per_s"]) for r in rs]
        row["errors"] = sum(r["errors"] for r in rs)
        row["streams_ok"] = sum(r["streams_ok"] for r in rs)
        if t != "direct":
            row["cpu_per_1k_tokens"] = med(rs, "cpu_per_1k_tokens")
            ratios = [r["tokens_per_s"] / max(x["tokens_per_s"], 1e-9) for r, x in zip(rs, d, strict=True)]
            row["vs_direct"] = statistics.median(ratios)
            row["vs_direct_all"] = [round(v, 2) for v in ratios]
            for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"):
                added = [r[k] - x[k] for r, x in zip(rs, d, strict=True)]
                row[f"added_{k}"] = statistics.median(added)
                row[f"added_{k}_range"] = [min(added), max(added)]
        out[t] = row
    s, n = cell["sidecar"], cell["nginx"]
    out["cpu_ratio"] = statistics.median(
        r["cpu_per_1k_tokens"] / max(x["cpu_per_1k_tokens"], 1e-9) for r, x in zip(s, n, strict=True)
    )
    return out


def part_vllm(procs: Procs, args: argparse.Namespace) -> dict:
    port = free_port()
    proc, path = procs.start(
        "vllm",
        [
            str(ROOT / ".venv" / "bin" / "inferwatch"),
            "vllm",
            "--port",
            str(port),
            "--log-file",
            str(procs.work / "vllm-server.log"),
        ],
    )
    log("vllm: starting vLLM (35 to 90 s)")
    t0 = time.monotonic()
    wait_http(f"http://127.0.0.1:{port}/v1/models", proc, 300, "vLLM (inferwatch vllm)", path)
    log(f"vllm: ready in {time.monotonic() - t0:.0f} s")
    upstream = f"127.0.0.1:{port}"
    targets = {
        "direct": {"port": port, "pids": []},
        "sidecar": start_sidecar(procs, "sidecar-vllm", upstream, None),
        "nginx": start_nginx(procs, "nginx-vllm", upstream),
    }
    return measure_part("vllm", targets, "openai", "tiny-llm", args.streams, args.tokens, args)


def part_triton(procs: Procs, args: argparse.Namespace) -> dict:
    from reference_server import faults
    from reference_server.launcher import TritonServer

    state = procs.work / "triton-state"
    triton = TritonServer(
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
        state_dir_path=state,
        extra_args=("--model-control-mode=explicit", "--load-model=tiny_stream"),
    )
    log("triton: starting Triton with tiny_stream")
    triton.start()
    try:
        # The pace, as `inferwatch fault set --model tiny_stream --version 1 --ttft-ms --per-token-ms`.
        faults.set_fault(
            "tiny_stream", "1", ttft_ms=args.ttft_ms, per_token_ms=args.per_token_ms, state_dir=state
        )
        targets = {
            "direct": {"port": triton.http_port, "pids": []},
            "sidecar": start_sidecar(procs, "sidecar-triton", triton.http_url, triton.grpc_url),
            "nginx": start_nginx(procs, "nginx-triton", triton.http_url),
        }
        return measure_part(
            "triton",
            targets,
            "triton-generate",
            "tiny_stream:1",
            args.triton_streams,
            args.triton_tokens,
            args,
        )
    finally:
        procs.stop_all()
        triton.stop()


def measure_part(
    name: str,
    targets: dict[str, dict],
    protocol: str,
    model: str,
    streams: list[int],
    tokens: int,
    args: argparse.Namespace,
) -> dict:
    through: dict[str, int] = dict.fromkeys(TARGETS, 0)

    def on_tokens(target: str, n: int) -> None:
        through[target] += n

    out = run_part(name, targets, protocol, model, streams, tokens, args, on_tokens)
    out["sidecar_counted_tokens"] = tokens_counted(targets["sidecar"]["metrics"])
    out["client_tokens_through_sidecar"] = through["sidecar"]
    out["rss_mib"] = {
        t: memory_kib(targets[t]["pids"], "VmRSS") / 1024 for t in ("sidecar", "nginx") if targets[t]["pids"]
    }
    return out


def fmt_range(lo_hi: list[float], digits: int = 2) -> str:
    return f"{lo_hi[0]:+.{digits}f}..{lo_hi[1]:+.{digits}f}"


def report(results: dict, args: argparse.Namespace) -> str:
    lines: list[str] = []
    meta = results["meta"]
    lines.append(
        f"Run {meta['started']} (commit {meta['commit']}), {meta['cpus']} CPUs, load average "
        f"{meta['load_before']:.1f} before and {meta['load_after']:.1f} after; "
        f"{args.rounds} interleaved round(s) of {args.duration:g} s per cell."
    )
    if "vllm" in results:
        v = results["vllm"]
        lines += [
            "",
            f"vLLM (`tiny-llm`), streaming chat completions of {args.tokens} tokens "
            f"(prompt about {PROMPT_WORDS} tokens), closed loop; medians over rounds, each round's "
            "tokens/s in brackets; latency in ms, client-side:",
            "",
            "| streams | target | tokens/s | vs direct | TTFT P50 | TTFT P99 | inter-token P50 "
            "| inter-token P99 | proxy CPU-s / 1k tokens | errors |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for n, cell in v["cells"].items():
            for t in TARGETS:
                r = cell[t]
                vs = "1.00" if t == "direct" else f"{r['vs_direct']:.2f} {r['vs_direct_all']}"
                cpu = "-" if t == "direct" else f"{r['cpu_per_1k_tokens']:.4f}"
                lines.append(
                    f"| {n} | {t} | {r['tokens_per_s']:.0f} {r['tokens_per_s_all']} | {vs} "
                    f"| {r['ttft_p50_ms']:.2f} | {r['ttft_p99_ms']:.2f} | {r['itl_p50_ms']:.3f} "
                    f"| {r['itl_p99_ms']:.2f} | {cpu} | {r['errors']} |"
                )
        lines.append("")
        for n, cell in v["cells"].items():
            lines.append(
                f"- {n} streams: sidecar CPU per 1k tokens = {cell['cpu_ratio']:.2f}x nginx's; added "
                f"TTFT P99 sidecar {cell['sidecar']['added_ttft_p99_ms']:+.2f} ms "
                f"({fmt_range(cell['sidecar']['added_ttft_p99_ms_range'])}), nginx "
                f"{cell['nginx']['added_ttft_p99_ms']:+.2f} ms "
                f"({fmt_range(cell['nginx']['added_ttft_p99_ms_range'])}); added inter-token P50 "
                f"sidecar {cell['sidecar']['added_itl_p50_ms']:+.3f} ms, nginx "
                f"{cell['nginx']['added_itl_p50_ms']:+.3f} ms"
            )
        lines.append(
            f"- the sidecar counted {v['sidecar_counted_tokens']:.0f} generated tokens; the client "
            f"received {v['client_tokens_through_sidecar']} through it"
        )
    if "triton" in results:
        tr = results["triton"]
        lines += [
            "",
            f"Triton `tiny_stream` v1 over `generate_stream`, {args.triton_tokens} tokens per stream at a "
            f"fixed pace (first token after {args.ttft_ms:g} ms, then one every {args.per_token_ms:g} ms); "
            "closed loop; latency in ms, client-side; added = proxy minus direct within a round, median "
            "over rounds (min..max):",
            "",
            "| streams | target | tokens/s | TTFT P50 | TTFT P99 | added TTFT P50 | added TTFT P99 "
            "| inter-token P50 | inter-token P99 | added inter-token P50 | added inter-token P99 "
            "| proxy CPU-s / 1k tokens | errors |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for n, cell in tr["cells"].items():
            for t in TARGETS:
                r = cell[t]
                if t == "direct":
                    added = ["-"] * 4
                    cpu = "-"
                else:
                    added = [
                        f"{r['added_ttft_p50_ms']:+.2f} ({fmt_range(r['added_ttft_p50_ms_range'])})",
                        f"{r['added_ttft_p99_ms']:+.2f} ({fmt_range(r['added_ttft_p99_ms_range'])})",
                        f"{r['added_itl_p50_ms']:+.3f} ({fmt_range(r['added_itl_p50_ms_range'], 3)})",
                        f"{r['added_itl_p99_ms']:+.2f} ({fmt_range(r['added_itl_p99_ms_range'])})",
                    ]
                    cpu = f"{r['cpu_per_1k_tokens']:.4f}"
                lines.append(
                    f"| {n} | {t} | {r['tokens_per_s']:.0f} "
                    f"| {r['ttft_p50_ms']:.2f} | {r['ttft_p99_ms']:.2f} "
                    f"| {added[0]} | {added[1]} | {r['itl_p50_ms']:.3f} | {r['itl_p99_ms']:.2f} "
                    f"| {added[2]} | {added[3]} | {cpu} | {r['errors']} |"
                )
        lines.append("")
        for n, cell in tr["cells"].items():
            lines.append(f"- {n} streams: sidecar CPU per 1k tokens = {cell['cpu_ratio']:.2f}x nginx's")
        lines.append(
            f"- the sidecar counted {tr['sidecar_counted_tokens']:.0f} generated tokens; the client "
            f"received {tr['client_tokens_through_sidecar']} through it"
        )
    rss = {p: results[p]["rss_mib"] for p in ("vllm", "triton") if p in results}
    if rss:
        lines.append(
            "- resident memory at the end: "
            + "; ".join(
                f"{p}: " + ", ".join(f"{t} {mib:.1f} MiB" for t, mib in m.items()) for p, m in rss.items()
            )
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short smoke run: 1 round of 2 s, 8 streams")
    ap.add_argument("--parts", nargs="+", choices=("vllm", "triton"), default=["vllm", "triton"])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds per cell and round (default 15)")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of warm-up per cell (default 3)")
    ap.add_argument("--streams", type=int, nargs="+", default=[8, 32], help="vLLM: concurrent streams")
    ap.add_argument("--tokens", type=int, default=128, help="vLLM: tokens per stream (default 128)")
    ap.add_argument("--triton-streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--triton-tokens", type=int, default=64, help="Triton: tokens per stream (default 64)")
    ap.add_argument("--ttft-ms", type=float, default=20.0, help="Triton: time to the first token")
    ap.add_argument("--per-token-ms", type=float, default=10.0, help="Triton: time between tokens")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.duration, args.warmup = 1, 2.0, 1.0
        args.streams, args.triton_streams, args.triton_tokens = [8], [8], 16
    problems = [
        f"--{k.replace('_', '-')} must be positive"
        for k in ("rounds", "duration", "warmup", "tokens", "triton_tokens", "ttft_ms", "per_token_ms")
        if not getattr(args, k) > 0
    ] + [
        "--streams and --triton-streams must be between 1 and 1000"
        for n in args.streams + args.triton_streams
        if not 1 <= n <= 1000
    ][:1]
    if problems:
        ap.error(problems[0])
    if nginx_binary() is None:
        print(
            "llm_streams: error: nginx is not installed (scripts/bootstrap --bench installs it)",
            file=sys.stderr,
        )
        return 1

    from reference_server.launcher import LauncherError

    work = Path(tempfile.mkdtemp(prefix="iw-llm-streams-"))
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    results: dict = {
        "meta": {
            "started": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": commit or "unknown",
            "cpus": os.cpu_count(),
            "load_before": os.getloadavg()[0],
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        }
    }
    procs = Procs(work)
    try:
        # Triton first: it starts in seconds, so a broken setup shows before vLLM's long start.
        if "triton" in args.parts:
            results["triton"] = part_triton(procs, args)
        if "vllm" in args.parts:
            results["vllm"] = part_vllm(procs, args)
    except (BenchError, LauncherError) as exc:
        print(f"llm_streams: error: {exc}", file=sys.stderr)
        return 1
    finally:
        procs.stop_all()
    results["meta"]["load_after"] = os.getloadavg()[0]
    print(report(results, args))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, sort_keys=True, default=str) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
