"""Start and stop a real Triton Inference Server on the reference model repository.

Two start-up traps of the ``tritonserver`` binary carried by the ``nvidia-pytriton`` wheel are
handled here: the Python backend needs the ``triton_python_backend_stub`` built for
the running Python copied into its backend folder, and ``LD_LIBRARY_PATH`` must hold the
interpreter's ``LIBDIR`` and the wheel's ``nvidia_pytriton.libs``, else the stub loads another
libpython and every model fails to load. The venv's ``bin`` goes first on ``PATH`` so the stub
finds this environment's numpy. A ``tritonserver`` found elsewhere (the official container's
``/opt/tritonserver/bin``) is used with its own backends, untouched.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import sys
import sysconfig
from pathlib import Path

from inferwatch.contract import PORTS
from inferwatch.paths import STATE_DIR_ENV, state_dir
from inferwatch.process import ManagedProcess, StartError, last_line
from reference_server.catalog import MODEL_REPOSITORY
from reference_server.defaults import TRITON_READY_TIMEOUT

BINARY_ENV = "INFERWATCH_TRITONSERVER"
FAULTS_DIR_ENV = "INFERWATCH_FAULTS_DIR"  # read by the models (model.py); see faults.py
OFFICIAL_BINARY = Path("/opt/tritonserver/bin/tritonserver")

_LOAD_FAILURE = re.compile(r"failed to load '([^']+)' version (\d+): (.*?)\"?$")


class LauncherError(StartError):
    """A one-line, actionable reason why Triton could not start."""


def _pytriton_dir() -> Path | None:
    try:
        import pytriton  # the wheel's Python package is only a carrier for the binary here
    except ImportError:
        return None
    path = Path(pytriton.__file__).resolve().parent / "tritonserver"
    return path if path.is_dir() else None


def find_binary(explicit: str | os.PathLike | None = None) -> Path:
    """The tritonserver to run: ``explicit``, ``$INFERWATCH_TRITONSERVER``, ``PATH``,
    ``/opt/tritonserver/bin``, then the one inside the nvidia-pytriton wheel."""
    chosen = explicit or os.environ.get(BINARY_ENV)
    if chosen:
        path = Path(chosen).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            origin = "--tritonserver" if explicit else BINARY_ENV
            raise LauncherError(
                f"tritonserver binary not found at {path} (from {origin}); point it at an executable "
                "tritonserver or unset it to use the one in the nvidia-pytriton wheel"
            )
        return path
    on_path = shutil.which("tritonserver")
    if on_path:
        return Path(on_path)
    if OFFICIAL_BINARY.is_file():
        return OFFICIAL_BINARY
    wheel = _pytriton_dir()
    if wheel and (wheel / "bin" / "tritonserver").is_file():
        return wheel / "bin" / "tritonserver"
    raise LauncherError(
        "no tritonserver binary found: install the nvidia-pytriton wheel (it carries Triton), put "
        f"tritonserver on PATH, or set {BINARY_ENV} to its path"
    )


def _copy_if_changed(src: Path, dst: Path) -> None:
    if dst.exists() and dst.stat().st_size == src.stat().st_size:
        return
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}")
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)  # atomic, so a Triton already running from this folder never sees half a file


def prepare_backends(binary: Path, backend_root: Path) -> Path | None:
    """For the wheel's binary: a backend folder whose ``python/`` holds the stub for this Python.
    Returns None for other binaries (they bring their own backends)."""
    wheel = binary.resolve().parent.parent
    src = wheel / "backends" / "python"
    if not (src / "libtriton_python.so").is_file():
        return None
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = wheel / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise LauncherError(f"the nvidia-pytriton wheel has no Python backend stub for Python {version}")
    dst = backend_root / "python"
    dst.mkdir(parents=True, exist_ok=True)
    for f in (src / "libtriton_python.so", src / "triton_python_backend_utils.py", stub):
        _copy_if_changed(f, dst / f.name)
    return backend_root


def port_in_use(host: str, port: int) -> bool:
    """True when something listens on (host, port). SO_REUSEADDR so a TIME_WAIT leftover does
    not count: Triton can bind over it too."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise LauncherError(f"cannot bind {host}:{port}: {exc.strerror}") from None
    return False


def triton_env(base: dict[str, str] | None = None, faults_dir: Path | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    libs = [sysconfig.get_config_var("LIBDIR") or ""]
    wheel = _pytriton_dir()
    if wheel:
        libs.append(str(wheel.parent.parent / "nvidia_pytriton.libs"))
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(p for p in libs if p)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if faults_dir is not None:
        env[FAULTS_DIR_ENV] = str(faults_dir)
    return env


def load_failure(log_text: str) -> str | None:
    """The first model-load failure in a Triton log, as one line."""
    for line in log_text.splitlines():
        m = _LOAD_FAILURE.search(line.strip())
        if m:
            reason = m.group(3).split("\\n")[0].strip()
            return f"model {m.group(1)} version {m.group(2)} failed to load: {reason}"
    return None


class TritonServer(ManagedProcess):
    """A Triton process: ``start()`` returns once every model is ready; ``stop()`` ends it
    (SIGTERM: Triton drains in-flight requests and stops its model stubs; then SIGKILL to any
    stray backend stub, if Triton died abruptly).

    Use as a context manager. ``http_url``/``grpc_url`` are ``host:port`` (what tritonclient
    takes); ``metrics_url`` is the full ``http://host:port/metrics``.
    """

    name = "Triton"
    error = LauncherError
    ready_poll = 0.2
    stop_timeout = 30.0
    log_path: Path  # always a file: Triton's log is how a failed start is explained

    def __init__(
        self,
        model_repository: str | os.PathLike = MODEL_REPOSITORY,
        *,
        host: str = "127.0.0.1",
        http_port: int = PORTS["triton_http"],
        grpc_port: int = PORTS["triton_grpc"],
        metrics_port: int = PORTS["triton_metrics"],
        state_dir_path: str | os.PathLike | None = None,
        log_file: str | os.PathLike | None = None,
        binary: str | os.PathLike | None = None,
        ready_timeout: float = TRITON_READY_TIMEOUT,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.model_repository = Path(model_repository).resolve()
        self.host = host
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.state_dir = Path(state_dir_path) if state_dir_path else state_dir()
        log_path = Path(log_file) if log_file else self.state_dir / "triton" / "triton.log"
        super().__init__(log_path=log_path, ready_timeout=ready_timeout)
        self.faults_dir = self.state_dir / "faults"
        self.binary = binary
        self.extra_args = extra_args

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def ready_url(self) -> str:
        return f"http://{self.http_url}/v2/health/ready"

    def command(self, binary: Path, backend_dir: Path | None) -> list[str]:
        cmd = [
            str(binary),
            f"--model-repository={self.model_repository}",
            f"--http-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            "--exit-on-error=true",
            "--exit-timeout-secs=10",
        ]
        if backend_dir is not None:
            cmd.append(f"--backend-directory={backend_dir}")
        return [*cmd, *self.extra_args]

    def prepare(self) -> tuple[list[str], dict[str, str]]:
        if not self.model_repository.is_dir():
            raise LauncherError(f"model repository {self.model_repository} is not a directory")
        binary = find_binary(self.binary)
        for what, port in (
            ("HTTP", self.http_port),
            ("gRPC", self.grpc_port),
            ("metrics", self.metrics_port),
        ):
            if port_in_use(self.host, port):
                flag = {"HTTP": "--http-port", "gRPC": "--grpc-port", "metrics": "--metrics-port"}[what]
                raise LauncherError(
                    f"{what} port {self.host}:{port} is already in use; stop what listens there "
                    f"(another Triton?) or choose another with {flag}"
                )
        backend_dir = prepare_backends(binary, self.state_dir / "triton" / "backends")
        self.faults_dir.mkdir(parents=True, exist_ok=True)
        env = triton_env(faults_dir=self.faults_dir)
        env[STATE_DIR_ENV] = str(self.state_dir)
        return self.command(binary, backend_dir), env

    def timeout_reason(self) -> str:
        failure = load_failure(self.log_text())
        return (failure or f"Triton was not ready after {self.ready_timeout:g}s") + f" (log: {self.log_path})"

    def exit_reason(self, code: int) -> str:
        text = self.log_text()
        failure = load_failure(text)
        if failure:
            return f"{failure}; fix the model and start again (log: {self.log_path})"
        if "Address already in use" in text or "failed to start" in text.lower():
            return (
                f"Triton could not bind its ports ({self.http_port}/{self.grpc_port}/{self.metrics_port}); "
                f"choose free ones (log: {self.log_path})"
            )
        return f"Triton exited with code {code} before it was ready: {last_line(text)} (log: {self.log_path})"
