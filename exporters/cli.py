"""``inferwatch gpu-exporter``: parse the options, build the parts, serve until SIGTERM."""

from __future__ import annotations

import argparse
import os
import socket

from inferwatch.contract import PORTS

BACKENDS = ("auto", "nvml", "simulated")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gpu-exporter",
        help="serve GPU metrics under dcgm-exporter's names (NVML, or simulated GPUs)",
        description=(
            "Serve GPU metrics on /metrics under dcgm-exporter's names and labels, plus per-pod GPU "
            "memory, XID counts by code and the exporter's own health. The backend is NVML "
            "(nvidia-ml-py) or, on hosts without a GPU, simulated GPUs whose values follow a load "
            "signal and can be pushed into memory pressure with POST /simulate."
        ),
        epilog=(
            "Endpoints: GET /metrics, GET /healthz, POST /simulate (simulated backend only), e.g. "
            'curl -d \'{"fb_used_ratio": 0.95, "gpus": [0]}\' localhost:9400/simulate; '
            '{"fb_used_ratio": null} clears it, {"load": 0.0..1.0} pins the load, {"xid": 79} '
            "injects an XID event."
        ),
    )
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default: %(default)s)")
    p.add_argument(
        "--port", type=int, default=PORTS["gpu_exporter"], help="port to listen on (default: %(default)s)"
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="nvml: read GPUs through NVML, and keep retrying if it does not start; simulated: "
        "virtual GPUs; auto: NVML, and simulated GPUs only on a host with no NVIDIA library and no "
        "NVIDIA driver (on a host with a driver a failing NVML is reported, never simulated) "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--gpus", type=int, default=1, help="simulated backend: number of GPUs (default: %(default)s)"
    )
    p.add_argument(
        "--gpu-model",
        default="H200",
        help="simulated backend: GPU model, one of H200, H100, A100, A100-40GB, L4, A10G, T4 "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--hostname",
        default=os.environ.get("NODE_NAME") or socket.gethostname(),
        help="value of the Hostname label (default: $NODE_NAME, else this host's name: %(default)s)",
    )
    p.add_argument(
        "--fields",
        default=None,
        help="CSV of dcgm fields to collect (field, type, help), as dcgm-exporter's -f "
        "(default: the bundled exporters/fields.csv, every field this exporter knows)",
    )
    p.add_argument(
        "--scrape-timeout",
        type=float,
        default=5.0,
        help="seconds a scrape waits for the GPUs, and a per-process listing for each GPU; a GPU "
        "not read by then is left out and counted as a timeout error (default: %(default)s)",
    )
    p.add_argument(
        "--proc-root",
        default="/proc",
        help="where to read /proc/<pid>/cgroup of GPU processes. Per-pod memory needs the host's "
        "PID namespace (hostPID: true): NVML lists no processes outside it, whatever /proc is "
        "mounted (default: %(default)s)",
    )
    p.add_argument(
        "--kubelet-log-dir",
        default="/var/log",
        help="folder holding the kubelet's pods/ and containers/ log entries, which give pod, "
        "namespace and container names; '' to give only pod UIDs and container ids (default: %(default)s)",
    )
    p.add_argument(
        "--kubelet-pod-resources",
        default="/var/lib/kubelet/pod-resources/kubelet.sock",
        help="the kubelet's pod-resources socket: a GPU allocated to exactly one container gets its "
        "pod, namespace and container labels on the dcgm series, as with dcgm-exporter; used only "
        "when the socket exists; '' to skip (default: %(default)s)",
    )
    p.add_argument(
        "--process-interval",
        type=float,
        default=10.0,
        help="seconds between refreshes of per-process GPU memory, done off the scrape path "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--nvml-retry-max",
        type=float,
        default=60.0,
        help="the longest wait between attempts to start NVML, or to re-initialize it while a GPU "
        "is down (default: %(default)s)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="(default: %(default)s)",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from exporters.main import run

    return run(args)
