"""The exporter's HTTP endpoints: ``GET /metrics``, ``GET /healthz``, ``GET|POST /simulate``.

A small threaded stdlib server keeps the process lean (no web framework for three routes). Each
request has one error boundary: a 500 if the handler fails before answering.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client.registry import CollectorRegistry

from exporters.backends.simulated import SimulatedBackend
from exporters.collector import GpuSource
from exporters.exposition import CONTENT_TYPE, render

log = logging.getLogger("inferwatch.gpu_exporter")

MAX_BODY = 64 * 1024
_JSON = "application/json"
_SIMULATE_KEYS = frozenset({"fb_used_ratio", "load", "gpus", "xid"})


class SimulateError(ValueError):
    """A bad /simulate request; the message is the 400 answer."""


@dataclass(frozen=True, slots=True)
class SimulateRequest:
    gpus: tuple[int, ...]
    changes: dict[str, float | None]  # "fb_used_ratio" / "load" -> value (None clears)
    xid: int | None


def _ratio(body: dict[str, Any], key: str) -> float | None:
    value = body[key]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SimulateError(f"{key} must be a number from 0 to 1, or null to clear it")
    if not 0.0 <= value <= 1.0:
        raise SimulateError(f"{key} must be from 0 to 1, got {value}")
    return float(value)


def parse_simulate(raw: bytes, gpu_count: int) -> SimulateRequest:
    """Validates a /simulate body: ``{"fb_used_ratio": 0.95 | null, "load": 0.7 | null,
    "xid": 79, "gpus": [0, 1]}``; ``gpus`` defaults to every GPU."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SimulateError(f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise SimulateError("body must be a JSON object")
    unknown = sorted(set(body) - _SIMULATE_KEYS)
    if unknown:
        raise SimulateError(
            f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(_SIMULATE_KEYS))}"
        )
    changes = {k: _ratio(body, k) for k in ("fb_used_ratio", "load") if k in body}
    xid = body.get("xid")
    if xid is not None and (isinstance(xid, bool) or not isinstance(xid, int) or not 0 < xid < 2**31):
        raise SimulateError("xid must be a positive integer (an XID code, e.g. 79)")
    if not changes and xid is None:
        raise SimulateError("nothing to simulate: give fb_used_ratio, load or xid")
    gpus = body.get("gpus")
    if gpus is None:
        indexes: tuple[int, ...] = tuple(range(gpu_count))
    else:
        if not isinstance(gpus, list) or not gpus:
            raise SimulateError("gpus must be a non-empty list of GPU indexes")
        for g in gpus:
            if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < gpu_count:
                raise SimulateError(f"gpus: {g!r} is not a GPU index (this exporter has 0..{gpu_count - 1})")
        indexes = tuple(dict.fromkeys(gpus))
    return SimulateRequest(indexes, changes, xid)


class ExporterApp:
    """What the endpoints answer; the HTTP layer only moves bytes."""

    def __init__(self, source: GpuSource, registry: CollectorRegistry) -> None:
        self.source = source
        self.registry = registry

    def metrics(self) -> bytes:
        return render(self.registry.collect())

    def health(self) -> dict[str, Any]:
        return self.source.health()

    def _simulated(self) -> SimulatedBackend | None:
        ready = self.source.ready
        backend = ready.backend if ready else None
        return backend if isinstance(backend, SimulatedBackend) else None

    def simulate(self, method: str, raw: bytes) -> tuple[int, dict[str, Any]]:
        backend = self._simulated()
        if backend is None:
            return 404, {
                "error": f"/simulate needs the simulated backend; this exporter runs {self.source.label}"
            }
        if method == "POST":
            try:
                req = parse_simulate(raw, backend.gpu_count)
            except SimulateError as exc:
                return 400, {"error": str(exc)}
            if "fb_used_ratio" in req.changes:
                backend.set_fb_used_ratio(req.gpus, req.changes["fb_used_ratio"])
            if "load" in req.changes:
                backend.set_load(req.gpus, req.changes["load"])
            if req.xid is not None:
                for g in req.gpus:
                    self.source.xids.record(g, req.xid)
            log.info(
                "simulation changed",
                extra={"fields": {"gpus": list(req.gpus), **req.changes, "xid": req.xid}},
            )
        return 200, {"gpus": backend.state()}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as Prometheus scrapes
    # Headers and body leave in two writes; without TCP_NODELAY the second waits ~40 ms for the
    # client's delayed ACK on every keep-alive scrape.
    disable_nagle_algorithm = True
    server_version = "inferwatch-gpu-exporter"
    app: ExporterApp

    def _send(self, status: int, body: bytes, ctype: str, extra: dict[str, str] | None = None) -> None:
        self._answered = True
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj: Any, extra: dict[str, str] | None = None) -> None:
        self._send(status, (json.dumps(obj) + "\n").encode(), _JSON, extra)

    def _route(self) -> None:
        path = self.path.split("?", 1)[0]
        method = self.command
        if path == "/metrics" and method in ("GET", "HEAD"):
            self._send(200, self.app.metrics(), CONTENT_TYPE)
        elif path == "/healthz" and method in ("GET", "HEAD"):
            self._json(200, self.app.health())
        elif path == "/simulate" and method in ("GET", "POST"):
            raw = b""
            if method == "POST":
                length = self.headers.get("Content-Length")
                if length is None or not length.isdigit():
                    self._json(400, {"error": "POST /simulate needs a Content-Length and a JSON body"})
                    return
                if int(length) > MAX_BODY:
                    self.close_connection = True
                    self._json(413, {"error": f"body over {MAX_BODY} bytes"})
                    return
                raw = self.rfile.read(int(length))
            status, obj = self.app.simulate(method, raw)
            self._json(status, obj)
        elif path in ("/metrics", "/healthz", "/simulate"):
            allow = "GET, POST" if path == "/simulate" else "GET, HEAD"
            self._json(405, {"error": f"{method} not allowed on {path}"}, {"Allow": allow})
        elif path == "/" and method == "GET":
            self._send(200, b"inferwatch GPU exporter: /metrics /healthz /simulate\n", "text/plain")
        else:
            self._json(404, {"error": f"no route {path}"})

    def _handle(self) -> None:
        self._answered = False
        try:
            self._route()
        except Exception:
            log.exception("request failed", extra={"fields": {"path": self.path}})
            self.close_connection = True
            if not self._answered:  # otherwise closing the connection is all that is left
                try:
                    self._json(500, {"error": "internal error"})
                except OSError:
                    pass

    do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = _handle

    def log_message(self, format: str, *args: Any) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request", extra={"fields": {"client": self.client_address[0], "line": format % args}})


class ExporterServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def make_server(app: ExporterApp, host: str, port: int) -> ExporterServer:
    handler = type("Handler", (_Handler,), {"app": app})
    return ExporterServer((host, port), handler)
