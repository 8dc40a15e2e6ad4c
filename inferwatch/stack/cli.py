"""``inferwatch up`` and ``inferwatch demo``: the local stack and the incident demo.

This module parses and dispatches; ``managed.py`` holds the process shell both commands
share, ``demo.py`` the scenario, ``view.py`` and ``demo_view.py`` what a person sees.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from inferwatch.cli import CliError
from inferwatch.paths import DEFAULT_SPEC

DEMO_SPEC = "fleet.demo.yaml"


def _add_stack_args(p: argparse.ArgumentParser, spec_default: str) -> None:
    from inferwatch.stack.config import DEFAULT_PORTS
    from inferwatch.stack.core import DEFAULT_READY_TIMEOUT, default_state_dir

    p.add_argument("--spec", default=spec_default, help="the fleet spec (default: %(default)s)")
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help=f"where configs, data, logs and stack.json go (default: {default_state_dir()})",
    )
    p.add_argument(
        "--port",
        action="append",
        default=[],
        metavar="NAME=PORT",
        help=f"move one component to another port (repeatable); NAME is one of {', '.join(DEFAULT_PORTS)}",
    )
    p.add_argument(
        "--free-ports",
        action="store_true",
        help="pick free loopback ports for every component instead of the standard ones",
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=DEFAULT_READY_TIMEOUT,
        metavar="S",
        help="seconds each component may take to become healthy (default: %(default)s)",
    )


def register(sub: argparse._SubParsersAction) -> None:
    from inferwatch.stack.demo import DEFAULT_RATE
    from inferwatch.stack.demo_llm import LlmScenario

    up = sub.add_parser(
        "up",
        help="run the local stack (Triton, sidecar, GPU exporter, Prometheus, two Alertmanagers, pager)",
        description=(
            "Start the local stack in dependency order, each component waited on until healthy: "
            "Triton, the sidecar in front of it, the GPU exporter (simulated unless NVML works), the "
            "pager receiver, two clustered Alertmanagers and Prometheus with the rules generated from the "
            "spec. Configs, data and logs go under the state dir. Runs in the foreground; a component "
            "that dies is restarted with backoff, and one that still fails after 5 restarts in a row "
            "stops the stack (exit 1). Ctrl-C or SIGTERM stops every process it started. With --llm, also "
            "the real vLLM and an LLM sidecar in front of it."
        ),
    )
    _add_stack_args(up, DEFAULT_SPEC)
    up.add_argument(
        "--gpu-backend",
        choices=("auto", "nvml", "simulated"),
        default="auto",
        help="the GPU exporter's backend (default: %(default)s: NVML when it works, else simulated)",
    )
    _add_llm_args(up)
    up.set_defaults(func=_up)

    demo = sub.add_parser(
        "demo",
        help="play an incident on the local stack and show the pages arriving",
        description=(
            "Play an incident on the local stack (the running one in the state dir, or one it starts "
            "with the demo spec): steady traffic, an error burst (critical page), a latency regression "
            "in the ranker canary (warning), GPU memory pressure (info), then recovery (resolved). Shows "
            "traffic, alert states and pages live, and ends with each fault's detection delay against "
            "the theoretical minimum computed from the spec, and the canary verdict (inferwatch canary) on "
            "the ranker canary during its fault and after recovery. --scenario llm plays an LLM incident "
            "instead (a stack with vLLM). Exits 1 if an expected page or resolved notification did not "
            "arrive in time."
        ),
    )
    _add_stack_args(demo, DEMO_SPEC)
    demo.add_argument(
        "--steady",
        type=float,
        default=None,
        metavar="S",
        help="seconds of fault-free traffic before the first fault (default: long enough for every "
        "rule to have fired from a cold start: the longest rule time + evaluation + group wait)",
    )
    demo.add_argument(
        "--rate",
        type=float,
        default=None,
        metavar="RPS",
        help=f"steady request rate (default: {DEFAULT_RATE:g}; llm: tiny_stream streams/s, "
        f"default {LlmScenario.rate:g})",
    )
    demo.add_argument(
        "--keep-running",
        action="store_true",
        help="leave a stack the demo started running afterwards (stop it with Ctrl-C)",
    )
    demo.add_argument(
        "--scenario",
        choices=("main", "llm"),
        default="main",
        help="main: the incident above; llm: an LLM incident on a stack with vLLM (up --llm): steady "
        "token streams, a TTFT regression on the tiny_stream canary (warning), errors after N tokens "
        "(critical), then recovery (default: %(default)s)",
    )
    demo.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results as JSON")
    demo.set_defaults(func=_demo)


def _add_llm_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--llm",
        action="store_true",
        help="also run the real vLLM (inferwatch vllm; 35 to 120 s to start, about 3 GB) and an LLM "
        "sidecar of its own in front of it (HTTP :8020, metrics :9120), both scraped by Prometheus",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=int,
        default=None,
        metavar="GIB",
        help="with --llm: vLLM's KV cache in whole GiB (default: 76 blocks of 128 tokens, small "
        "enough for the LLM demo to saturate)",
    )


def _up(args: argparse.Namespace) -> int:
    from inferwatch.stack.managed import (
        managed_stack,
        setup_logging,
        stack_config,
        stop_on_signals,
        supervised,
    )
    from inferwatch.stack.view import print_summary

    config = stack_config(args)
    setup_logging(config.state_dir)
    with stop_on_signals() as stop, managed_stack(config, stop) as (_info, stack):
        assert stack is not None
        print_summary(stack)
        # A component that dies is restarted with backoff (supervisor.RestartPolicy); one that
        # keeps dying ends the stack with an error that names it (CliError, exit 1).
        while not stop.wait(1.0):
            supervised(stack)
    return 0


def _demo(args: argparse.Namespace) -> int:
    import httpx

    from inferwatch.stack.demo import DEFAULT_RATE, Demo, Scenario
    from inferwatch.stack.demo_llm import LlmDemo, LlmScenario
    from inferwatch.stack.demo_view import make_reporter, print_results
    from inferwatch.stack.managed import (
        managed_stack,
        setup_logging,
        stack_config,
        stop_on_signals,
        supervised,
    )
    from inferwatch.stack.view import console, print_summary

    if args.rate is not None and args.rate <= 0:
        raise CliError("--rate must be above 0", 2)
    if args.steady is not None and args.steady < 0:
        raise CliError("--steady must be 0 or more seconds", 2)
    llm = args.scenario == "llm"
    if llm:
        scenario = LlmScenario(steady_s=args.steady, rate=args.rate or LlmScenario.rate)
    else:
        scenario = Scenario(steady_s=args.steady, rate=args.rate or DEFAULT_RATE)
    config = stack_config(args)
    config.gpu_backend = "simulated"  # the demo pushes the simulated GPU into memory pressure
    config.llm = llm  # a stack the LLM demo starts runs vLLM and its sidecar (up --llm)
    setup_logging(config.state_dir)
    with stop_on_signals() as stop, managed_stack(config, stop, reuse_running=True) as (info, stack):
        if stack is not None:
            print_summary(stack)
        if llm and not info.llm:
            raise CliError(
                f"the running stack in {info.state_dir} has no vLLM: the LLM scenario needs one started "
                "with `inferwatch up --llm` (or stop it and let the demo start its own)"
            )
        # The demo's own stack is supervised as up's is, from this (the starting) thread.
        watch = (lambda: supervised(stack)) if stack else None
        demo = (LlmDemo if llm else Demo)(info, info.spec(), scenario, stop, watch=watch)
        minutes = demo.expected_seconds() / 60
        if stack is None and minutes > 6:
            console.print(
                f"the running stack uses {info.spec_path.name}: this incident takes about {minutes:.0f} "
                "minutes; for the short demo stop that stack and run `inferwatch demo` (fleet.demo.yaml)"
            )
        try:
            with make_reporter(demo) as reporter:
                result = demo.run(reporter)
        except httpx.HTTPError as exc:
            raise CliError(
                f"the stack stopped answering during the demo ({type(exc).__name__}: {exc}); "
                f"see the logs under {info.state_dir / 'logs'}"
            ) from None
        if args.json:
            args.json.write_text(json.dumps(result.to_json(), indent=2))
        print_results(result)
        if stack is not None and args.keep_running and not stop.is_set():
            console.print(f"the stack keeps running (state under {info.state_dir}); Ctrl-C stops it")
            while not stop.wait(1.0):
                supervised(stack)
    if result.aborted == "interrupted":
        return 130
    return 0 if result.ok else 1
