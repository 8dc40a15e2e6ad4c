"""The metric contract: every metric name the project writes is in inferwatch/contract.py,
and no module other than the contract spells one in its source."""

from __future__ import annotations

import re
import subprocess
import tokenize
from pathlib import Path

from inferwatch import contract

ROOT = Path(__file__).resolve().parents[1]
NAME_RE = re.compile(
    r"(?<![\w:])(inferwatch_[a-z0-9_]+|DCGM_FI_[A-Z0-9_]+|nv_inference_[a-z0-9_]+|vllm:[a-z_][a-z0-9_]*)(?![\w:])"
)
SUFFIXES = ("_bucket", "_sum", "_count", "_created", "_total")
CODE_SUFFIXES = (".py", ".yaml", ".yml", ".json", ".pbtxt", ".libsonnet")


def tracked_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [ROOT / p for p in out if p.endswith(CODE_SUFFIXES) and (ROOT / p).is_file()]


def texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) pairs to scan: string literals of Python files, every line of the others."""
    if path.suffix != ".py":
        return list(enumerate(path.read_text(errors="replace").splitlines(), 1))
    with path.open("rb") as fh:
        return [(t.start[0], t.string) for t in tokenize.tokenize(fh.readline) if t.type == tokenize.STRING]


def known(name: str) -> bool:
    if name in contract.ALL_METRICS or name in contract.EXTRA_SERIES:
        return True
    return any(name.endswith(s) and name[: -len(s)] in contract.ALL_METRICS for s in SUFFIXES)


def test_contract_names_are_unique_and_well_formed() -> None:
    names = [m.name for m in contract.ALL_METRICS.values()]
    assert len(names) == len(set(names))
    for m in contract.ALL_METRICS.values():
        assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", m.name), m.name
        assert m.help, m.name
        if m.type == "counter" and m.source in ("sidecar", "gpu_exporter"):
            assert m.name.endswith("_total"), f"{m.name}: counters end in _total"
        if m.unit == "seconds":
            assert m.name.endswith("_seconds"), m.name


def test_design_names_are_present() -> None:
    for name in (
        "inferwatch_requests_total",
        "inferwatch_request_duration_seconds",
        "inferwatch_requests_in_flight",
        "inferwatch_request_bytes_total",
        "inferwatch_response_bytes_total",
        "inferwatch_model_latency_sla_seconds",
        "inferwatch_upstream_up",
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_FB_FREE",
        "DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_SM_CLOCK",
        "DCGM_FI_DEV_XID_ERRORS",
        # Generative (LLM) serving (sidecar/README.md, "LLM streams"), the sidecar's and vLLM's own.
        "inferwatch_time_to_first_token_seconds",
        "inferwatch_time_per_output_token_seconds",
        "inferwatch_inter_token_latency_seconds",
        "inferwatch_tokens_total",
        "inferwatch_model_ttft_sla_seconds",
        "inferwatch_model_tpot_sla_seconds",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:num_preemptions_total",
        "vllm:time_to_first_token_seconds",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    ):
        assert contract.metric(name).name == name
    assert contract.TIERED_ALERTS == {
        "InferenceHighErrorRate": "critical",
        "InferenceHighP99Latency": "warning",
        "GPUMemoryPressure": "info",
    }


def test_every_metric_name_in_the_tree_is_in_the_contract() -> None:
    unknown = []
    for path in tracked_files():
        for lineno, line in texts(path):
            unknown += [
                f"{path.relative_to(ROOT)}:{lineno}: {n}" for n in NAME_RE.findall(line) if not known(n)
            ]
    assert not unknown, "names not in inferwatch/contract.py:\n" + "\n".join(unknown)


def test_only_the_contract_spells_metric_names_in_code() -> None:
    """Components import names from the contract; generated files, tests and the contract may spell them."""
    offenders = []
    for path in tracked_files():
        rel = path.relative_to(ROOT)
        if path.suffix != ".py" or rel.parts[0] == "tests" or rel == Path("inferwatch/contract.py"):
            continue
        for lineno, line in texts(path):
            offenders += [f"{rel}:{lineno}: {n}" for n in NAME_RE.findall(line)]
    assert not offenders, "spell these through inferwatch.contract:\n" + "\n".join(offenders)
