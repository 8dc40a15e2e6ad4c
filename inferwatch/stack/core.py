"""The local stack: Triton, the sidecar, the GPU exporter, the pager receiver,
Alertmanager and Prometheus, started in dependency order on loopback ports.

Order: the model server first (the sidecar refuses to be ready without an upstream),
then the sidecar and the GPU exporter (the scrape targets), then the receivers from the
end of the alert path backwards (pager, Alertmanager, Prometheus), so that no alert is
ever sent to something that is not listening yet.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from inferwatch import logs
from inferwatch.paths import STATE_DIR_ENV, state_dir
from inferwatch.spec import FleetSpec, SpecError, load_spec_for_cli
from inferwatch.stack import config as cfg
from inferwatch.stack.supervisor import Component, ProcId, RestartPolicy, Running, Supervisor, alive

STACK_FILE = "stack.json"
SPEC_COPY = "spec.yaml"  # the spec the running stack was generated from
# Subcommands of the other components that the stack runs.
COMPONENT_COMMANDS = ("triton", "sidecar", "gpu-exporter", "pager")
BINARIES = {"prometheus": "prometheus", "prometheus-alertmanager": "prometheus-alertmanager"}
DEFAULT_READY_TIMEOUT = 180.0  # seconds each component may take to become healthy

log = logs.get("inferwatch.stack")


class StackError(Exception):
    """Something the user must fix before the stack can start; one line."""


def default_state_dir() -> Path:
    return state_dir() / "stack"


@dataclass
class StackConfig:
    spec_path: Path
    state_dir: Path = field(default_factory=default_state_dir)
    ports: dict[str, int] = field(default_factory=lambda: dict(cfg.DEFAULT_PORTS))
    gpu_backend: str = "auto"  # auto | nvml | simulated
    host: str = "127.0.0.1"
    ready_timeout: float = DEFAULT_READY_TIMEOUT
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    # ``up --llm``: the real vLLM (``inferwatch vllm``) and an LLM sidecar of its own.
    llm: bool = False
    kv_cache_gib: int | None = None  # vLLM's KV cache in GiB; None: config.LLM_KV_CACHE_BLOCKS

    @property
    def port_names(self) -> tuple[str, ...]:
        return cfg.port_names(self.llm)


@dataclass
class StackInfo:
    """What ``stack.json`` says about a running stack: enough for the demo (or a user) to
    find every component."""

    state_dir: Path
    spec_path: Path
    ports: dict[str, int]
    host: str
    supervisor_pid: int
    gpu_backend: str
    started_at: float
    pids: dict[str, int] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)  # by component, since the start
    llm: bool = False  # vLLM and the LLM sidecar run too

    def url(self, port: str, path: str = "") -> str:
        return f"http://{self.host}:{self.ports[port]}{path}"

    @property
    def prometheus_url(self) -> str:
        return self.url("prometheus")

    @property
    def alertmanager_url(self) -> str:
        return self.url("alertmanager")

    @property
    def alertmanager_urls(self) -> dict[str, str]:
        """Each clustered Alertmanager's base URL, by component name."""
        return {name: self.url(web) for name, web, _g, _p in cfg.ALERTMANAGERS}

    @property
    def pager_url(self) -> str:
        return self.url("pager")

    @property
    def gpu_exporter_url(self) -> str:
        return self.url("gpu_exporter")

    @property
    def sidecar_http(self) -> str:
        """host:port of the sidecar's HTTP listener, as tritonclient takes it."""
        return f"{self.host}:{self.ports['sidecar_http']}"

    @property
    def llm_sidecar_url(self) -> str:
        """The LLM sidecar's OpenAI-compatible base URL (in front of vLLM)."""
        return self.url("llm_sidecar_http")

    @property
    def token_file(self) -> Path:
        return self.state_dir / "pager.token"

    @property
    def faults_state_dir(self) -> Path:
        """The state dir Triton reads its faults from."""
        return self.state_dir

    @property
    def spec_in_use(self) -> Path:
        """The copy of the spec the stack was started with (the original may change since)."""
        return self.state_dir / SPEC_COPY

    def spec(self) -> FleetSpec:
        return load_spec_for_cli(self.spec_in_use if self.spec_in_use.exists() else self.spec_path)

    def to_json(self) -> dict:
        return {
            "state_dir": str(self.state_dir),
            "spec_path": str(self.spec_path),
            "ports": self.ports,
            "host": self.host,
            "supervisor_pid": self.supervisor_pid,
            "gpu_backend": self.gpu_backend,
            "started_at": self.started_at,
            "pids": self.pids,
            "restarts": self.restarts,
            "llm": self.llm,
        }

    @classmethod
    def from_json(cls, data: Mapping) -> StackInfo:
        return cls(
            state_dir=Path(data["state_dir"]),
            spec_path=Path(data["spec_path"]),
            ports={k: int(v) for k, v in data["ports"].items()},
            host=data["host"],
            supervisor_pid=int(data["supervisor_pid"]),
            gpu_backend=data["gpu_backend"],
            started_at=float(data["started_at"]),
            pids={k: int(v) for k, v in data.get("pids", {}).items()},
            restarts={k: int(v) for k, v in data.get("restarts", {}).items()},
            llm=bool(data.get("llm", False)),
        )


def running_stack(state: Path) -> StackInfo | None:
    """The stack running from ``state``, if its supervisor is alive."""
    try:
        info = StackInfo.from_json(json.loads((state / STACK_FILE).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        os.kill(info.supervisor_pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return info


def parse_port_overrides(items: list[str]) -> dict[str, int]:
    """``NAME=PORT`` items (e.g. ``prometheus=19090``) as a dict; ValueError names the bad one."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in cfg.DEFAULT_PORTS:
            raise ValueError(
                f"--port {item!r}: expected NAME=PORT with NAME one of {', '.join(cfg.DEFAULT_PORTS)}"
            )
        if not value.isdigit() or not 0 < int(value) < 65536:
            raise ValueError(f"--port {item!r}: {value!r} is not a TCP port (1-65535)")
        out[name] = int(value)
    return out


def free_ports(host: str = "127.0.0.1") -> dict[str, int]:
    """A free port for every component (held open together so no two are the same)."""
    socks = []
    try:
        for _ in cfg.DEFAULT_PORTS:
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return {name: s.getsockname()[1] for name, s in zip(cfg.DEFAULT_PORTS, socks, strict=True)}
    finally:
        for s in socks:
            s.close()


def _port_taken(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.errno in (errno.EADDRINUSE, errno.EACCES)
    return False


def _missing_commands(names: Iterable[str]) -> list[str]:
    """The commands among ``names`` whose component module is not installed (found, not imported)."""
    from inferwatch.cli import COMMANDS

    return [n for n in names if n not in COMMANDS or importlib.util.find_spec(COMMANDS[n]) is None]


class Stack:
    """Prepare, start, watch and stop the local stack. Use as a context manager, or call
    ``start()`` and ``stop()``."""

    def __init__(self, config: StackConfig, stop_event: threading.Event | None = None) -> None:
        self.config = config
        self.supervisor = Supervisor(stop_event, config.restart)
        self.info: StackInfo | None = None
        self.spec: FleetSpec | None = None
        self._dir = config.state_dir

    # -- before anything starts ------------------------------------------------------
    def preflight(self) -> FleetSpec:
        """Every check that can fail without starting a process; raises StackError."""
        c = self.config
        try:
            spec = load_spec_for_cli(c.spec_path)
        except SpecError as exc:
            raise StackError(str(exc)) from None
        missing = [b for b in BINARIES if shutil.which(b) is None]
        if missing:
            pkgs = " ".join(BINARIES[b] for b in missing)
            raise StackError(
                f"{', '.join(missing)} not found on PATH: run scripts/bootstrap "
                f"(or apt-get install {pkgs}) and try again"
            )
        other = running_stack(c.state_dir)
        if other is not None:
            raise StackError(
                f"a stack is already running from {c.state_dir} (pid {other.supervisor_pid}): "
                f"stop it (Ctrl-C in its terminal, or kill -TERM {other.supervisor_pid}) or pass --state-dir"
            )
        used = {n: c.ports[n] for n in c.port_names}
        dupes = sorted({p for p in used.values() if list(used.values()).count(p) > 1})
        if dupes:
            names = [n for n, p in used.items() if p == dupes[0]]
            raise StackError(f"port {dupes[0]} is given to both {names[0]} and {names[1]}: give each its own")
        if c.llm:
            from reference_server.llm.vllm_server import DEFAULT_MODEL_DIR, DEFAULT_VENV

            if not (DEFAULT_VENV / "bin" / "python").exists() or not DEFAULT_MODEL_DIR.is_dir():
                raise StackError(
                    f"--llm needs vLLM in {DEFAULT_VENV} and its tiny model: run scripts/bootstrap"
                )
        for name in c.port_names:
            port = c.ports[name]
            if _port_taken(c.host, port):
                raise StackError(
                    f"port {port} ({name}) is already in use on {c.host}: stop what listens there "
                    f"(ss -ltnp 'sport = :{port}') or pick another with --port {name}=PORT (or --free-ports)"
                )
        absent = _missing_commands((*COMPONENT_COMMANDS, *(("vllm",) if c.llm else ())))
        if absent:
            raise StackError(
                f"this inferwatch has no {', '.join(absent)} command: the component is not installed; "
                "reinstall with scripts/bootstrap"
            )
        try:
            c.state_dir.mkdir(parents=True, exist_ok=True)
            probe = c.state_dir / ".write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            raise StackError(f"state dir {c.state_dir} is not writable: {exc.strerror}") from None
        self.spec = spec
        return spec

    def prepare(self) -> None:
        """Generate the rules, the Prometheus and Alertmanager configs and the token."""
        assert self.spec is not None, "preflight() first"
        from alert_rules import generate

        spec, c, d = self.spec, self.config, self._dir
        # Everything of this stack (rules, routes, the sidecar's SLAs, the demo's timings)
        # reads one copy, so editing the original while the stack runs changes nothing.
        d.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(c.spec_path, d / SPEC_COPY)
        token_file = d / "pager.token"
        cfg.pager_token(token_file)
        gen_dir = d / "generated"
        if gen_dir.exists():
            shutil.rmtree(gen_dir)  # only what this spec generates
        # One pass of the alerting engineer's generator gives the rules, alertmanager.yml and
        # its templates; the spec it is given routes every receiver to this stack's pager.
        pager_url = f"http://{c.host}:{c.ports['pager']}/webhook"
        local_spec = cfg.local_routing(spec, pager_url, token_file)
        generate.build(local_spec, gen_dir, pager_token_file=str(token_file))
        rule_files = generate.rule_files(gen_dir)
        if not rule_files or not (gen_dir / "alertmanager.yml").is_file():
            raise StackError(f"the rule generator wrote no rule files or alertmanager.yml into {gen_dir}")
        prom = cfg.prometheus_config(spec, c.ports, rule_files, c.host, llm=c.llm)
        cfg.write_yaml(d / "prometheus" / "prometheus.yml", prom)
        log.info("generated configs", rules=len(rule_files), dir=str(d))

    def components(self) -> list[Component]:
        c, d, p, h = self.config, self._dir, self.config.ports, self.config.host
        log_dir = d / "logs"
        inferwatch = [sys.executable, "-m", "inferwatch.cli"]
        # Children find the fault state (and anything else per-stack) under the stack's dir.
        env = {STATE_DIR_ENV: str(d), "PYTHONUNBUFFERED": "1"}
        venv_bin = str(Path(sys.executable).parent)
        env["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
        t = c.ready_timeout

        def url(port: str, path: str = "") -> str:
            return f"http://{h}:{p[port]}{path}"

        llm = []
        if c.llm:
            # A cache of whole GiB when asked for, else the small one the LLM demo saturates.
            kv = (
                ("--kv-cache-blocks", str(cfg.LLM_KV_CACHE_BLOCKS))
                if c.kv_cache_gib is None
                else ("--kv-cache-gib", f"{c.kv_cache_gib}")
            )
            kv += ("--scheduling-policy", cfg.LLM_SCHEDULING_POLICY)
            llm = [
                Component(
                    "vllm",
                    [
                        *inferwatch, "vllm", "--host", h, "--port", str(p["vllm"]), *kv,
                        "--log-file", str(log_dir / "vllm-server.log"), "--ready-timeout", f"{max(t, 240):g}",
                    ],
                    # vLLM takes 35 to 120 s here: its own readiness wait, not the stack's default.
                    url("vllm", "/v1/models"), log_dir / "vllm.log", env, max(t, 240),
                    url=f"{url('vllm', '/v1')} (OpenAI API), {url('vllm', '/metrics')}",
                ),
                Component(
                    "llm-sidecar",
                    [
                        # vLLM speaks HTTP only: the LLM sidecar runs no gRPC proxy (port 0).
                        *inferwatch, "sidecar", "--host", h,
                        "--upstream-http", f"{h}:{p['vllm']}", "--upstream-grpc", f"{h}:{p['vllm']}",
                        "--http-port", str(p["llm_sidecar_http"]), "--grpc-port", "0",
                        "--metrics-port", str(p["llm_sidecar_metrics"]), "--spec", str(d / SPEC_COPY),
                    ],
                    url("llm_sidecar_metrics", "/readyz"), log_dir / "llm-sidecar.log", env, t,
                    url=url("llm_sidecar_http", "/v1"),
                ),
            ]  # fmt: skip
        return [
            Component(
                "triton",
                [
                    *inferwatch, "triton", "--host", h,
                    "--http-port", str(p["triton_http"]), "--grpc-port", str(p["triton_grpc"]),
                    "--metrics-port", str(p["triton_metrics"]),
                    "--log-file", str(log_dir / "tritonserver.log"), "--state-dir", str(d),
                    "--ready-timeout", f"{t:g}",
                ],
                url("triton_http", "/v2/health/ready"), log_dir / "triton.log", env, t,
                url=url("triton_metrics", "/metrics"),
            ),
            Component(
                "sidecar",
                [
                    *inferwatch, "sidecar", "--host", h,
                    "--upstream-http", f"{h}:{p['triton_http']}",
                    "--upstream-grpc", f"{h}:{p['triton_grpc']}",
                    "--http-port", str(p["sidecar_http"]), "--grpc-port", str(p["sidecar_grpc"]),
                    "--metrics-port", str(p["sidecar_metrics"]), "--spec", str(d / SPEC_COPY),
                ],
                url("sidecar_metrics", "/readyz"), log_dir / "sidecar.log", env, t,
                url=f"{url('sidecar_http')} (HTTP), {h}:{p['sidecar_grpc']} (gRPC)",
            ),
            *llm,
            Component(
                "gpu-exporter",
                [*inferwatch, "gpu-exporter", "--host", h, "--port", str(p["gpu_exporter"]),
                 "--backend", c.gpu_backend],
                url("gpu_exporter", "/healthz"), log_dir / "gpu-exporter.log", env, t,
                url=url("gpu_exporter", "/metrics"),
            ),
            Component(
                "pager",
                [*inferwatch, "pager", "--host", h, "--port", str(p["pager"]),
                 "--db", str(d / "pager.sqlite"), "--token-file", str(d / "pager.token")],
                url("pager", "/healthz"), log_dir / "pager.log", env, t,
                url=url("pager", "/"),
            ),
            *(
                Component(
                    name,
                    [
                        "prometheus-alertmanager",
                        f"--config.file={d / 'generated' / 'alertmanager.yml'}",
                        f"--storage.path={d / name / 'data'}",
                        f"--web.listen-address={h}:{p[web]}",
                        f"--web.external-url={url(web)}",
                        # Gossip on ports of our own: the default (0.0.0.0:9094) is the second
                        # instance's web port, and every interface is more than loopback needs.
                        f"--cluster.listen-address={h}:{p[gossip]}",
                        f"--cluster.peer={h}:{p[peer]}",
                        # How long the second in line waits for the first to notify before it
                        # does (default 15 s, sized for remote receivers): the one receiver
                        # here is the pager on loopback. It is also how long a flush that
                        # missed the resolve is held before it checks the notification log:
                        # the shorter, the rarer a stale firing after the other's resolved
                        # (see inferwatch/stack/README.md).
                        f"--cluster.peer-timeout={cfg.PEER_TIMEOUT}",
                        "--log.format=json",
                    ],
                    url(web, "/-/ready"), log_dir / f"{name}.log", {}, t,
                    url=url(web),
                )
                for name, web, gossip, peer in cfg.ALERTMANAGERS
            ),
            Component(
                "prometheus",
                [
                    "prometheus",
                    f"--config.file={d / 'prometheus' / 'prometheus.yml'}",
                    f"--storage.tsdb.path={d / 'prometheus' / 'data'}",
                    f"--web.listen-address={h}:{p['prometheus']}",
                    f"--web.external-url={url('prometheus')}",
                    "--enable-feature=exemplar-storage",
                    "--web.enable-lifecycle",
                    "--log.format=json",
                ],
                url("prometheus", "/-/ready"), log_dir / "prometheus.log", {}, t,
                url=url("prometheus"),
            ),
        ]  # fmt: skip

    # -- running ------------------------------------------------------------------------
    def start(self, on_progress: Callable[[str, str, float], None] | None = None) -> StackInfo:
        """Preflight, prepare, then start each component and wait until it is healthy.
        On any failure, whatever started is stopped again before the error is raised."""
        if self.spec is None:
            self.preflight()
        self.prepare()
        c = self.config
        started_at = time.time()
        try:
            for comp in self.components():
                if on_progress:
                    on_progress(comp.name, "starting", 0.0)
                running = self.supervisor.start(comp)
                took = self.supervisor.wait_ready(
                    running, (lambda s, n=comp.name: on_progress(n, "waiting", s)) if on_progress else None
                )
                if on_progress:
                    on_progress(comp.name, "ready", took)
        except BaseException:
            self.stop()
            raise
        self.info = StackInfo(
            state_dir=c.state_dir,
            spec_path=Path(c.spec_path).resolve(),
            ports={n: c.ports[n] for n in c.port_names},
            host=c.host,
            supervisor_pid=os.getpid(),
            gpu_backend=c.gpu_backend,
            started_at=started_at,
            pids={r.component.name: r.proc.pid for r in self.supervisor.running},
            llm=c.llm,
        )
        self._write_info()
        return self.info

    def _write_info(self) -> None:
        assert self.info is not None
        tmp = self.config.state_dir / (STACK_FILE + ".tmp")
        tmp.write_text(json.dumps(self.info.to_json(), indent=2))
        tmp.replace(self.config.state_dir / STACK_FILE)

    def check(self) -> Running | None:
        """A component that exited by itself (the stack is then broken), else None."""
        return self.supervisor.check()

    def supervise(self) -> list[Running]:
        """Restart what died (supervisor.Supervisor.supervise; raises GaveUp), and keep
        ``stack.json``'s pids and restart counts current."""
        changed = self.supervisor.supervise()
        if changed and self.info is not None:
            running = self.supervisor.running
            self.info.pids = {r.component.name: r.proc.pid for r in running}
            self.info.restarts = {r.component.name: r.restarts for r in running if r.restarts}
            self._write_info()
        return changed

    def processes(self) -> set[ProcId]:
        """Every process the stack has spawned (and their descendants) seen so far."""
        return self.supervisor.all_seen()

    def stop(self, timeout: float = 15.0) -> list[ProcId]:
        """Stop in reverse order; returns processes that survived (empty unless broken)."""
        survivors = self.supervisor.stop_all(timeout)
        try:
            (self.config.state_dir / STACK_FILE).unlink()
        except FileNotFoundError:
            pass
        if survivors:
            log.error("processes survived the stop", pids=",".join(str(p[0]) for p in survivors))
        return [p for p in survivors if alive(p)]

    def components_table(self) -> list[tuple[str, str, int, Path]]:
        return [
            (r.component.name, r.component.url, r.proc.pid, r.component.log_path)
            for r in self.supervisor.running
        ]

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
