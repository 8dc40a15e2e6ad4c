"""The naive FastAPI baseline: the same numbers as Triton, KServe v2 errors, clean stop."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from reference_server import catalog
from reference_server.loadgen import LoadConfig, Target, run_load
from tests.fixtures.net import free_port, inferwatch_cmd, wait_http
from tests.fixtures.triton import expected

pytestmark = pytest.mark.integration


@pytest.fixture
def naive(processes) -> tuple[str, object]:
    port = free_port()
    proc = processes.start("naive", inferwatch_cmd("naive-server", "--port", str(port)))
    wait_http(f"http://127.0.0.1:{port}/healthz", timeout=60, proc=proc)
    return f"127.0.0.1:{port}", proc


def infer(url: str, model: str, x: np.ndarray, datatype: str = "FP32", binary: bool = True) -> np.ndarray:
    client = httpclient.InferenceServerClient(url)
    inp = httpclient.InferInput("INPUT", list(x.shape), datatype)
    inp.set_data_from_numpy(x, binary_data=binary)
    out = httpclient.InferRequestedOutput("OUTPUT", binary_data=binary)
    return client.infer(model, [inp], outputs=[out]).as_numpy("OUTPUT")


def test_naive_server_serves_the_reference_numbers_and_errors(naive, processes) -> None:
    url, proc = naive
    x = catalog.example_input("dense_unbatched", batch=2, seed=9)["INPUT"]
    want = expected("dense_unbatched", "1", x)
    for binary in (True, False):  # the binary-data extension and plain JSON tensors
        np.testing.assert_allclose(
            infer(url, "dense_unbatched", x, binary=binary), want, rtol=1e-4, atol=1e-4
        )
    for call, status in (
        (lambda: infer(url, "ranker", x), "404"),
        (lambda: infer(url, "dense_batched", np.zeros((1, 17), np.float32)), "400"),
        (lambda: infer(url, "dense_batched", x.astype(np.int32), "INT32"), "400"),
    ):
        with pytest.raises(InferenceServerException) as err:
            call()
        assert str(err.value.status()) == status and err.value.message()
    client = httpclient.InferenceServerClient(url)
    assert client.is_server_live() and client.is_model_ready("dense_batched")
    # The same load generator drives it.
    s = run_load(LoadConfig(url=url, concurrency=2, duration=1.0, targets=[Target("dense_batched")]))
    assert s.sent == s.ok > 0
    assert processes.stop(proc, signal.SIGTERM) == 0


def test_naive_server_refuses_a_taken_port(tmp_path: Path) -> None:
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run(
            inferwatch_cmd("naive-server", "--port", str(port)), capture_output=True, text=True, timeout=60
        )
    assert proc.returncode == 1
    assert (
        proc.stderr.strip()
        == f"inferwatch: error: port 127.0.0.1:{port} is already in use; choose another with --port"
    )
