"""``inferwatch sidecar``: parse the configuration, build the parts, run until SIGTERM.

Parts: one ``Telemetry`` (sidecar.core.telemetry) on its own registry, the metrics server
(``/metrics`` in the OpenMetrics exposition when the scraper asks for it, so exemplars
show; ``/healthz``; ``/readyz``) on a thread, the HTTP proxy (``sidecar.protocols.http1.serve``)
and, when ``sidecar.protocols.grpc_aio`` exists and ``--grpc-port`` is not 0, the gRPC proxy
(``sidecar.protocols.grpc_aio.serve``). Both proxies share the contract::

    server = await serve(config, telemetry)   # listening when it returns
    server.begin_drain()                      # optional: SIGTERM came, still accepting
    await server.stop(grace)                  # stop accepting, drain in-flight up to grace s

A background task reads the upstream's repository index (``POST /v2/repository/index``)
every ``--model-refresh-interval`` seconds, and soon after a request names a model the
sidecar does not know, so the ``model`` label follows what the upstream serves.

``/readyz`` is 200 once the proxies listen, the upstream answered ``GET /v2/health/ready``
and its index has been read (``Readiness``); 503 before and from SIGTERM on.

SIGTERM/SIGINT: ``/readyz`` turns 503 and each proxy's ``begin_drain()`` (when it has one)
makes its answers close their connections; the listeners keep accepting for
``--drain-delay`` seconds (a second signal cuts that short), then the proxies stop accepting
and drain what is in flight (at most ``--drain-timeout``), spans are flushed, the process
exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import gc
import json
import logging
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from inferwatch import logs
from inferwatch.cli import CliError
from sidecar import config as cfg

log = logging.getLogger("inferwatch.sidecar")

# Wait at least this long between two index reads triggered by unknown model names.
MISS_REFRESH_MIN_INTERVAL = 5.0
# While the upstream is down, probe it this often; while up, this often between index reads.
DOWN_PROBE_INTERVAL = 1.0
UP_PROBE_INTERVAL = 5.0
# Until the upstream is ready and its index read (/readyz 503), ask it this often.
NOT_READY_PROBE_INTERVAL = 0.25
# Seconds an index read (the repository index, or /v1/models) may take beyond --connect-timeout:
# the answer lists every model, so a large repository's body takes longer than a probe's.
INDEX_READ_EXTRA_S = 5.0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sidecar",
        help="run the request-metrics proxy in front of a model server",
        description=(
            "A transparent HTTP and gRPC proxy for a model server (Triton or any KServe v2 server). "
            "It labels each request with its model and version and exports RED metrics, latency "
            "histograms with trace exemplars and OpenTelemetry spans, without touching payloads. "
            "Every flag can also be set by its INFERWATCH_* environment variable."
        ),
    )
    cfg.add_arguments(parser)
    parser.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    return serve_config(_config(args))


def _config(args: argparse.Namespace) -> cfg.SidecarConfig:
    try:
        return cfg.from_args(args)
    except cfg.ConfigError as exc:
        raise CliError(str(exc), code=2) from None


def serve_config(config: cfg.SidecarConfig) -> int:
    """Run the sidecar until SIGTERM/SIGINT; the process exit code."""
    logs.setup(config.log_level)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints every thread's stack to stderr
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency; plain asyncio still works
        runner = asyncio.run
    try:
        return runner(run(config))
    except OSError as exc:  # a proxy port in use, an address that cannot be bound
        raise CliError(f"cannot listen: {exc}") from None


def build_tracer(config: cfg.SidecarConfig) -> tuple[Any, Any]:
    """(tracer, provider) when --trace-sample-ratio > 0, else (None, None): no cost when off.

    The exporter follows OTEL_TRACES_EXPORTER (otlp by default, console, none) and the
    OTLP exporter reads OTEL_EXPORTER_OTLP_* itself; the service name defaults to
    inferwatch-sidecar unless OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES say otherwise.
    """
    if config.trace_sample_ratio <= 0:
        return None, None

    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", "inferwatch-sidecar")})
    provider = TracerProvider(
        resource=resource, sampler=ParentBased(TraceIdRatioBased(config.trace_sample_ratio))
    )
    kind = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
    if kind == "console":
        provider.add_span_processor(
            BatchSpanProcessor(ConsoleSpanExporter(formatter=lambda s: s.to_json(indent=None) + "\n"))
        )
    elif kind == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    elif kind != "none":
        raise CliError(f"OTEL_TRACES_EXPORTER: {kind!r} is not one of otlp, console, none", code=2)
    return provider.get_tracer("inferwatch.sidecar"), provider


class Readiness:
    """What ``/readyz`` answers: ready once the proxies listen, the upstream said it is ready
    and its model index has been read (so the first requests are labelled by model), and
    no longer from the moment SIGTERM arrives. Written by the event loop, read by the
    metrics thread (plain attribute reads)."""

    def __init__(self) -> None:
        self.listening = False
        self.upstream_ready = False
        self.index_read = False
        self.draining = False
        self.upstream = "not checked yet"  # the upstream's last readiness answer, for people
        self.proxies: list[str] = []

    @property
    def ready(self) -> bool:
        return self.listening and self.upstream_ready and self.index_read and not self.draining

    def report(self) -> dict[str, Any]:
        return {
            "ready": self.ready,
            "proxies": self.proxies,
            "upstream": self.upstream,
            "model_index_read": self.index_read,
            "draining": self.draining,
        }


class MetricsServer:
    """/metrics, /healthz and /readyz on their own port and thread, so a scrape never waits
    on proxy traffic and a stuck proxy still answers health checks."""

    def __init__(self, host: str, port: int, registry: Any, readiness: Readiness) -> None:
        from prometheus_client.exposition import choose_encoder

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    encoder, ctype = choose_encoder(self.headers.get("Accept", ""))
                    self._send(200, encoder(registry), ctype)
                elif path == "/healthz":
                    self._send(200, b"ok\n", "text/plain")
                elif path == "/readyz":
                    report = readiness.report()
                    body = json.dumps(report).encode() + b"\n"
                    self._send(200 if report["ready"] else 503, body, "application/json")
                else:
                    self._send(404, b"not found: try /metrics, /healthz or /readyz\n", "text/plain")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # scrapes and probes are not news

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="metrics", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


async def upstream_exchange(
    host: str, port: int, method: str, path: str, body: bytes, timeout: float
) -> tuple[int, bytes]:
    """(status, body) of one request on its own connection (``Connection: close``), status 0
    for an answer that is not HTTP; raises OSError when unreachable, TimeoutError."""
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n"
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    request = (head + "\r\n").encode() + body

    async def go() -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(request)
            raw = await reader.read(16 * 1024 * 1024)
            while True:  # read to EOF (Connection: close), bounded
                more = await reader.read(1 << 20)
                if not more or len(raw) > 16 * 1024 * 1024:
                    break
                raw += more
        finally:
            writer.close()
        status_line, _, rest = raw.partition(b"\r\n")
        parts = status_line.split()
        if len(parts) < 2 or not parts[1].isdigit():
            return 0, b""
        headers, _, payload = rest.partition(b"\r\n\r\n")
        if b"transfer-encoding: chunked" in headers.lower():
            payload = _dechunk(payload)
        return int(parts[1]), payload

    return await asyncio.wait_for(go(), timeout)


async def fetch_repository_index(host: str, port: int, timeout: float) -> tuple[int, Any]:
    """(status, parsed JSON or None) of ``POST /v2/repository/index`` for ready models; raises
    OSError when unreachable."""
    # {"ready": true}: the models it serves now, not every one in its repository
    status, payload = await upstream_exchange(
        host, port, "POST", "/v2/repository/index", b'{"ready": true}', timeout
    )
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, None


def _dechunk(data: bytes) -> bytes:
    out, pos = [], 0
    while True:
        end = data.find(b"\r\n", pos)
        if end < 0:
            break
        size = int(data[pos:end].split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out.append(data[end + 2 : end + 2 + size])
        pos = end + 2 + size + 2
    return b"".join(out)


async def fetch_openai_models(host: str, port: int, timeout: float) -> list[str] | None:
    """The ids of an OpenAI-compatible server's ``GET /v1/models``, None when it has none."""
    status, payload = await upstream_exchange(host, port, "GET", "/v1/models", b"", timeout)
    try:
        data = json.loads(payload).get("data") if status == 200 else None
    except (ValueError, AttributeError):
        return None
    if not isinstance(data, list):
        return None
    return [e["id"] for e in data if isinstance(e, dict) and isinstance(e.get("id"), str)]


async def _read_index(config: cfg.SidecarConfig, telemetry: Any, streams: Any = None) -> tuple[bool, str]:
    """Read the upstream's ready models into telemetry (the KServe repository index, else an
    OpenAI server's ``/v1/models`` through the spec's served names); (reachable, error text)."""
    host, port = config.upstream_http
    try:
        status, data = await fetch_repository_index(host, port, config.connect_timeout + INDEX_READ_EXTRA_S)
    except (OSError, TimeoutError) as exc:
        return False, str(exc) or type(exc).__name__
    if status == 200 and isinstance(data, list):
        served: dict[str, list[str]] = {}
        for entry in data:
            if isinstance(entry, dict) and isinstance(entry.get("name"), str):
                served.setdefault(entry["name"], [])
                if entry.get("version"):
                    served[entry["name"]].append(str(entry["version"]))
        telemetry.update_models(served)
        return True, ""
    if status in (404, 405, 501) or (status and status < 500 and data is None):
        names = None
        if streams is not None:  # an OpenAI-compatible server (vLLM, SGLang, TGI...)?
            try:
                names = await fetch_openai_models(host, port, config.connect_timeout + INDEX_READ_EXTRA_S)
            except (OSError, TimeoutError) as exc:
                return False, str(exc) or type(exc).__name__
        if names is not None:
            telemetry.update_models(streams.served_models(names))
            return True, ""
        telemetry.update_models(None, supported=False)  # no index: names are admitted up to the cap
        return True, ""
    return 0 < status < 500, f"HTTP {status}"


async def _upstream_ready(config: cfg.SidecarConfig) -> tuple[bool, str]:
    """Whether the upstream says it is ready (KServe ``GET /v2/health/ready``); a server
    without that endpoint (404, 405, 501) counts as ready once it answers at all."""
    host, port = config.upstream_http
    try:
        # A server still starting may accept and not answer: give up soon and ask again.
        timeout = config.connect_timeout
        status, _ = await upstream_exchange(host, port, "GET", "/v2/health/ready", b"", timeout)
    except (OSError, TimeoutError) as exc:
        return False, f"unreachable: {exc or type(exc).__name__}"
    if status == 200 or status in (404, 405, 501):
        return True, "ready"
    return False, f"not ready: HTTP {status}"


async def refresh_models(
    config: cfg.SidecarConfig,
    telemetry: Any,
    wake: asyncio.Event,
    readiness: Readiness,
    streams: Any = None,
    health: Any = None,
) -> None:
    """Keep telemetry's served-model set equal to the upstream's repository index and
    ``upstream_up`` current even without traffic, and mark ``readiness`` once the upstream
    is ready and its index has been read.

    Until then the upstream's readiness is asked every ``NOT_READY_PROBE_INTERVAL``. After,
    the index is read every ``--model-refresh-interval``, when the upstream comes back, and at
    most ``MISS_REFRESH_MIN_INTERVAL`` after a request named an unknown model (``wake``);
    between reads, ``health`` (``sidecar.core.health``: the gauge's one writer and its one probe)
    says whether the upstream is up; what each read saw is reported to it.
    """
    from sidecar.core.health import UpstreamHealth
    from sidecar.core.telemetry import UPSTREAM_HTTP

    if health is None:
        health = UpstreamHealth(telemetry, {UPSTREAM_HTTP: config.upstream_http}, config.connect_timeout)
    loop = asyncio.get_running_loop()
    where = "{}:{}".format(*config.upstream_http)
    up: bool | None = None
    last_index = -1e9
    while True:
        now = loop.time()
        if not (readiness.upstream_ready and readiness.index_read):
            ready, said = await _upstream_ready(config)
            readiness.upstream = said
            readiness.upstream_ready = ready
            if ready:
                now_up, err = await _read_index(config, telemetry, streams)
                last_index = now
                readiness.index_read = telemetry.catalog.index_read
                if readiness.index_read:
                    log.info("upstream ready, model index read", extra={"fields": {"upstream": where}})
            else:
                now_up, err = not said.startswith("unreachable"), said
        elif up is not True or wake.is_set() or now - last_index >= config.model_refresh_interval:
            wake.clear()
            now_up, err = await _read_index(config, telemetry, streams)
            last_index = now
        else:
            now_up, err = health.is_up(UPSTREAM_HTTP) is not False, ""  # the probe's view
        health.report(UPSTREAM_HTTP, now_up, err)
        up = now_up
        if not (readiness.upstream_ready and readiness.index_read):
            await asyncio.sleep(NOT_READY_PROBE_INTERVAL)
            continue
        if not now_up:
            await asyncio.sleep(DOWN_PROBE_INTERVAL)
            continue
        try:
            await asyncio.wait_for(wake.wait(), UP_PROBE_INTERVAL)
        except TimeoutError:
            pass
        if wake.is_set():  # an unknown model: read the index, but not more often than this
            await asyncio.sleep(max(0.0, last_index + MISS_REFRESH_MIN_INTERVAL - loop.time()))


async def run(config: cfg.SidecarConfig) -> int:
    from prometheus_client import CollectorRegistry, disable_created_metrics

    from sidecar.apis.routes import classify
    from sidecar.core import overload
    from sidecar.core.admission import Admission
    from sidecar.core.health import UpstreamHealth
    from sidecar.core.streams import StreamTelemetry
    from sidecar.core.telemetry import UPSTREAM_HTTP, Telemetry
    from sidecar.protocols import grpc_aio, http1

    # No _created series: Prometheus 2.x does not use them, and they were 8% of the
    # sidecar's series (one per counter and histogram child).
    disable_created_metrics()
    registry = CollectorRegistry()
    tracer, provider = build_tracer(config)
    telemetry = Telemetry(registry, config, tracer)
    streams = StreamTelemetry(registry, config, telemetry, classify)
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    telemetry.on_unknown_model = wake.set

    readiness = Readiness()
    try:
        metrics = MetricsServer(config.host, config.metrics_port, registry, readiness)
    except OSError as exc:
        raise CliError(
            f"cannot listen on {config.host}:{config.metrics_port} (--metrics-port): {exc.strerror}"
        ) from None
    metrics.start()
    servers: list[tuple[str, Any]] = []
    # upstream_up's one writer and one probe, for every upstream (the gRPC side adds its own).
    health = UpstreamHealth(telemetry, {UPSTREAM_HTTP: config.upstream_http}, config.connect_timeout)
    refresher = asyncio.create_task(refresh_models(config, telemetry, wake, readiness, streams, health))
    try:
        # One limit for every protocol, and the spec's per-model limits (sidecar.core.overload).
        admission = Admission(
            config.max_in_flight, overload.limits_of(config.spec), telemetry.model_label, registry
        )
        servers.append(("http", await http1.serve(config, telemetry, admission, streams, health)))
        if config.grpc_proxy_enabled:
            servers.append(("grpc", await grpc_aio.serve(config, telemetry, admission, streams, health)))
        health.start()
    except BaseException:
        refresher.cancel()
        health.stop()
        for _, server in servers:
            await server.stop(0)
        metrics.stop()
        raise

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, overload.reload_limits, admission, config.spec_path)
    readiness.proxies = [name for name, _ in servers]
    # Everything built so far lives as long as the process: keep the collector from walking it
    # (a full collection of these ~40k objects costs ~12 ms, a tail-latency spike mid-request).
    gc.collect()
    gc.freeze()
    readiness.listening = True
    log.info(
        "sidecar started",
        extra={
            "fields": {
                "http": f"{config.host}:{config.http_port}",
                "grpc": f"{config.host}:{config.grpc_port}" if len(servers) > 1 else None,
                "metrics": f"{config.host}:{config.metrics_port}",
                "upstream_http": "{}:{}".format(*config.upstream_http),
                "upstream_grpc": "{}:{}".format(*config.upstream_grpc),
                "tracing": tracer is not None,
            }
        },
    )
    await stop.wait()

    readiness.draining = True
    log.info(
        "draining",
        extra={
            "fields": {
                "in_flight": admission.active,  # sidecar.core.admission: requests admitted, all protocols
                "delay_s": config.drain_delay,
                "grace_s": config.drain_timeout,
            }
        },
    )
    for _, server in servers:
        # Answers from now on close their connections; the listeners still accept.
        begin = getattr(server, "begin_drain", None)
        if begin is not None:
            begin()
    if config.drain_delay:
        # Accept for a while with /readyz at 503, so load balancers take the endpoint out
        # before the listeners close; a second signal cuts the wait short.
        stop.clear()
        try:
            await asyncio.wait_for(stop.wait(), config.drain_delay)
        except TimeoutError:
            pass
    started = time.monotonic()
    await asyncio.gather(*(server.stop(config.drain_timeout) for _, server in servers))
    refresher.cancel()
    health.stop()
    if provider is not None:
        provider.shutdown()
    metrics.stop()
    log.info(
        "stopped",
        extra={
            "fields": {
                "drain_s": round(time.monotonic() - started, 3),
                "in_flight_left": admission.active,
                "http_requests": servers[0][1].requests,
            }
        },
    )
    return 0
