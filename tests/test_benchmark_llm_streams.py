"""benchmarks/llm_streams.py --quick end to end on its Triton part (tiny_stream at a fixed pace,
direct, through the sidecar and through nginx), so the benchmark keeps producing streams that
completed on every path and that the sidecar measured. Timings are not asserted. The vLLM part
shares every line of the measuring code and is left to the benchmark's own runs: one more vLLM
start (35 to 120 s, about 3 GB) would be its only addition to the suite.

Needs nginx (scripts/bootstrap installs nginx-light)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.net import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

SCRIPT = ROOT / "benchmarks" / "llm_streams.py"
TARGETS = ("direct", "sidecar", "nginx")


def _run(*args: str, timeout: float = 840) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out: Path = tmp_path_factory.mktemp("llm-streams") / "figures.json"
    proc = _run("--quick", "--parts", "triton", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_every_stream_completes_on_every_path(quick: tuple[dict, str], part: str = "triton") -> None:
    figures, _ = quick
    cells = figures[part]["cells"]
    assert list(cells) == ["8"]  # --quick: 8 streams (JSON keys are strings)
    cell = cells["8"]
    for t in TARGETS:
        row = cell[t]
        assert row["errors"] == 0, (t, figures[part]["runs"]["8"][t])
        assert row["streams_ok"] > 0 and row["tokens_per_s"] > 0, t
        assert row["ttft_p99_ms"] >= row["ttft_p50_ms"] > 0, t
        assert row["itl_p99_ms"] >= row["itl_p50_ms"] >= 0, t
    # The proxies' CPU was read from /proc (a process that was not found would read 0).
    assert cell["sidecar"]["cpu_per_1k_tokens"] > 0 and cell["nginx"]["cpu_per_1k_tokens"] > 0
    assert cell["cpu_ratio"] > 0
    # Every full run of 128 (vLLM) or 16 (Triton, --quick) tokens, nothing cut short.
    per_stream = 128 if part == "vllm" else 16
    for t in TARGETS:
        for run in figures[part]["runs"]["8"][t]:
            assert run["tokens"] == per_stream * run["streams_ok"], (t, run)


def test_the_sidecar_measured_every_token_it_relayed(quick: tuple[dict, str], part: str = "triton") -> None:
    p = quick[0][part]
    assert p["client_tokens_through_sidecar"] > 0
    assert p["sidecar_counted_tokens"] == p["client_tokens_through_sidecar"]


def test_the_report_has_the_table(quick: tuple[dict, str]) -> None:
    _, text = quick
    assert "Triton `tiny_stream` v1" in text and "vLLM (`tiny-llm`)" not in text
    for t in TARGETS:
        assert f"| 8 | {t} |" in text
    assert text.count("sidecar CPU per 1k tokens =") == 1


def test_bad_settings_get_one_line() -> None:
    proc = _run("--rounds", "0", timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith("--rounds must be positive")
