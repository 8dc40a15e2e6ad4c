"""The fleet spec's `canary:` section (defaults, strict one-line errors) and the parts of
`inferwatch canary` that need no Prometheus: its documented exit codes and argument errors."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from inferwatch.spec import SpecError, load_spec, parse_spec
from tests.fixtures.net import ROOT, inferwatch_cmd


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        inferwatch_cmd("canary", *args), capture_output=True, text=True, timeout=60, cwd=cwd
    )


def test_defaults_and_the_committed_spec() -> None:
    cs = parse_spec({}).canary
    assert (cs.window, cs.min_requests, cs.confidence, cs.for_) == ("10m", 200, 0.99, "5m")
    assert (cs.max_error_ratio_increase, cs.max_latency_increase, cs.max_token_latency_increase) == (
        0.01,
        0.5,
        0.2,
    )
    assert load_spec(ROOT / "fleet.yaml").canary == cs  # fleet.yaml spells the defaults out


@pytest.mark.parametrize(
    ("canary", "message"),
    [
        ({"window": "ten minutes"}, "canary.window: 'ten minutes' is not a duration"),
        ({"min_requests": 0}, "canary.min_requests: must be greater than or equal to 1"),
        ({"confidence": 1.0}, "canary.confidence: must be less than 1"),
        (
            {"max_error_ratio_increase": -0.1},
            "canary.max_error_ratio_increase: must be greater than or equal to 0",
        ),
        ({"max_latency_increase": 0}, "canary.max_latency_increase: must be greater than 0"),
        ({"for": "0s"}, "canary.for: must be a positive duration"),
        ({"max_latncy_increase": 1}, "canary.max_latncy_increase: unknown key"),
    ],
)
def test_a_bad_canary_section_is_refused_in_one_line(canary: dict, message: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec({"canary": canary}, "fleet.yaml")
    assert str(err.value).startswith(f"fleet.yaml: {message}"), str(err.value)
    assert "\n" not in str(err.value)


def test_help_documents_the_exit_codes() -> None:
    proc = run("--help")
    assert proc.returncode == 0
    for line in ("0  pass", "1  fail", "2  inconclusive", "3  error"):
        assert line in proc.stdout


def test_argument_errors_exit_3_not_argparse_2(tmp_path: Path) -> None:
    missing = run("--model", "ranker")
    assert missing.returncode == 3 and "missing --prometheus, --baseline, --canary" in missing.stderr
    assert (
        run("--prometheus", "http://x", "--model", "m", "--baseline", "1", "--canary", "2", "-x").returncode
        == 3
    )
    assert run("--at", "yesterday").returncode == 3
    url = run("--prometheus", "127.0.0.1:9090", "--model", "m", "--baseline", "1", "--canary", "2")
    assert url.returncode == 3 and "expected a URL" in url.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"canary": {"window": "soon"}}))
    spec = run("--spec", str(bad), "--templates", str(tmp_path / "out"))
    assert spec.returncode == 3
    assert (
        spec.stderr.strip() == f"inferwatch canary: error: {bad}: canary.window: 'soon' is not a duration "
        "(use Prometheus syntax such as 30s, 1m, 1h30m)"
    )


def test_without_fleet_yaml_the_defaults_apply(tmp_path: Path) -> None:
    """Run where there is no fleet.yaml: the templates carry the spec's defaults."""
    proc = run("--templates", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    argo = yaml.safe_load((tmp_path / "out" / "analysistemplate.yaml").read_text())
    assert [m["failureCondition"] for m in argo["spec"]["metrics"]] == ["result[0] > 0.01", "result[0] > 0.5"]
