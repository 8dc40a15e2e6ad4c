"""The sidecar's configuration: command-line flags, each also an ``INFERWATCH_*`` variable.

A flag wins over its environment variable, which wins over the default. Every value is
checked before anything starts; a bad one becomes one line naming the flag (or variable)
and why (``ConfigError``), which ``inferwatch sidecar`` prints as ``inferwatch: error: ...``.

``SidecarConfig`` is what both proxies read (``sidecar.protocols.http1`` and
``sidecar.protocols.grpc_aio``): addresses, ports, timeouts, limits, routes and the fleet spec.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field

from inferwatch.spec import FleetSpec, SpecError, load_spec_for_cli

ENV_PREFIX = "INFERWATCH_"


class ConfigError(Exception):
    """A configuration the sidecar refuses; ``str()`` is one line."""


@dataclass(frozen=True, slots=True)
class Route:
    """A URL pattern for a non-KServe route: a regex with a ``model`` and optionally a
    ``version`` named group, matched against the request path (query removed)."""

    pattern: re.Pattern[str]


@dataclass(frozen=True)
class SidecarConfig:
    upstream_http: tuple[str, int] = ("127.0.0.1", 8000)
    upstream_grpc: tuple[str, int] = ("127.0.0.1", 8001)
    host: str = "0.0.0.0"
    http_port: int = 8010
    grpc_port: int = 8011
    metrics_port: int = 9110
    spec: FleetSpec = field(default_factory=FleetSpec)
    spec_path: str | None = None
    # Per-model SLA overrides in seconds (``--sla MODEL=MS``), on top of the spec's.
    sla_overrides: dict[str, float] = field(default_factory=dict)
    routes: tuple[Route, ...] = ()
    # Seconds.
    request_timeout: float = 60.0
    connect_timeout: float = 2.0
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keepalive_timeout: float = 75.0
    drain_timeout: float = 30.0
    # After SIGTERM, keep accepting this long (``/readyz`` already 503) before the listeners close.
    drain_delay: float = 0.0
    model_refresh_interval: float = 30.0
    # Limits.
    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 256 * 1024 * 1024
    max_in_flight: int = 1024
    max_connections: int = 4096
    upstream_pool_size: int = 64
    # Tracing: off at 0; OTLP export itself follows the standard OTEL_* variables.
    trace_sample_ratio: float = 0.0
    log_level: str = "info"
    # gRPC proxy engine (sidecar.protocols.grpc_aio.serve): the HTTP/2 frame relay or grpc.aio.
    grpc_engine: str = "relay"

    def latency_sla_seconds(self, model: str) -> float:
        """The model's SLA: the ``--sla`` override, else the spec's (which falls back to its default)."""
        override = self.sla_overrides.get(model)
        return override if override is not None else self.spec.latency_sla_seconds(model)

    def configured_slas(self) -> dict[str, float]:
        """SLA seconds of every model named by the spec or an override."""
        out = {m.name: m.latency_sla_ms / 1000.0 for m in self.spec.models}
        out.update(self.sla_overrides)
        return out

    @property
    def grpc_proxy_enabled(self) -> bool:
        return self.grpc_port > 0


# (flag, dest, type, default, help). The env variable is INFERWATCH_<DEST upper-cased>.
_D = SidecarConfig()
_FLAGS: list[tuple[str, str, str, object, str]] = [
    ("--upstream-http", "upstream_http", "addr", "127.0.0.1:8000", "model server HTTP address HOST:PORT"),
    ("--upstream-grpc", "upstream_grpc", "addr", "127.0.0.1:8001", "model server gRPC address HOST:PORT"),
    ("--host", "host", "str", _D.host, "address the proxies and metrics listen on"),
    ("--http-port", "http_port", "port", _D.http_port, "HTTP proxy port"),
    ("--grpc-port", "grpc_port", "port0", _D.grpc_port, "gRPC proxy port (0 turns the gRPC proxy off)"),
    ("--metrics-port", "metrics_port", "port", _D.metrics_port, "port of /metrics, /healthz, /readyz"),
    (
        "--spec",
        "spec",
        "str",
        None,
        "fleet spec YAML (per-model SLAs, model cap); built-in defaults if unset",
    ),
    (
        "--request-timeout",
        "request_timeout",
        "secs",
        _D.request_timeout,
        "per-request upstream timeout (504)",
    ),
    ("--connect-timeout", "connect_timeout", "secs", _D.connect_timeout, "upstream connect timeout (503)"),
    (
        "--header-timeout",
        "header_timeout",
        "secs",
        _D.header_timeout,
        "time a client has to send headers (408)",
    ),
    ("--body-timeout", "body_timeout", "secs", _D.body_timeout, "longest pause inside a request body (408)"),
    (
        "--keepalive-timeout",
        "keepalive_timeout",
        "secs",
        _D.keepalive_timeout,
        "idle client connections close",
    ),
    ("--drain-timeout", "drain_timeout", "secs", _D.drain_timeout, "on SIGTERM, longest wait for in-flight"),
    (
        "--drain-delay",
        "drain_delay",
        "secs0",
        _D.drain_delay,
        "on SIGTERM, keep accepting this long while /readyz says 503, then drain",
    ),
    (
        "--model-refresh-interval",
        "model_refresh_interval",
        "secs",
        _D.model_refresh_interval,
        "seconds between reads of the upstream's repository index",
    ),
    (
        "--max-header-bytes",
        "max_header_bytes",
        "int",
        _D.max_header_bytes,
        "request line + headers limit (431)",
    ),
    ("--max-body-bytes", "max_body_bytes", "int", _D.max_body_bytes, "request body limit (413)"),
    (
        "--max-in-flight",
        "max_in_flight",
        "int",
        _D.max_in_flight,
        "concurrent requests before the 503 answer",
    ),
    ("--max-connections", "max_connections", "int", _D.max_connections, "client connections before 503"),
    ("--upstream-pool-size", "upstream_pool_size", "int", _D.upstream_pool_size, "idle upstream keep-alives"),
    (
        "--trace-sample-ratio",
        "trace_sample_ratio",
        "ratio",
        _D.trace_sample_ratio,
        "fraction of new traces sampled (0 = tracing off); OTLP via OTEL_* variables",
    ),
    ("--log-level", "log_level", "level", _D.log_level, "debug, info, warning or error"),
    (
        "--grpc-engine",
        "grpc_engine",
        "engine",
        _D.grpc_engine,
        "gRPC proxy engine: relay (HTTP/2 frames) or aio",
    ),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the sidecar's flags; defaults are resolved later so env variables can apply."""
    metavars = {"addr": "HOST:PORT", "port": "PORT", "port0": "PORT", "secs": "SECONDS", "secs0": "SECONDS"}
    metavars["int"] = "N"
    metavars |= {"ratio": "RATIO", "level": "LEVEL", "engine": "ENGINE"}
    for flag, dest, kind, default, help_ in _FLAGS:
        env = ENV_PREFIX + dest.upper()
        metavar = metavars.get(kind) or ("FILE" if dest == "spec" else "ADDRESS")
        parser.add_argument(
            flag, dest=dest, default=None, metavar=metavar, help=f"{help_} (env {env}; default {default})"
        )
    parser.add_argument(
        "--sla",
        dest="sla",
        action="append",
        default=None,
        metavar="MODEL=MS",
        help="latency SLA of a model in ms, overriding the spec; repeatable "
        "(env INFERWATCH_SLA, comma-separated)",
    )
    parser.add_argument(
        "--route",
        dest="route",
        action="append",
        default=None,
        metavar="REGEX",
        help="labels a non-KServe path: a regex with (?P<model>...) and optionally (?P<version>...); "
        "repeatable (env INFERWATCH_ROUTE, separated by spaces)",
    )


def _addr(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host.strip("[]"), _port(port)


def _port(text: str, allow_zero: bool = False) -> int:
    value = int(text)
    if not (0 if allow_zero else 1) <= value <= 65535:
        raise ValueError(f"{value} is not a TCP port")
    return value


def _secs(text: str) -> float:
    value = float(text)
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"{text!r} must be a positive number of seconds")
    return value


def _secs0(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{text!r} must be a number of seconds, 0 or more")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"{value} must be at least 1")
    return value


def _ratio(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{text!r} must be between 0 and 1")
    return value


def _level(text: str) -> str:
    if text.lower() not in ("debug", "info", "warning", "error"):
        raise ValueError(f"{text!r} is not one of debug, info, warning, error")
    return text.lower()


# The gRPC engines (sidecar.protocols.grpc_aio.serve), the default first.
GRPC_ENGINES = ("relay", "aio")


def _engine(text: str) -> str:
    if text not in GRPC_ENGINES:
        raise ValueError(f"{text!r} is not one of {', '.join(GRPC_ENGINES)}")
    return text


_PARSE = {
    "engine": _engine,
    "addr": _addr,
    "str": str,
    "port": _port,
    "port0": lambda t: _port(t, allow_zero=True),
    "secs": _secs,
    "secs0": _secs0,
    "int": _positive_int,
    "ratio": _ratio,
    "level": _level,
}


def _sla(text: str) -> tuple[str, float]:
    name, sep, ms = text.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"{text!r} is not MODEL=MS")
    value = float(ms)
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{text!r}: the SLA must be a positive number of milliseconds")
    return name.strip(), value / 1000.0


def _route(text: str) -> Route:
    try:
        pattern = re.compile(text)
    except re.error as exc:
        raise ValueError(f"{text!r} is not a regular expression: {exc}") from None
    if "model" not in pattern.groupindex:
        raise ValueError(f"{text!r} has no (?P<model>...) group")
    return Route(pattern)


def from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> SidecarConfig:
    """Resolve flags, then ``INFERWATCH_*`` variables, then defaults; raise ConfigError on a bad value."""
    env = os.environ if environ is None else environ
    values: dict[str, object] = {}
    for flag, dest, kind, default, _help in _FLAGS:
        raw = getattr(args, dest, None)
        source = flag
        if raw is None and (ENV_PREFIX + dest.upper()) in env:
            raw, source = env[ENV_PREFIX + dest.upper()], ENV_PREFIX + dest.upper()
        if raw is None:
            raw = default
        if raw is None:
            values[dest] = None
            continue
        try:
            values[dest] = _PARSE[kind](str(raw))
        except ValueError as exc:
            msg = str(exc)
            if msg.startswith(("invalid literal", "could not convert")):
                msg = f"{raw!r} is not a number"
            raise ConfigError(f"{source}: {msg}") from None

    spec_path = values.pop("spec")
    try:
        spec = load_spec_for_cli(spec_path, if_none="built-in")
    except SpecError as exc:
        raise ConfigError(str(exc)) from None

    def listed(dest: str, sep: str | None) -> tuple[list[str], str]:
        items = getattr(args, dest, None)
        if items:
            return list(items), f"--{dest}"
        var = ENV_PREFIX + dest.upper()
        return [s for s in env.get(var, "").split(sep) if s.strip()], var

    slas: dict[str, float] = {}
    items, source = listed("sla", ",")
    for item in items:
        try:
            name, secs = _sla(item)
        except ValueError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        slas[name] = secs
    routes: list[Route] = []
    items, source = listed("route", None)
    for item in items:
        try:
            routes.append(_route(item))
        except ValueError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    return SidecarConfig(
        spec=spec,
        spec_path=str(spec_path) if spec_path else None,
        sla_overrides=slas,
        routes=tuple(routes),
        **values,  # type: ignore[arg-type]
    )
