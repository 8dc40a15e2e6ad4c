"""``inferwatch triton``, ``fault``, ``load`` and ``naive-server``: the reference server's commands.

Heavy imports stay inside the command functions so ``inferwatch --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from inferwatch import contract, logs
from inferwatch.cli import CliError

# The launcher is a service like the others: JSON lines on stderr (inferwatch/logs.py).
log = logs.get("inferwatch.triton")


def register(sub: argparse._SubParsersAction) -> None:
    _register_triton(sub)
    _register_fault(sub)
    _register_load(sub)
    _register_naive(sub)


# ---------------------------------------------------------------------------------------
# inferwatch triton
# ---------------------------------------------------------------------------------------
def _register_triton(sub: argparse._SubParsersAction) -> None:
    from reference_server.defaults import TRITON_READY_TIMEOUT

    p = sub.add_parser(
        "triton",
        help="run the bundled Triton reference server in the foreground",
        description=(
            "Start NVIDIA Triton on the reference model repository (dense_batched, dense_unbatched, "
            "dense_int4_batched, dense_int4_unbatched, ranker v1/v2, the token stream tiny_stream "
            "v1/v2), wait until every model is ready, "
            "and keep it running until SIGTERM or "
            "Ctrl-C, which stop it cleanly. Fault injection (inferwatch fault) works on the state "
            "directory given here."
        ),
    )
    p.add_argument("--model-repository", default=None, help="model repository (default: the bundled one)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument(
        "--http-port",
        type=int,
        default=contract.PORTS["triton_http"],
        help="KServe v2 HTTP port (default: %(default)s)",
    )
    p.add_argument(
        "--grpc-port",
        type=int,
        default=contract.PORTS["triton_grpc"],
        help="KServe v2 gRPC port (default: %(default)s)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=contract.PORTS["triton_metrics"],
        help="Prometheus metrics port (default: %(default)s)",
    )
    p.add_argument("--log-file", default=None, help="Triton's log (default: STATE_DIR/triton/triton.log)")
    p.add_argument(
        "--state-dir",
        default=None,
        help="where faults, the backend folder and the log live (default: $INFERWATCH_STATE_DIR "
        "or ~/.local/state/inferwatch)",
    )
    p.add_argument(
        "--tritonserver",
        default=None,
        help="the tritonserver binary (default: $INFERWATCH_TRITONSERVER, PATH, /opt/tritonserver, "
        "then the nvidia-pytriton wheel)",
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=TRITON_READY_TIMEOUT,
        help="seconds to wait for readiness (default: %(default)s)",
    )
    p.set_defaults(func=_triton)


def _triton(args: argparse.Namespace) -> int:
    from reference_server.catalog import MODEL_REPOSITORY
    from reference_server.launcher import LauncherError, TritonServer

    for name in ("http_port", "grpc_port", "metrics_port"):
        if not 0 < getattr(args, name) < 65536:
            raise CliError(f"--{name.replace('_', '-')} must be a port number (1-65535)", 2)
    if args.ready_timeout <= 0:
        raise CliError("--ready-timeout must be above 0 seconds", 2)
    logs.setup(logger="inferwatch")
    server = TritonServer(
        args.model_repository or MODEL_REPOSITORY,
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        state_dir_path=args.state_dir,
        log_file=args.log_file,
        binary=args.tritonserver,
        ready_timeout=args.ready_timeout,
    )
    stopping = False

    def _on_term(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_term)
    log.info("starting triton", model_repository=str(server.model_repository), log=str(server.log_path))
    try:
        server.start()
        log.info(
            "triton ready",
            http=server.http_url,
            grpc=server.grpc_url,
            metrics=server.metrics_url,
            faults=str(server.faults_dir),
            log=str(server.log_path),
        )
        from reference_server import faults

        for target, fault in faults.active(server.state_dir).items():
            # Faults live on across restarts; say so rather than surprise anyone.
            log.warning("fault in effect", target=target, **fault.to_json(), clear="inferwatch fault clear")
        code = server.wait()
        if not stopping:
            raise CliError(f"Triton exited unexpectedly with code {code}; see its log: {server.log_path}")
        return 0
    except LauncherError as exc:
        raise CliError(str(exc)) from None
    except KeyboardInterrupt:
        log.info("stopping triton")
        code = server.stop()
        log.info("triton stopped", exit_code=code)
        return 0
    finally:
        if server.running():
            server.stop()


# ---------------------------------------------------------------------------------------
# inferwatch fault
# ---------------------------------------------------------------------------------------
def _state_dir_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--state-dir",
        default=None,
        help="the state directory the Triton was started with (default: $INFERWATCH_STATE_DIR "
        "or ~/.local/state/inferwatch)",
    )


def _register_fault(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "fault",
        help="inject errors or latency into a running reference model",
        description=(
            "Change a running reference model's behaviour without restarting Triton, for all traffic "
            "from any client. Injected errors are real Triton failures: its request-failure counter "
            "rises and clients get HTTP 500 / gRPC INTERNAL. The token-streaming model (tiny_stream) "
            "also takes a time to first token, a time per token and an error after N tokens, which "
            "ends its streams with an error event (SSE) or an in-band error message (gRPC)."
        ),
    )
    fsub = p.add_subparsers(dest="fault_command", metavar="SUBCOMMAND", required=True)
    s = fsub.add_parser(
        "set",
        help="set (replace) the fault of a model",
        description="Set the fault of a model, or of one version of it (a version's fault wins over "
        "the model-wide one). Replaces what was set for that target before.",
    )
    s.add_argument("--model", required=True, help="model name, e.g. ranker")
    s.add_argument("--version", default=None, help="only this version (default: every version)")
    from reference_server.faults import KNOBS

    for knob in KNOBS:  # one flag per fault kind, from the one table of them
        more = " (streaming models only)" if knob.streaming else ""
        # float for all: a whole-number knob given 2.5 gets the table's one-line error, not argparse's
        s.add_argument(knob.flag, type=float, default=None, help=knob.help + more)
    _state_dir_arg(s)
    s.set_defaults(func=_fault_set)
    c = fsub.add_parser("clear", help="remove faults (all, a model's, or one version's)")
    c.add_argument("--model", default=None, help="only this model (default: every model)")
    c.add_argument("--version", default=None, help="only this version of --model")
    _state_dir_arg(c)
    c.set_defaults(func=_fault_clear)
    ls = fsub.add_parser("list", help="show the faults in effect")
    _state_dir_arg(ls)
    ls.set_defaults(func=_fault_list)


def _fault_set(args: argparse.Namespace) -> int:
    from reference_server import faults

    given = {k.field: getattr(args, k.field) for k in faults.KNOBS if getattr(args, k.field) is not None}
    if not given:
        raise CliError(f"nothing to set: give at least one of {', '.join(k.flag for k in faults.KNOBS)}", 2)
    try:
        path = faults.set_fault(args.model, args.version, state_dir=args.state_dir, **given)
    except faults.FaultError as exc:
        raise CliError(str(exc), 2) from None
    target = f"{args.model} version {args.version}" if args.version else f"{args.model} (every version)"
    print(f"fault set on {target}: {faults.Fault.from_json(given).describe()} ({path})")
    return 0


def _fault_clear(args: argparse.Namespace) -> int:
    from reference_server import faults

    try:
        removed = faults.clear(args.model, args.version, state_dir=args.state_dir)
    except faults.FaultError as exc:
        raise CliError(str(exc), 2) from None
    print(f"cleared {len(removed)} fault(s)" + "".join(f"\n  {p.stem}" for p in removed))
    return 0


def _fault_list(args: argparse.Namespace) -> int:
    from reference_server import faults

    found = faults.active(args.state_dir)
    if not found:
        print(f"no faults in {faults.faults_dir(args.state_dir)}")
    for target, f in found.items():
        print(f"{target}: {f.describe()}")
    return 0


# ---------------------------------------------------------------------------------------
# inferwatch load
# ---------------------------------------------------------------------------------------
def _register_load(sub: argparse._SubParsersAction) -> None:
    from reference_server.defaults import LOAD_PROTOCOLS, VLLM_PORT

    p = sub.add_parser(
        "load",
        help="send inference load (open-loop Poisson rate or closed-loop concurrency)",
        description=(
            "Send KServe v2 inference requests with tritonclient to Triton, the sidecar or the naive "
            "server, or token streams: OpenAI-compatible chat or completions (vLLM) or Triton's "
            "generate_stream, measuring time to first token, time per output token and the gaps "
            "between tokens on the client side. --rate sends Poisson arrivals at that rate whatever "
            "the server does (open loop; latency counts from each request's scheduled time, and the "
            "summary says when the sender could not keep up); --concurrency keeps that many requests "
            "outstanding (closed loop). Ends with sent, ok, errors by status, achieved rate and "
            "P50/P90/P99/max latency (and TTFT, TPOT and token counts for token streams)."
        ),
        epilog="examples: inferwatch load --url 127.0.0.1:8001 --protocol grpc --rate 50 --duration 30 "
        "--model ranker:1=9 --model ranker:2=1;  inferwatch load --protocol openai --rate 4 "
        "--prompt-tokens 16-64 --output-tokens normal:64:16 --model tiny-llm=9 --model tiny-llm-canary=1",
    )
    p.add_argument(
        "--url",
        default=None,
        help=f"HOST:PORT (default: 127.0.0.1:{contract.PORTS['triton_http']} for http and triton-generate, "
        f":{contract.PORTS['triton_grpc']} for grpc, :{VLLM_PORT} for openai)",
    )
    p.add_argument(
        "--protocol",
        choices=LOAD_PROTOCOLS,
        default="http",
        help="KServe v2 tensors (http, grpc), the OpenAI-compatible API (openai) or Triton's "
        "generate endpoints (triton-generate) (default: %(default)s)",
    )
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--rate", type=float, help="open loop: requests per second (Poisson arrivals)")
    mode.add_argument("--concurrency", type=int, help="closed loop: requests kept outstanding")
    p.add_argument("--duration", type=float, default=10.0, help="seconds (default: %(default)s)")
    p.add_argument(
        "--model",
        action="append",
        default=None,
        metavar="NAME[:VERSION][=WEIGHT]",
        help="a model to send to, repeatable for a mix (default: dense_batched; openai: a served name, "
        "default tiny-llm; triton-generate: tiny_stream)",
    )
    p.add_argument("--batch", type=int, default=1, help="rows per request (default: %(default)s)")
    llm = p.add_argument_group("token streams (openai, triton-generate)")
    llm.add_argument(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="one answer per request instead of server-sent events (no TTFT or TPOT then)",
    )
    llm.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default="chat",
        help="openai: /v1/chat/completions or /v1/completions (default: %(default)s)",
    )
    llm.add_argument(
        "--prompt-tokens",
        default="32",
        metavar="N|A-B|normal:MEAN:SD",
        help="prompt length in words (about one token each), fixed, uniform or normal (default: %(default)s)",
    )
    llm.add_argument(
        "--output-tokens",
        default="64",
        metavar="N|A-B|normal:MEAN:SD",
        help="max_tokens of each request, fixed, uniform or normal (default: %(default)s)",
    )
    llm.add_argument(
        "--ignore-eos",
        action="store_true",
        help="openai: ask vLLM to generate max_tokens whatever the model says (vLLM's ignore_eos)",
    )
    p.add_argument(
        "--max-in-flight",
        type=int,
        default=1024,
        help="open loop: outstanding requests beyond which arrivals are skipped and reported "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--timeout", type=float, default=30.0, help="per-request timeout, seconds (default: %(default)s)"
    )
    p.add_argument("--seed", type=int, default=None, help="seed for arrivals and the model mix")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout, no progress")
    p.set_defaults(func=_load)


def _check_reachable(url: str, protocol: str, targets: list) -> None:
    if protocol in ("openai", "triton-generate"):
        from reference_server.loadgen import LoadError
        from reference_server.stream_load import check_served

        try:
            check_served(url, protocol, targets)
        except LoadError as exc:
            raise CliError(str(exc)) from None
        return
    try:
        if protocol == "http":
            import tritonclient.http as client_mod

            live = client_mod.InferenceServerClient(url, connection_timeout=5.0).is_server_live()
        else:
            import tritonclient.grpc as client_mod

            live = client_mod.InferenceServerClient(url).is_server_live(client_timeout=5.0)
    except Exception as exc:
        reason = str(getattr(exc, "message", lambda: "")() or exc).splitlines()[0][:200]
        raise CliError(f"cannot reach a KServe v2 server at {url} over {protocol}: {reason}") from None
    if not live:
        raise CliError(f"the server at {url} says it is not live")


def _format_summary(s) -> str:
    lat = s.latency_s
    mode = (
        f"open loop at {s.target_rate:g}/s"
        if s.mode == "open"
        else f"closed loop, concurrency {s.concurrency}"
    )
    errors = ", ".join(f"{k}: {v}" for k, v in sorted(s.errors.items())) or "none"
    lines = [
        f"{mode} over {s.protocol}, {s.elapsed_s:.1f} s",
        f"  sent {s.sent}   ok {s.ok}   errors {sum(s.errors.values())} ({errors})",
        f"  achieved {s.achieved_rate:.1f} req/s sent, {s.ok_rate:.1f} ok/s",
        f"  latency p50 {lat['p50'] * 1e3:.1f} ms   p90 {lat['p90'] * 1e3:.1f} ms   "
        f"p99 {lat['p99'] * 1e3:.1f} ms   max {lat['max'] * 1e3:.1f} ms",
    ]
    if len(s.by_target) > 1:
        for label, c in sorted(s.by_target.items()):
            lines.append(f"  {label}: sent {c.get('sent', 0)}, ok {c.get('ok', 0)}")
    if s.protocol in ("openai", "triton-generate"):
        from reference_server.stream_load import token_lines

        lines += token_lines(s)
    lines += [f"WARNING: {w}" for w in s.warnings]
    return "\n".join(lines)


def _load(args: argparse.Namespace) -> int:
    from reference_server.defaults import VLLM_PORT
    from reference_server.loadgen import LoadConfig, LoadError, Target, run_load

    port = {"grpc": contract.PORTS["triton_grpc"], "openai": VLLM_PORT}.get(
        args.protocol, contract.PORTS["triton_http"]
    )
    url = args.url or f"127.0.0.1:{port}"
    default_model = {"openai": "tiny-llm", "triton-generate": "tiny_stream"}.get(
        args.protocol, "dense_batched"
    )
    try:
        config = LoadConfig(
            url=url,
            protocol=args.protocol,
            targets=[Target.parse(m, args.protocol) for m in (args.model or [default_model])],
            stream=args.stream,
            endpoint=args.endpoint,
            prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens,
            ignore_eos=args.ignore_eos,
            rate=args.rate,
            concurrency=args.concurrency,
            duration=args.duration,
            batch=args.batch,
            max_in_flight=args.max_in_flight,
            timeout=args.timeout,
            seed=args.seed,
        ).validate()
        if args.max_in_flight < 1:
            raise LoadError("--max-in-flight must be at least 1")
    except LoadError as exc:
        raise CliError(str(exc), 2) from None
    _check_reachable(url, args.protocol, list(config.targets))

    if args.json or not sys.stdout.isatty():
        summary = run_load(config)
    else:
        from rich.live import Live
        from rich.text import Text

        with Live(Text("starting..."), refresh_per_second=4, transient=True) as live:

            def show(s) -> None:
                lat = s.latency_s
                live.update(
                    Text(
                        f"{s.elapsed_s:5.1f}/{args.duration:g} s  sent {s.sent}  ok {s.ok}  "
                        f"errors {sum(s.errors.values())}  in flight {s.in_flight}  "
                        f"{s.achieved_rate:.1f} req/s  p50 {lat['p50'] * 1e3:.1f} ms  "
                        f"p99 {lat['p99'] * 1e3:.1f} ms"
                        + (f"  ttft p50 {s.ttft_s['p50'] * 1e3:.1f} ms" if s.ttft_s else "")
                        + ("  (behind!)" if not s.kept_up else "")
                    )
                )

            summary = run_load(config, on_progress=show)
    if args.json:
        print(json.dumps(summary.to_dict(), indent=2, sort_keys=True))
        for w in summary.warnings:
            print(f"inferwatch: warning: {w}", file=sys.stderr)
    else:
        print(_format_summary(summary))
    if summary.sent and not summary.ok and set(summary.errors) <= {"connection_error", "timeout"}:
        raise CliError(f"no request succeeded: {summary.errors}")
    return 0


# ---------------------------------------------------------------------------------------
# inferwatch naive-server
# ---------------------------------------------------------------------------------------
def _register_naive(sub: argparse._SubParsersAction) -> None:
    from reference_server.defaults import NAIVE_SERVER_PORT as DEFAULT_PORT

    p = sub.add_parser(
        "naive-server",
        help="serve the dense model with plain FastAPI, one request at a time (the baseline)",
        description=(
            "Serve the dense reference models (dense_batched, dense_unbatched, dense_int4_*: same "
            "weights and code as Triton's) over the KServe v2 HTTP protocol with FastAPI, computing "
            "each request inline, "
            "one at a time: the naive baseline of the batching benchmark. /healthz answers when ready."
        ),
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port (default: %(default)s)")
    p.set_defaults(func=_naive)


def _naive(args: argparse.Namespace) -> int:
    from reference_server.launcher import LauncherError, port_in_use
    from reference_server.naive import serve

    if not 0 < args.port < 65536:
        raise CliError("--port must be a port number (1-65535)", 2)
    try:
        if port_in_use(args.host, args.port):
            raise CliError(f"port {args.host}:{args.port} is already in use; choose another with --port")
    except LauncherError as exc:
        raise CliError(str(exc)) from None
    serve(args.host, args.port)
    return 0
