"""The fleet spec: the example is valid, and each kind of bad input gets its own one-line error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from inferwatch.spec import SpecError, duration_seconds, load_spec, parse_spec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "fleet.yaml"


def example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def run_check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "inferwatch.cli", "spec", "check", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


def test_example_spec_is_valid_and_has_models_with_different_slas() -> None:
    spec = load_spec(EXAMPLE)
    slas = {m.latency_sla_ms for m in spec.models}
    assert len(spec.models) >= 2 and len(slas) >= 2
    assert spec.alerts.error_rate.threshold == 0.05
    assert spec.alerts.error_rate.consecutive_windows == 3
    assert spec.alerts.latency.sla_factor == 2
    assert spec.alerts.gpu_memory.threshold == 0.9


def test_defaults_match_design() -> None:
    spec = parse_spec({})
    er, lat, gpu = spec.alerts.error_rate, spec.alerts.latency, spec.alerts.gpu_memory
    assert (er.threshold, er.window, er.consecutive_windows) == (0.05, "1m", 3)
    assert (lat.sla_factor, lat.quantile, lat.window, lat.for_) == (2.0, 0.99, "5m", "5m")
    assert (gpu.threshold, gpu.for_) == (0.9, "5m")


def test_unlisted_model_falls_back_to_default_sla() -> None:
    spec = parse_spec({"defaults": {"latency_sla_ms": 300}, "models": [{"name": "a", "latency_sla_ms": 50}]})
    assert spec.latency_sla_seconds("a") == pytest.approx(0.05)
    assert spec.latency_sla_seconds("unknown") == pytest.approx(0.3)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30), ("1m", 60), ("1h30m", 5400), ("3d", 259200), ("500ms", 0.5)],
)
def test_durations(text: str, seconds: float) -> None:
    assert duration_seconds(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "1", "m", "1x", "-1m", "1.5m"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError):
        duration_seconds(text)


def _mutate(path: list, value) -> dict:
    data = example()
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return data


BAD_SPECS = {
    "wrong type": (
        _mutate(["alerts", "error_rate", "threshold"], "five percent"),
        "alerts.error_rate.threshold: must be a valid number",
    ),
    "threshold above 1": (
        _mutate(["alerts", "error_rate", "threshold"], 1.5),
        "alerts.error_rate.threshold: must be less than 1",
    ),
    "threshold of 0": (
        _mutate(["alerts", "error_rate", "threshold"], 0),
        "alerts.error_rate.threshold: must be greater than 0",
    ),
    "gpu threshold above 1": (
        _mutate(["alerts", "gpu_memory", "threshold"], 90),
        "alerts.gpu_memory.threshold: must be less than 1",
    ),
    "sla of 0": (
        _mutate(["models", 1, "latency_sla_ms"], 0),
        "models[1].latency_sla_ms: must be greater than 0",
    ),
    "zero windows": (
        _mutate(["alerts", "error_rate", "consecutive_windows"], 0),
        "alerts.error_rate.consecutive_windows: must be greater than or equal to 1",
    ),
    "zero window length": (
        _mutate(["alerts", "error_rate", "window"], "0s"),
        "alerts.error_rate.window: must be a positive duration",
    ),
    "bad duration": (
        _mutate(["alerts", "latency", "for"], "five minutes"),
        "alerts.latency.for: 'five minutes' is not a duration",
    ),
    "unknown key": (
        _mutate(["alerts", "error_rate", "treshold"], 0.1),
        "alerts.error_rate.treshold: unknown key",
    ),
    "unknown top-level key": (_mutate(["modles"], []), "modles: unknown key"),
    "duplicate model": (
        _mutate(["models", 1, "name"], "dense_batched"),
        "models[1].name: duplicate model name 'dense_batched'",
    ),
    "missing sla": (
        _mutate(["models", 0], {"name": "x"}),
        "models[0].latency_sla_ms: required field is missing",
    ),
    "route to unknown receiver": (
        _mutate(["routing", "critical", "receiver"], "nobody"),
        "routing: critical.receiver 'nobody' is not one of the receivers",
    ),
    "wrong version": (_mutate(["version"], 2), "version: must be 1"),
}


@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_bad_spec_gives_one_line_naming_file_field_and_reason(case: str, tmp_path: Path) -> None:
    data, expected = BAD_SPECS[case]
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError) as excinfo:
        load_spec(path)
    assert str(excinfo.value).startswith(f"{path}: {expected}"), str(excinfo.value)

    proc = run_check(path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{path}: {expected}")
    assert "Traceback" not in proc.stderr


def test_missing_file(tmp_path: Path) -> None:
    proc = run_check(tmp_path / "nope.yaml")
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == f"{tmp_path / 'nope.yaml'}: no such file (pass the fleet spec with --spec, e.g. fleet.yaml)"
    )


def test_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text("alerts:\n  error_rate: {threshold: 0.05\n")
    proc = run_check(path)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"{path}: line ") and "invalid YAML" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_top_level_not_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text("- a\n- b\n")
    proc = run_check(path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"{path}: the top level must be a mapping, not list"


def test_valid_spec_check_prints_summary() -> None:
    proc = run_check(EXAMPLE)
    assert proc.returncode == 0, proc.stderr
    assert "valid" in proc.stdout and "dense_batched" in proc.stdout


def test_cli_loader_without_a_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """load_spec_for_cli, which every command reads its spec through: what applies with no path."""
    from inferwatch.spec import FleetSpec, load_spec_for_cli

    monkeypatch.chdir(tmp_path)  # no fleet.yaml here
    missing = "fleet.yaml: no such file (pass the fleet spec with --spec, e.g. fleet.yaml)"
    with pytest.raises(SpecError) as excinfo:
        load_spec_for_cli(None)
    assert str(excinfo.value) == missing
    assert load_spec_for_cli(None, if_none="default-if-present") == FleetSpec()
    assert load_spec_for_cli("", if_none="built-in") == FleetSpec()
    # A named file must exist, whatever if_none says.
    with pytest.raises(SpecError, match=r"^nope\.yaml: no such file"):
        load_spec_for_cli("nope.yaml", if_none="default-if-present")

    (tmp_path / "fleet.yaml").write_text("defaults: {latency_sla_ms: 123}\n")
    assert load_spec_for_cli(None).defaults.latency_sla_ms == 123
    assert load_spec_for_cli(None, if_none="default-if-present").defaults.latency_sla_ms == 123
    # The sidecar never picks up a fleet.yaml it was not given.
    assert load_spec_for_cli(None, if_none="built-in") == FleetSpec()
