"""The exporter's one ``main``: check the options, build the parts, serve until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path

from prometheus_client import ProcessCollector
from prometheus_client.registry import CollectorRegistry

from exporters.backends.simulated import MODELS, SimulatedBackend
from exporters.collector import GpuCollector, GpuSource, nvml_absent
from exporters.fields import DEFAULT_FIELDS, FieldsError, load_fields
from exporters.model import Backend
from exporters.server import ExporterApp, make_server
from inferwatch import logs
from inferwatch.cli import CliError

log = logging.getLogger("inferwatch.gpu_exporter")


def _nvml() -> Backend:
    from exporters.backends.nvml import NvmlBackend

    return NvmlBackend()


def build_source(args: argparse.Namespace) -> GpuSource:
    """The backend candidates for ``--backend``: nvml retries; auto falls back to simulated only
    on a host with no NVIDIA library and no NVIDIA driver."""

    def simulated() -> Backend:
        return SimulatedBackend(args.gpus, args.gpu_model, args.hostname)

    candidates: list[Callable[[], Backend]]
    if args.backend == "simulated":
        candidates = [simulated]
    elif args.backend == "nvml":
        candidates = [_nvml]
    else:
        candidates = [_nvml, simulated]
    return GpuSource(
        candidates,
        label="simulated" if args.backend == "simulated" else "nvml",
        hostname=args.hostname,
        # auto retries too: on a host with a driver it reports NVML's error instead of simulating,
        # and while it simulates (no driver at all) a library mounted late is still picked up
        retry=args.backend != "simulated",
        fall_back=nvml_absent,
        retry_max_s=args.nvml_retry_max,
        process_timeout_s=args.scrape_timeout,
        proc_root=Path(args.proc_root),
        log_root=Path(args.kubelet_log_dir) if args.kubelet_log_dir else None,
        process_interval_s=args.process_interval,
        pod_resources_socket=args.kubelet_pod_resources,
    )


def check(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be 0..65535, got {args.port}", 2)
    if not 1 <= args.gpus <= 1024:
        raise CliError(f"--gpus must be 1..1024, got {args.gpus}", 2)
    if args.gpu_model.lower() not in {m.lower() for m in MODELS}:
        raise CliError(f"--gpu-model {args.gpu_model!r} is unknown; known: {', '.join(MODELS)}", 2)
    for name in ("scrape_timeout", "process_interval", "nvml_retry_max"):
        if not getattr(args, name) > 0:
            raise CliError(f"--{name.replace('_', '-')} must be above 0, got {getattr(args, name)}", 2)


def run(args: argparse.Namespace) -> int:
    check(args)
    try:
        fields = load_fields(args.fields or DEFAULT_FIELDS)
    except FieldsError as exc:
        raise CliError(str(exc), 2) from None
    logs.setup(args.log_level)

    source = build_source(args)
    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)  # the exporter's own CPU and resident memory
    GpuCollector(source, fields, registry, timeout_s=args.scrape_timeout)
    try:
        server = make_server(ExporterApp(source, registry), args.host, args.port)
    except OSError as exc:
        raise CliError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("stopping", extra={"fields": {"signal": signal.Signals(signum).name}})
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    source.start()
    serving = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.5}, name="http")
    serving.start()
    host, port = server.server_address[:2]
    log.info(
        "listening",
        extra={"fields": {"host": host, "port": port, "backend": source.label, "fields": len(fields)}},
    )
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.shutdown()
        server.server_close()
        serving.join(timeout=5)
        source.stop()
        log.info("stopped")
    return 0
