"""What the stack generates before it starts: Prometheus' scrape config, the rules and the
Alertmanager config of the spec in use, and the pager's bearer token. All of it lands in
the state dir, so the files that ran are there to read afterwards."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import yaml

from alert_rules.pager import new_token_file
from inferwatch import contract
from inferwatch.spec import FleetSpec, Receiver, Routing, Webhook, duration_seconds

# The ports the stack binds, by the contract's names (Grafana does not run here).
PORT_NAMES = (
    "triton_http",
    "triton_grpc",
    "triton_metrics",
    "sidecar_http",
    "sidecar_grpc",
    "sidecar_metrics",
    "gpu_exporter",
    "pager",
    "alertmanager",
    "alertmanager_2",
    "alertmanager_cluster",
    "alertmanager_2_cluster",
    "prometheus",
)
# With ``inferwatch up --llm``: the real vLLM and an LLM sidecar of its own in front of it.
LLM_PORT_NAMES = ("vllm", "llm_sidecar_http", "llm_sidecar_metrics")
# vLLM's KV cache in the LLM stack, in blocks (``inferwatch vllm --kv-cache-blocks``; the CPU
# build's blocks hold 128 tokens): 76 blocks (75 usable) hold 18 of the LLM demo's 4-block
# batch requests (demo_llm.py), 96% of the cache, 91% while one of them is being replaced, with
# 3 blocks to spare for the interactive streams, which take one block each and so stay near 1%
# on their own. Fewer requests would dip under the alert's 90% each time one finishes; more
# would make every engine step, and so every interactive first token, slower. Whole GiB
# (--kv-cache-gib) would hold 2,048 blocks, which 2 cores cannot fill.
LLM_KV_CACHE_BLOCKS = 76
# With priority scheduling the interactive streams (priority 0) are admitted before the batch
# requests that wait for cache blocks (priority 1), as a fleet mixing both would run vLLM.
LLM_SCHEDULING_POLICY = "priority"
# The two clustered Alertmanagers: (component name, web port, gossip port, its peer's gossip port).
ALERTMANAGERS = (
    ("alertmanager", "alertmanager", "alertmanager_cluster", "alertmanager_2_cluster"),
    ("alertmanager-2", "alertmanager_2", "alertmanager_2_cluster", "alertmanager_cluster"),
)
# Alertmanager's --cluster.peer-timeout for the pair (core.py says why it is short).
PEER_TIMEOUT = "2s"
DEFAULT_PORTS: dict[str, int] = {name: contract.PORTS[name] for name in (*PORT_NAMES, *LLM_PORT_NAMES)}


def port_names(llm: bool) -> tuple[str, ...]:
    """The ports a stack binds: the LLM ones only with ``llm``."""
    return (*PORT_NAMES, *LLM_PORT_NAMES) if llm else PORT_NAMES


def _seconds_text(seconds: float) -> str:
    return f"{seconds:g}s"


def prometheus_config(
    spec: FleetSpec,
    ports: Mapping[str, int],
    rule_files: list[Path],
    host: str = "127.0.0.1",
    llm: bool = False,
) -> dict:
    """The scrape config: the three jobs of the contract, the spec's intervals, the rules
    generated from the spec, and both of the stack's Alertmanagers (Prometheus sends every
    alert to each; their gossip makes one notification of it).

    With ``llm``, also the LLM server (vLLM's own /metrics, job ``vllm``) and the LLM
    sidecar in front of it, as a second target of the sidecar job: it is the same component,
    its series are told apart by ``model``, and in Kubernetes one PodMonitor scrapes both."""
    interval = duration_seconds(spec.prometheus.scrape_interval)
    # A scrape may not outlast its interval (Prometheus refuses the config otherwise).
    timeout = min(10.0, interval)

    def job(name: str, *port_names: str) -> dict:
        return {"job_name": name, "static_configs": [{"targets": [f"{host}:{ports[p]}" for p in port_names]}]}

    sidecars = ("sidecar_metrics", "llm_sidecar_metrics") if llm else ("sidecar_metrics",)
    scrape = [
        job(contract.JOB_SIDECAR, *sidecars),
        job(contract.JOB_TRITON, "triton_metrics"),
        job(contract.JOB_GPU_EXPORTER, "gpu_exporter"),
    ]
    if llm:
        scrape.append(job(contract.JOB_VLLM, "vllm"))

    return {
        "global": {
            "scrape_interval": spec.prometheus.scrape_interval,
            "scrape_timeout": _seconds_text(timeout),
            "evaluation_interval": spec.prometheus.evaluation_interval,
        },
        "rule_files": [str(p) for p in rule_files],
        "alerting": {
            "alertmanagers": [
                {
                    "static_configs": [
                        {"targets": [f"{host}:{ports[web]}" for _n, web, _g, _p in ALERTMANAGERS]}
                    ]
                }
            ]
        },
        "scrape_configs": scrape,
    }


def local_routing(spec: FleetSpec, pager_url: str, token_file: Path) -> FleetSpec:
    """The spec with every receiver delivering to the stack's own pager receiver.

    The local stack has one on-call inbox: routes, group waits and repeat intervals stay
    as the spec says; only where notifications go changes (a PagerDuty key or a Slack
    URL of a real fleet must not be called from a laptop demo)."""
    receivers = [
        Receiver(
            name=r.name,
            webhooks=[Webhook(url=pager_url, bearer_token_file=str(token_file), send_resolved=True)],
        )
        for r in spec.routing.receivers
    ]
    routing = Routing.model_validate({**spec.routing.model_dump(by_alias=True), "receivers": receivers})
    return spec.model_copy(update={"routing": routing})


def pager_token(path: Path) -> str:
    """The bearer token shared by Alertmanager and the pager; made once, kept 0600."""
    if path.exists():
        token = path.read_text().strip()
        if token:
            return token
    return new_token_file(path)


def write_yaml(path: Path, data: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
