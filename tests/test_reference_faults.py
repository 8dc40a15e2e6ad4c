"""Fault injection on the running Triton: real failures at the asked rate, latency, and clear."""

from __future__ import annotations

import math
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from inferwatch import cli, contract
from reference_server import catalog, faults, triton_metrics
from tests.fixtures.net import inferwatch_cmd

pytestmark = pytest.mark.integration

X = catalog.example_input("ranker", seed=5)["FEATURES"]


@pytest.fixture
def clean_faults(triton) -> Iterator[Path]:
    faults.clear(state_dir=triton.state_dir)
    try:
        yield triton.state_dir
    finally:
        faults.clear(state_dir=triton.state_dir)


def fault_cli(state_dir: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        inferwatch_cmd("fault", *args, "--state-dir", str(state_dir)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc


def send(client, mod, n: int, version: str) -> Counter:
    """n sequential requests (so each execution holds one request); outcomes by status."""
    outcomes: Counter = Counter()
    for _ in range(n):
        inp = mod.InferInput("FEATURES", list(X.shape), "FP32")
        inp.set_data_from_numpy(X)
        try:
            client.infer("ranker", [inp], model_version=version)
            outcomes["ok"] += 1
        except InferenceServerException as exc:
            outcomes[str(exc.status())] += 1
            assert "injected fault" in exc.message()
    return outcomes


def within_binomial(k: int, n: int, p: float, z: float = 4.5) -> bool:
    return abs(k - n * p) <= z * math.sqrt(n * p * (1 - p))


def test_error_rate_gives_real_triton_failures_at_that_fraction(triton, clean_faults: Path) -> None:
    proc = fault_cli(clean_faults, "set", "--model", "ranker", "--version", "1", "--error-rate", "0.3")
    assert proc.returncode == 0, proc.stderr
    http = httpclient.InferenceServerClient(triton.http_url)
    before = triton_metrics.scrape(triton.metrics_url)
    n = 300
    got = send(http, httpclient, n, "1")
    after = triton_metrics.scrape(triton.metrics_url)
    failed = got[str(faults.HTTP_STATUS)]
    assert set(got) <= {"ok", str(faults.HTTP_STATUS)}, got
    assert within_binomial(failed, n, 0.3), f"{failed}/{n} failed, asked 0.3"
    # Triton itself counted them as failures, the others as successes.
    fail_name, ok_name = contract.TRITON_REQUEST_FAILURE.name, contract.TRITON_REQUEST_SUCCESS.name
    assert triton_metrics.delta(before, after, fail_name, "ranker", "1") == failed
    assert triton_metrics.delta(before, after, ok_name, "ranker", "1") == got["ok"]

    # The same fault over gRPC: code INTERNAL; version 2 is untouched.
    grpc = grpcclient.InferenceServerClient(triton.grpc_url)
    got = send(grpc, grpcclient, 100, "1")
    assert set(got) <= {"ok", f"StatusCode.{faults.GRPC_CODE}"} and got["ok"] < 100, got
    assert send(http, httpclient, 30, "2") == Counter(ok=30)

    proc = fault_cli(clean_faults, "clear")
    assert proc.returncode == 0 and "ranker@1" in proc.stdout
    assert send(http, httpclient, 100, "1") == Counter(ok=100)


def test_model_wide_fault_hits_every_version_and_a_version_fault_wins(triton, clean_faults: Path) -> None:
    http = httpclient.InferenceServerClient(triton.http_url)
    faults.set_fault("ranker", error_rate=1.0, state_dir=clean_faults)
    assert send(http, httpclient, 5, "1") == Counter({"500": 5})
    assert send(http, httpclient, 5, "2") == Counter({"500": 5})
    faults.set_fault("ranker", "2", error_rate=0.0, state_dir=clean_faults)
    assert send(http, httpclient, 5, "2") == Counter(ok=5)
    assert send(http, httpclient, 5, "1") == Counter({"500": 5})
    faults.clear("ranker", state_dir=clean_faults)
    assert faults.active(clean_faults) == {}
    assert send(http, httpclient, 5, "1") == Counter(ok=5)


def test_extra_latency_shows_in_measured_latency(triton, clean_faults: Path) -> None:
    http = httpclient.InferenceServerClient(triton.http_url)

    def median_latency(n: int = 7) -> float:
        times = []
        for _ in range(n):
            inp = httpclient.InferInput("FEATURES", list(X.shape), "FP32")
            inp.set_data_from_numpy(X)
            t = time.perf_counter()
            http.infer("ranker", [inp], model_version="1")
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    base = median_latency()
    proc = fault_cli(clean_faults, "set", "--model", "ranker", "--extra-latency-ms", "200")
    assert proc.returncode == 0, proc.stderr
    slow = median_latency()
    assert slow >= base + 0.19, f"median {slow * 1e3:.0f} ms with +200 ms, {base * 1e3:.0f} ms without"
    fault_cli(clean_faults, "clear", "--model", "ranker")
    assert median_latency() < base + 0.1


def test_fault_cli_refuses_bad_settings(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for args, words in (
        (["set", "--model", "ranker", "--error-rate", "1.5"], "between 0 and 1"),
        (["set", "--model", "ranker", "--extra-latency-ms", "-3"], "--extra-latency-ms must be between"),
        (["set", "--model", "ranker"], "--error-rate"),
        (["set", "--model", "../etc", "--error-rate", "0.1"], "model name"),
        (["set", "--model", "ranker", "--version", "v2", "--error-rate", "0.1"], "version"),
        (["clear", "--version", "1"], "--model"),
    ):
        code = cli.main(["fault", *args, "--state-dir", str(tmp_path)])
        err = capsys.readouterr().err
        assert code == 2, (args, err)
        assert err.startswith("inferwatch: error:") and words in err, err
        assert len(err.strip().splitlines()) == 1
    assert not list(tmp_path.rglob("*.json")), "nothing written for refused settings"


def test_fault_files_are_what_the_models_read(tmp_path: Path) -> None:
    """The file layout documented in reference_models.py: <model>.json and <model>@<version>.json."""
    p = faults.set_fault("ranker", 2, error_rate=0.25, extra_latency_ms=10, state_dir=tmp_path)
    assert p == tmp_path / "faults" / "ranker@2.json"
    assert faults.active(tmp_path) == {"ranker@2": faults.Fault(0.25, 10.0)}
    np.testing.assert_equal(sorted(x.name for x in (tmp_path / "faults").iterdir()), ["ranker@2.json"])
