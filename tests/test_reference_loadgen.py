"""The load generator against the real Triton, checked against Triton's own counters."""

from __future__ import annotations

import json
import math
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferwatch import cli, contract
from reference_server import faults, triton_metrics
from reference_server.loadgen import LoadConfig, LoadError, LoadGenerator, Target, run_load
from tests.fixtures.net import free_port, inferwatch_cmd

pytestmark = pytest.mark.integration
OK, FAIL = contract.TRITON_REQUEST_SUCCESS.name, contract.TRITON_REQUEST_FAILURE.name


@pytest.fixture
def clean_faults(triton) -> Iterator[Path]:
    faults.clear(state_dir=triton.state_dir)
    try:
        yield triton.state_dir
    finally:
        faults.clear(state_dir=triton.state_dir)


def served(before, after, model: str, version: str) -> tuple[float, float]:
    return (
        triton_metrics.delta(before, after, OK, model, version),
        triton_metrics.delta(before, after, FAIL, model, version),
    )


def test_open_loop_rate_and_mix_match_tritons_counters(triton) -> None:
    rate, duration = 40.0, 5.0
    before = triton_metrics.scrape(triton.metrics_url)
    s = run_load(
        LoadConfig(
            url=triton.grpc_url,
            protocol="grpc",
            rate=rate,
            duration=duration,
            targets=[Target.parse("ranker:1=3"), Target.parse("ranker:2=1")],
            seed=11,
        )
    )
    after = triton_metrics.scrape(triton.metrics_url)
    ok1, fail1 = served(before, after, "ranker", "1")
    ok2, fail2 = served(before, after, "ranker", "2")
    # What the generator says it sent is what Triton executed, version by version.
    assert (ok1 + fail1, ok2 + fail2) == (s.by_target["ranker:1"]["sent"], s.by_target["ranker:2"]["sent"])
    assert s.ok == ok1 + ok2 and s.sent == s.ok and not s.errors
    # Poisson arrivals: the count is within 4.5 standard deviations of rate x duration.
    expected = rate * duration
    assert abs(s.sent - expected) <= 4.5 * math.sqrt(expected), f"sent {s.sent}, expected ~{expected:g}"
    # The 3:1 mix, within a binomial bound.
    assert abs(ok1 - 0.75 * s.sent) <= 4.5 * math.sqrt(s.sent * 0.75 * 0.25)
    assert s.latency_s["p50"] > 0 and s.latency_s["max"] >= s.latency_s["p99"] >= s.latency_s["p50"]


def test_a_sender_that_cannot_keep_up_says_so(triton, clean_faults: Path) -> None:
    faults.set_fault("ranker", "1", extra_latency_ms=300, state_dir=clean_faults)
    s = run_load(
        LoadConfig(
            url=triton.http_url,
            rate=50,
            duration=2.0,
            max_in_flight=2,
            targets=[Target("ranker", "1")],
            seed=3,
        )
    )
    assert not s.kept_up and s.skipped > 0
    assert any("could not keep up" in w for w in s.warnings)
    # Each of the 2 in-flight slots frees at most every 300 ms; every other arrival was skipped.
    assert s.sent <= 2 + 2 * math.ceil(2.0 / 0.3)
    assert abs(s.sent + s.skipped - 100) <= 4.5 * math.sqrt(100)
    assert s.latency_s["p50"] >= 0.3


@pytest.mark.parametrize(("protocol", "status"), [("http", "500"), ("grpc", "INTERNAL")])
def test_closed_loop_counts_errors_by_status(triton, clean_faults: Path, protocol: str, status: str) -> None:
    faults.set_fault("ranker", "2", error_rate=1.0, state_dir=clean_faults)
    url = triton.http_url if protocol == "http" else triton.grpc_url
    before = triton_metrics.scrape(triton.metrics_url)
    s = run_load(
        LoadConfig(
            url=url,
            protocol=protocol,
            concurrency=4,
            duration=1.5,
            targets=[Target("ranker", "1"), Target("ranker", "2")],
            seed=5,
        )
    )
    after = triton_metrics.scrape(triton.metrics_url)
    ok1, fail1 = served(before, after, "ranker", "1")
    ok2, fail2 = served(before, after, "ranker", "2")
    assert s.errors == {status: fail2} and fail1 == 0 and ok2 == 0
    assert s.ok == ok1 and s.sent == ok1 + fail2
    assert s.mode == "closed" and s.in_flight == 0


def test_python_api_counters_are_readable_while_running(triton) -> None:
    gen = LoadGenerator(LoadConfig(url=triton.grpc_url, protocol="grpc", rate=30, duration=None)).start()
    try:
        seen = []
        for _ in range(3):
            time.sleep(0.7)
            seen.append(gen.snapshot().sent)
        assert gen.running
    finally:
        t = time.monotonic()
        final = gen.stop(timeout=30)
    assert time.monotonic() - t < 10, "stop() returns promptly"
    assert seen[0] < seen[1] < seen[2] <= final.sent
    assert not gen.running and final.ok == final.sent


def test_cli_json_summary_with_batched_requests(triton) -> None:
    before = triton_metrics.scrape(triton.metrics_url)
    proc = subprocess.run(
        inferwatch_cmd(
            "load", "--url", triton.http_url, "--concurrency", "2", "--duration", "1",
            "--model", "dense_unbatched", "--batch", "4", "--json",
        ),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    after = triton_metrics.scrape(triton.metrics_url)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["sent"] == data["ok"] > 0 and data["errors"] == {}
    assert set(data["latency_s"]) == {"p50", "p90", "p99", "max"}
    assert data["mode"] == "closed" and data["kept_up"] is True
    # 4 rows per request: Triton counts 4 inferences per request and one execution each.
    count = contract.TRITON_INFERENCE_COUNT.name
    assert triton_metrics.delta(before, after, count, "dense_unbatched") == 4 * data["ok"]
    assert triton_metrics.delta(before, after, OK, "dense_unbatched") == data["ok"]


def test_bad_load_settings_are_refused(capsys: pytest.CaptureFixture) -> None:
    port = str(free_port())
    for args, words in (
        (["--model", "nope"], "not a reference model"),
        (["--model", "ranker:7"], "no version 7"),
        (["--model", "ranker=0"], "positive"),
        (["--duration", "0"], "duration"),
        (["--batch", "99"], "batch"),
        ([], f"cannot reach a KServe v2 server at 127.0.0.1:{port}"),
    ):
        code = cli.main(["load", "--url", f"127.0.0.1:{port}", "--rate", "5", *args])
        err = capsys.readouterr().err
        assert code != 0 and err.startswith("inferwatch: error:") and words in err, (args, err)
        assert len(err.strip().splitlines()) == 1
    with pytest.raises(LoadError, match="exactly one"):
        LoadConfig(url="127.0.0.1:1", rate=1, concurrency=1).validate()
    with pytest.raises(LoadError, match="HOST:PORT"):
        LoadConfig(url="http://127.0.0.1:1", rate=1).validate()
