"""Rule cost at fleet scale: the real Prometheus with the series of N model pods and their GPUs.

    .venv/bin/python benchmarks/fleet_scale.py --pods 1000 [--json]

Serves synthetic scrape targets from this process (one small HTTP server, one path per pod
kind and per node), starts the real Prometheus on them with the generated rules
(alert_rules/generated/*.rules.yml) and the spec's scrape and evaluation intervals, lets the
rate windows fill (``--warmup``), then reports over ``--measure`` seconds:

- each rule group's evaluation time (``prometheus_rule_group_last_duration_seconds``,
  median and max of the evaluations seen) and its failures and missed iterations;
- memory per active series (resident and Go heap in use, over ``prometheus_tsdb_head_series``);
- the query time of every Fleet overview query (dashboards/generated/fleet-overview.json,
  expanded as Grafana would by dashboards/live.py) over the data's last 5 minutes.

Why live scrape targets rather than backfilled blocks: the head block is what a running
Prometheus holds in memory and what the rules read every interval, so memory per active
series and rule cost are only meaningful with the series live in the head, scraped while
the rules run. Backfilled blocks are memory-mapped history: cheap to hold, and a
different cost.

What a pod looks like: its sidecar exposition is rendered by the sidecar's own telemetry
(sidecar.core.telemetry.Telemetry, the code the real sidecar runs) fed one pod's traffic mix,
so its series follow the sidecar as it changes; its GPU node's exposition is one scrape of
the real GPU exporter (simulated backend, 8 GPUs) with each node's hostname and UUIDs;
Triton's is the contract's ``nv_inference_*`` families per model version. Every pod of
one kind serves the same bytes (the ``pod``, ``namespace`` and ``instance`` labels come
from the scrape config, as Kubernetes service discovery adds them); counters grow with
time at the pod's request rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import yaml  # noqa: E402
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from dashboards import build as dashboards_build  # noqa: E402
from dashboards import live, urls  # noqa: E402
from inferwatch import contract as c  # noqa: E402
from inferwatch.net import free_port  # noqa: E402
from inferwatch.spec import FleetSpec, duration_seconds, load_spec  # noqa: E402

RULES_DIR = ROOT / "alert_rules" / "generated"
GPUS_PER_NODE = 8
POD_RATE = 10.0  # requests/s per protocol per pod
UNIT_S = 100.0  # the template holds this many seconds of traffic; counters start there
NODE_HOST = "fleet-node-0"  # the exporter's hostname in the captured node exposition
CANARY_EVERY = 10  # the 2nd, 12th, ... pod of the first SLO model runs version 2, failing
CANARY_ERROR_RATIO = 0.3


def log(msg: str) -> None:
    print(f"[fleet_scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# What one pod and one node expose
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PodKind:
    """Pods that serve the same model version with the same traffic mix expose the same series."""

    model: str
    version: str
    server_error_ratio: float

    @property
    def key(self) -> str:
        return f"{self.model}-v{self.version}"


@dataclass
class Template:
    """An exposition as lines: a prefix (``name{labels} ``), a value, and whether it grows with
    time (counters and histograms) or stays (gauges)."""

    lines: list[tuple[str, float, bool]]

    def render(self, elapsed: float) -> bytes:
        k = (UNIT_S + elapsed) / UNIT_S
        return "".join(
            f"{prefix}{round(value * k, 3) if grows else value}\n" for prefix, value, grows in self.lines
        ).encode()

    def __len__(self) -> int:
        return len(self.lines)


def _labels_text(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    esc = (v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for v in labels.values())
    return "{" + ",".join(f'{k}="{v}"' for k, v in zip(labels, esc, strict=True)) + "}"


def template_of(text: str) -> Template:
    lines = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_created"):  # the sidecar turns them off (disable_created_metrics)
                continue
            grows = fam.type in ("counter", "histogram", "summary")
            lines.append((f"{s.name}{_labels_text(s.labels)} ", float(s.value), grows))
    return Template(lines)


def sidecar_exposition(spec: FleetSpec, kind: PodKind, seed: int = 1) -> str:
    """One pod's /metrics after UNIT_S seconds of its traffic, from the sidecar's own telemetry:
    both protocols, successes, client errors, timeouts and server errors, health checks (no
    model) and requests for a model the server does not have."""
    from sidecar.config import SidecarConfig
    from sidecar.core.telemetry import UPSTREAM_GRPC, UPSTREAM_HTTP, Telemetry

    registry = CollectorRegistry()
    tel = Telemetry(registry, SidecarConfig(spec=spec))
    tel.update_models({kind.model: [kind.version]})
    tel.set_upstream_up(UPSTREAM_HTTP, True)
    tel.set_upstream_up(UPSTREAM_GRPC, True)
    sla = spec.latency_sla_seconds(kind.model)
    rnd = random.Random(seed)
    codes = {
        c.PROTOCOL_HTTP: {"ok": "200", "client": "400", "timeout": "504", "server": "500", "missing": "404"},
        c.PROTOCOL_GRPC: {
            "ok": "OK",
            "client": "INVALID_ARGUMENT",
            "timeout": "DEADLINE_EXCEEDED",
            "server": "UNAVAILABLE",
            "missing": "NOT_FOUND",
        },
    }

    def request(model: str, version: str, proto: str, code: str, latency: float, size: int) -> None:
        req = tel.begin(model, version, proto)
        req.start -= latency  # the telemetry measures from begin(); this is the request's latency
        outcome = tel.outcome_for_http(int(code)) if proto == c.PROTOCOL_HTTP else tel.outcome_for_grpc(code)
        tel.end(req, code, outcome, size, size // 2)

    for proto, names in codes.items():
        for _ in range(int(POD_RATE * UNIT_S)):
            r = rnd.random()
            latency = sla * rnd.lognormvariate(math.log(0.3), 0.6)
            if r < kind.server_error_ratio:
                request(kind.model, kind.version, proto, names["server"], latency / 3, 2048)
            elif r < kind.server_error_ratio + 0.002:
                request(kind.model, kind.version, proto, names["timeout"], 2 * sla + latency, 2048)
            elif r < kind.server_error_ratio + 0.012:
                request(kind.model, kind.version, proto, names["client"], latency / 10, 2048)
            else:
                request(kind.model, kind.version, proto, names["ok"], latency, 2048)
        for _ in range(int(UNIT_S / 10)):  # readiness and metadata probes name no model
            request(c.MODEL_NONE, "", proto, names["ok"], 0.001, 0)
        for _ in range(3):
            request("no_such_model", "", proto, names["missing"], 0.001, 64)
    # Two requests in flight, so the in-flight gauge has something to sum.
    tel.begin(kind.model, kind.version, c.PROTOCOL_HTTP)
    tel.begin(kind.model, kind.version, c.PROTOCOL_GRPC)
    return generate_latest(registry).decode()


def triton_exposition(kind: PodKind) -> str:
    """The contract's nv_inference_* families for the pod's model version (Triton's own
    exposition also has a few per-server families; those feed no rule or overview panel)."""
    lines = []
    n = POD_RATE * 2 * UNIT_S
    values = {
        c.TRITON_REQUEST_SUCCESS.name: n * (1 - kind.server_error_ratio),
        c.TRITON_REQUEST_FAILURE.name: n * kind.server_error_ratio,
        c.TRITON_INFERENCE_COUNT.name: n,
        c.TRITON_EXEC_COUNT.name: n / 4,
        c.TRITON_REQUEST_DURATION_US.name: n * 20_000,
        c.TRITON_QUEUE_DURATION_US.name: n * 2_000,
        c.TRITON_COMPUTE_INPUT_US.name: n * 500,
        c.TRITON_COMPUTE_INFER_US.name: n * 15_000,
        c.TRITON_COMPUTE_OUTPUT_US.name: n * 500,
        c.TRITON_PENDING_REQUESTS.name: 1,
    }
    for m in c.TRITON_METRICS:
        lines.append(f"# TYPE {m.name} {m.type}")
        lines.append(f'{m.name}{{model="{kind.model}",version="{kind.version}"}} {values[m.name]}')
    return "\n".join(lines) + "\n"


def gpu_node_exposition(workdir: Path) -> str:
    """One scrape of the real GPU exporter (simulated backend) with GPUS_PER_NODE GPUs."""
    port = free_port()
    cmd = [
        *_inferwatch(), "gpu-exporter", "--host", "127.0.0.1", "--port", str(port), "--backend", "simulated",
        "--gpus", str(GPUS_PER_NODE), "--hostname", NODE_HOST, "--log-level", "warning",
    ]  # fmt: skip
    with started("gpu-exporter", cmd, workdir) as proc:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"fleet_scale: the GPU exporter exited with {proc.returncode}")
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
                if text.count(c.DCGM_GPU_UTIL.name + "{") == GPUS_PER_NODE:
                    return text
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
    raise SystemExit("fleet_scale: the GPU exporter did not expose its GPUs within 60s")


_UUID_RE = re.compile(r'UUID="(GPU-[0-9a-f-]+)"')


def node_text(text: str, node: str) -> str:
    """The captured node's exposition as another node's: its hostname and its GPUs' UUIDs."""
    text = text.replace(f'Hostname="{NODE_HOST}"', f'Hostname="{node}"')
    return _UUID_RE.sub(lambda m: f'UUID="GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, node + m.group(1))}"', text)


# ---------------------------------------------------------------------------------------
# The fleet: pods, nodes, and the server that exposes them
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    kind: PodKind
    node: str


def plan(spec: FleetSpec, pods: int) -> list[Pod]:
    """Pods spread over the spec's models in turn, one GPU each, GPUS_PER_NODE per node; one
    pod in CANARY_EVERY of the first model with an SLO runs a failing version 2."""
    models = [m.name for m in spec.models] or ["model"]
    canary_model = next((m.name for m in spec.models if m.slo), models[0])
    out = []
    for i in range(pods):
        model = models[i % len(models)]
        seen = i // len(models)
        if model == canary_model and seen % CANARY_EVERY == 1:
            kind = PodKind(model, "2", CANARY_ERROR_RATIO)
        else:
            kind = PodKind(model, "1", 0.001)
        out.append(Pod(f"{model.replace('_', '-')}-{i:05d}", f"serving-{model.replace('_', '-')}", kind,
                       f"gpu-node-{i // GPUS_PER_NODE:04d}"))  # fmt: skip
    return out


class Fleet:
    """Serves /sidecar/<kind>, /triton/<kind> and /gpu/<node> on one loopback port (uvicorn,
    in a thread); bodies of one kind are rendered at most once a second and shared."""

    def __init__(self, spec: FleetSpec, pods: int, workdir: Path) -> None:
        self.spec = spec
        self.pods = plan(spec, pods)
        kinds = sorted({p.kind for p in self.pods}, key=lambda k: k.key)
        self.templates: dict[str, Template] = {}
        for kind in kinds:
            self.templates[f"/sidecar/{kind.key}"] = template_of(sidecar_exposition(spec, kind))
            self.templates[f"/triton/{kind.key}"] = template_of(triton_exposition(kind))
        node_capture = gpu_node_exposition(workdir)
        self.nodes = sorted({p.node for p in self.pods})
        self.static: dict[str, bytes] = {
            f"/gpu/{node}": node_text(node_capture, node).encode() for node in self.nodes
        }
        self.kinds = kinds
        self.t0 = time.time()
        self._cache: dict[str, tuple[int, bytes]] = {}
        self.port = free_port()
        self._server = None
        self._thread: threading.Thread | None = None

    # Series each pod and node adds, as Prometheus will count them (plus up and the scrape's
    # own four series per target).
    def series_per_pod(self) -> dict[str, int]:
        return {k.key: len(self.templates[f"/sidecar/{k.key}"]) + len(self.templates[f"/triton/{k.key}"])
                for k in self.kinds}  # fmt: skip

    def series_per_node(self) -> int:
        return len(template_of(next(iter(self.static.values())).decode()))

    def body(self, path: str) -> bytes | None:
        if path in self.static:
            return self.static[path]
        tpl = self.templates.get(path)
        if tpl is None:
            return None
        now = int(time.time())
        hit = self._cache.get(path)
        if hit is None or hit[0] != now:
            hit = (now, tpl.render(now - self.t0))
            self._cache[path] = hit
        return hit[1]

    async def _app(self, scope, receive, send) -> None:  # a minimal ASGI app
        if scope["type"] != "http":
            return
        body = self.body(scope["path"])
        status = 200 if body is not None else 404
        body = body if body is not None else b"not found\n"
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/plain; version=0.0.4")]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})

    def __enter__(self) -> Fleet:
        import uvicorn

        config = uvicorn.Config(
            self._app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False,
            timeout_keep_alive=120, backlog=4096, lifespan="off", interface="asgi3",
        )  # fmt: skip
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve()), daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise SystemExit("fleet_scale: the synthetic targets' server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)

    def scrape_configs(self) -> list[dict]:
        """The three jobs, one static target per pod (sidecar, Triton) and per node (GPU
        exporter), labelled as Kubernetes service discovery would label them."""
        addr = f"127.0.0.1:{self.port}"

        def target(path: str, instance: str, **labels: str) -> dict:
            return {"targets": [addr], "labels": {"__metrics_path__": path, "instance": instance, **labels}}

        return [
            {"job_name": c.JOB_SIDECAR, "static_configs": [
                target(f"/sidecar/{p.kind.key}", f"{p.name}:{c.PORTS['sidecar_metrics']}",
                       pod=p.name, namespace=p.namespace, container="inferwatch-sidecar")
                for p in self.pods]},
            {"job_name": c.JOB_TRITON, "static_configs": [
                target(f"/triton/{p.kind.key}", f"{p.name}:{c.PORTS['triton_metrics']}",
                       pod=p.name, namespace=p.namespace, container="triton")
                for p in self.pods]},
            {"job_name": c.JOB_GPU_EXPORTER, "static_configs": [
                target(f"/gpu/{n}", f"{n}:{c.PORTS['gpu_exporter']}", node=n) for n in self.nodes]},
        ]  # fmt: skip


# ---------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------


def _inferwatch() -> list[str]:
    exe = ROOT / ".venv" / "bin" / "inferwatch"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "inferwatch.cli"]


@contextmanager
def started(name: str, cmd: list[str], workdir: Path) -> Iterator[subprocess.Popen]:
    """A subprocess in its own process group, logged to workdir/NAME.log, always reaped."""
    with (workdir / f"{name}.log").open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def prometheus_cmd(config: dict, workdir: Path, name: str, port: int, *flags: str) -> list[str]:
    path = workdir / f"{name}.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return [
        "prometheus",
        f"--config.file={path}",
        f"--storage.tsdb.path={workdir / (name + '-data')}",
        f"--web.listen-address=127.0.0.1:{port}",
        *flags,
    ]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(
                f"fleet_scale: {proc.args[0]} exited with {proc.returncode} before {url} was ready"
            )
        try:
            if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"fleet_scale: {url} not ready within {timeout:.0f}s")


def self_metrics(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus's own /metrics: family sample name -> [(labels, value)]."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def instant(url: str, expr: str) -> float | None:
    """The value of a one-series instant query; None when it has no result."""
    resp = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=60)
    result = resp.json()["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def _one(m: dict, name: str) -> float:
    return sum(v for _, v in m.get(name, []))


def _by_group(m: dict, name: str) -> dict[str, float]:
    # rule_group is "<file>;<group name>"
    return {labels["rule_group"].split(";")[-1]: v for labels, v in m.get(name, [])}


# ---------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------


@dataclass
class Options:
    pods: int
    warmup: float
    measure: float
    scrape_interval: float
    eval_interval: float
    query_range: float = 300.0
    query_repeats: int = 3
    spec_path: Path = ROOT / "fleet.yaml"
    rule_files: list[Path] = field(default_factory=lambda: sorted(RULES_DIR.glob("*.rules.yml")))


def time_queries(url: str, spec: FleetSpec, opts: Options) -> list[dict]:
    """Every Fleet overview query (variables first, then each panel's), as Grafana would send
    it over the last ``query_range`` seconds; median wall time of ``query_repeats`` runs."""
    dash = dashboards_build.build(spec)[urls.FLEET_OVERVIEW]
    prom = live.Prometheus(url, timeout=120)
    rows = []
    try:
        end = time.time()
        t = time.perf_counter()
        variables = live.resolve_variables(dash, prom, end - opts.query_range, end)
        rows.append(
            {
                "panel": "(variables)",
                "query": f"{len(variables)} label_values lookups",
                "seconds": round(time.perf_counter() - t, 4),
                "series": sum(len(v.options) for v in variables.values()),
            }
        )
        step = max(opts.scrape_interval, opts.query_range / 300)
        ctx = live.Context(variables, end - opts.query_range, end, step, opts.scrape_interval)
        for inst in live.panel_instances(dash, ctx):
            for q in inst.queries:
                times, series = [], 0
                for _ in range(opts.query_repeats):
                    t = time.perf_counter()
                    if q.instant:
                        result = prom.query(q.expr, end)
                    else:
                        result = prom.query_range(q.expr, ctx.start, end, step)
                    times.append(time.perf_counter() - t)
                    series = len(result)
                rows.append(
                    {
                        "panel": inst.title,
                        "ref": q.ref,
                        "query": q.raw,
                        "instant": q.instant,
                        "seconds": round(statistics.median(times), 4),
                        "series": series,
                    }
                )
    finally:
        prom.close()
    return rows


def run(opts: Options) -> dict:
    spec = load_spec(opts.spec_path)
    with tempfile.TemporaryDirectory(prefix="inferwatch-fleet-") as tmp:
        workdir = Path(tmp)
        log(f"rendering {opts.pods} pods' expositions ...")
        with Fleet(spec, opts.pods, workdir) as fleet:
            per_pod = fleet.series_per_pod()
            per_node = fleet.series_per_node()
            exposed = sum(per_pod[p.kind.key] for p in fleet.pods) + per_node * len(fleet.nodes)
            targets = 2 * len(fleet.pods) + len(fleet.nodes)
            log(
                f"{len(fleet.pods)} pods on {len(fleet.nodes)} nodes: {exposed} exposed series, "
                f"{targets} targets; per pod {per_pod}, per node {per_node}"
            )
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            config = {
                "global": {
                    "scrape_interval": f"{opts.scrape_interval:g}s",
                    "evaluation_interval": f"{opts.eval_interval:g}s",
                    "scrape_timeout": f"{min(opts.scrape_interval, 10):g}s",
                },
                "rule_files": [str(p) for p in opts.rule_files],
                "scrape_configs": fleet.scrape_configs(),
            }
            cmd = prometheus_cmd(config, workdir, "prometheus", port)
            with started("prometheus", cmd, workdir) as proc:
                wait_ready(url, proc)
                t_start = time.monotonic()
                log(f"Prometheus ready on {url}; warming up {opts.warmup:.0f}s (the rate windows fill)")
                last = -math.inf
                while (elapsed := time.monotonic() - t_start) < opts.warmup:
                    if proc.poll() is not None:
                        raise SystemExit(f"fleet_scale: Prometheus exited with {proc.returncode}")
                    if elapsed - last >= 30:
                        last = elapsed
                        _progress(url, elapsed, targets)
                    time.sleep(1)
                log(f"measuring for {opts.measure:.0f}s")
                durations: dict[str, list[float]] = {}
                seen: dict[str, float] = {}
                before, t_before = self_metrics(url), time.monotonic()
                t_end = t_before + opts.measure
                while True:
                    m = self_metrics(url)
                    lasts = _by_group(m, "prometheus_rule_group_last_duration_seconds")
                    evals = _by_group(m, "prometheus_rule_group_last_evaluation_timestamp_seconds")
                    for g, ts in evals.items():
                        if ts > 0 and ts != seen.get(g):
                            seen[g] = ts
                            durations.setdefault(g, []).append(lasts.get(g, 0.0))
                    if time.monotonic() >= t_end:
                        break
                    time.sleep(min(opts.eval_interval / 3, 2))
                cpu = _one(m, "process_cpu_seconds_total") - _one(before, "process_cpu_seconds_total")
                cpu_rate = cpu / (time.monotonic() - t_before)
                _progress(url, time.monotonic() - t_start, targets)
                rules_api = httpx.get(f"{url}/api/v1/rules", timeout=60).json()["data"]["groups"]
                log("counting the samples each rule group reads")
                samples = samples_read(url, rules_api)
                log("timing the Fleet overview's queries")
                queries = time_queries(url, spec, opts)
                return {
                    "pods": len(fleet.pods),
                    "nodes": len(fleet.nodes),
                    "gpus": len(fleet.nodes) * GPUS_PER_NODE,
                    "targets": targets,
                    "scrape_interval_seconds": opts.scrape_interval,
                    "evaluation_interval_seconds": opts.eval_interval,
                    "warmup_seconds": opts.warmup,
                    "measure_seconds": opts.measure,
                    "series_per_pod": per_pod,
                    "series_per_node": per_node,
                    "exposed_series": exposed,
                    **_state(url, m),
                    # Wall-clock figures on a shared machine include waiting for a core; the CPU
                    # Prometheus used and the host's load say how much.
                    "prometheus_cpu_seconds_per_second": round(cpu_rate, 3),
                    "host": {"cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2)},
                    "rule_groups": {
                        g: {**d, **{f"read_{k}": v for k, v in samples.get(g, {}).items()}}
                        for g, d in _groups(durations, before, m, rules_api).items()
                    },
                    "queries": queries,
                }


def _progress(url: str, elapsed: float, targets: int) -> None:
    try:
        m = self_metrics(url)
        ups = int(instant(url, "sum(up)") or 0)
        head = int(_one(m, "prometheus_tsdb_head_series"))
        rss = _one(m, "process_resident_memory_bytes") / 2**20
        lasts = _by_group(m, "prometheus_rule_group_last_duration_seconds")
        group, secs = max(lasts.items(), key=lambda kv: kv[1], default=("-", 0.0))
        log(
            f"t={elapsed:4.0f}s targets up {ups}/{targets}, head series {head}, RSS {rss:.0f} MiB, "
            f"slowest group {group} {secs * 1000:.0f} ms"
        )
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        log(f"t={elapsed:4.0f}s (Prometheus busy: {exc})")


def _state(url: str, m: dict) -> dict:
    """Targets, memory and alerts at the end of the measurement."""
    head = _one(m, "prometheus_tsdb_head_series")
    rss = _one(m, "process_resident_memory_bytes")
    heap = _one(m, "go_memstats_heap_inuse_bytes")
    slowest_scrape = instant(url, "max(scrape_duration_seconds)")
    firing = httpx.get(f"{url}/api/v1/query", params={"query": 'ALERTS{alertstate="firing"}'}, timeout=60)
    return {
        "targets_up": int(instant(url, "sum(up)") or 0),
        "max_scrape_seconds": None if slowest_scrape is None else round(slowest_scrape, 4),
        "alerts_firing": sorted({r["metric"]["alertname"] for r in firing.json()["data"]["result"]}),
        "head_series": int(head),
        "memory": {
            "resident_bytes": int(rss),
            "heap_inuse_bytes": int(heap),
            "resident_bytes_per_series": round(rss / head, 1) if head else None,
            "heap_bytes_per_series": round(heap / head, 1) if head else None,
        },
    }


def samples_read(url: str, rules_api: list[dict]) -> dict[str, dict[str, float]]:
    """Per group: the samples its expressions read (``totalQueryableSamples`` of each rule's
    expression run once as an instant query with ``stats=all``), a cost that does not depend
    on how busy the machine is, and the inner evaluation time of that one run."""
    out = {}
    for g in rules_api:
        samples = seconds = 0.0
        for r in g["rules"]:
            resp = httpx.get(f"{url}/api/v1/query", params={"query": r["query"], "stats": "all"}, timeout=600)
            stats = resp.json().get("data", {}).get("stats", {})
            samples += stats.get("samples", {}).get("totalQueryableSamples", 0)
            seconds += stats.get("timings", {}).get("innerEvalTime", 0.0)
        out[g["name"]] = {"samples": int(samples), "query_seconds": round(seconds, 4)}
    return out


def _groups(durations: dict[str, list[float]], before: dict, after: dict, rules_api: list[dict]) -> dict:
    failures = _by_group(after, "prometheus_rule_evaluation_failures_total")
    missed_before = _by_group(before, "prometheus_rule_group_iterations_missed_total")
    missed_after = _by_group(after, "prometheus_rule_group_iterations_missed_total")
    api = {g["name"]: g for g in rules_api}
    out = {}
    for g, ds in sorted(durations.items()):
        rules = api.get(g, {}).get("rules", [])
        out[g] = {
            "evaluations": len(ds),
            "median_seconds": round(statistics.median(ds), 4),
            "max_seconds": round(max(ds), 4),
            "failures_total": int(failures.get(g, 0)),
            "iterations_missed": int(missed_after.get(g, 0) - missed_before.get(g, 0)),
            "rules": len(rules),
            "errors": [
                f"{r.get('name')}: {r.get('lastError')}"
                for r in rules
                if r.get("health") not in ("ok", "unknown") or r.get("lastError")
            ],
        }
    return out


def _seconds(text: str) -> float:
    try:
        return float(text) if re.fullmatch(r"[0-9.]+", text) else duration_seconds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return n


def print_table(r: dict) -> None:
    mem = r["memory"]
    print(
        f"{r['pods']} pods, {r['gpus']} GPUs on {r['nodes']} nodes: {r['head_series']} head series "
        f"({r['exposed_series']} exposed), targets up {r['targets_up']}/{r['targets']}, "
        f"slowest scrape {r['max_scrape_seconds']} s; alerts firing: {', '.join(r['alerts_firing']) or '-'}"
    )
    print(
        f"memory: {mem['resident_bytes'] / 2**20:.0f} MiB resident ({mem['resident_bytes_per_series']} "
        f"B/series), {mem['heap_inuse_bytes'] / 2**20:.0f} MiB Go heap in use "
        f"({mem['heap_bytes_per_series']} B/series); Prometheus used "
        f"{r['prometheus_cpu_seconds_per_second']} CPU-s/s; host: {r['host']['cpus']} CPUs, "
        f"load average {r['host']['load_average_1m']}"
    )
    print("\n| rule group | rules | evaluations | median | max | missed | failures | samples read |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for g, d in r["rule_groups"].items():
        med, top = d["median_seconds"] * 1000, d["max_seconds"] * 1000
        print(
            f"| {g} | {d['rules']} | {d['evaluations']} | {med:.1f} ms | {top:.1f} ms | "
            f"{d['iterations_missed']} | {d['failures_total']} | {d.get('read_samples', '-')} |"
        )
    print("\n| Fleet overview query | series | median time |")
    print("| --- | ---: | ---: |")
    for q in r["queries"]:
        print(f"| {q['panel']} {q.get('ref', '')} | {q['series']} | {q['seconds'] * 1000:.1f} ms |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=_positive, required=True, help="model pods (one GPU each)")
    parser.add_argument("--spec", type=Path, default=ROOT / "fleet.yaml", help="fleet spec (models)")
    parser.add_argument(
        "--warmup",
        type=_seconds,
        default=330.0,
        help="seconds before measuring; the 5m alert windows should fill (default 330)",
    )
    parser.add_argument("--measure", type=_seconds, default=120.0, help="seconds of evaluations to record")
    parser.add_argument("--scrape-interval", type=_seconds, default=None, help="default: the spec's")
    parser.add_argument("--eval-interval", type=_seconds, default=None, help="default: the spec's")
    parser.add_argument(
        "--query-repeats", type=_positive, default=3, help="runs of each overview query (median; default 3)"
    )
    parser.add_argument(
        "--rules",
        type=Path,
        default=RULES_DIR,
        help="directory of *.rules.yml to load (default alert_rules/generated); another one, such as "
        "an earlier commit's, measures a change to the rules on the same fleet",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    rule_files = sorted(args.rules.glob("*.rules.yml")) if args.rules.is_dir() else []
    if not rule_files:
        print(f"fleet_scale: --rules {args.rules}: no *.rules.yml files there", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C, so Prometheus and the exporter are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        spec = load_spec(args.spec)
    except Exception as exc:  # the spec loader's errors are one line already
        print(f"fleet_scale: {exc}", file=sys.stderr)
        return 2
    opts = Options(
        pods=args.pods,
        warmup=args.warmup,
        measure=args.measure,
        scrape_interval=args.scrape_interval or duration_seconds(spec.prometheus.scrape_interval),
        eval_interval=args.eval_interval or duration_seconds(spec.prometheus.evaluation_interval),
        spec_path=args.spec,
        query_repeats=args.query_repeats,
        rule_files=rule_files,
    )
    result = run(opts)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
