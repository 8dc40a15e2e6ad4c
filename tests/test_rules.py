"""The generated rules: promtool checks and unit tests (per alert group) run against the
committed files, the committed files are what the spec generates, and the generator
refuses a spec it cannot use."""

from __future__ import annotations

import filecmp
import random
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from alert_rules import generate
from alert_rules.config import MissingSetting, RulesConfig, fmt_duration
from inferwatch import contract as c
from inferwatch.spec import load_spec, parse_spec
from tests.fixtures.net import inferwatch_cmd

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ROOT / "alert_rules" / "generated"
RUNBOOKS = ROOT / "alert_rules" / "runbooks"
PROMTOOL_TESTS = sorted((ROOT / "alert_rules" / "tests").glob("*.test.yml"))


def fleet_spec():
    return load_spec(ROOT / "fleet.yaml")


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)


def test_promtool_check_rules_passes_on_every_generated_file() -> None:
    files = generate.rule_files(GENERATED)
    assert [f.name for f in files] == sorted(
        [
            "errors.rules.yml",
            "latency.rules.yml",
            "gpu.rules.yml",
            "slo.rules.yml",
            "health.rules.yml",
            "canary.rules.yml",
            "llm.rules.yml",
            "llm_slo.rules.yml",
            "llm_saturation.rules.yml",
            "overload.rules.yml",
        ]
    )
    proc = run(["promtool", "check", "rules", *map(str, files)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_there_is_a_promtool_test_for_every_alert_group() -> None:
    tested = set()
    for path in PROMTOOL_TESTS:
        tested |= {Path(f).name for f in yaml.safe_load(path.read_text())["rule_files"]}
    assert tested == {f.name for f in generate.rule_files(GENERATED)}


def test_every_alert_is_exercised_by_a_promtool_test() -> None:
    text = "".join(p.read_text() for p in PROMTOOL_TESTS)
    for alert in c.ALL_ALERTS:
        assert f"alertname: {alert}" in text, alert


@pytest.mark.parametrize("test_file", PROMTOOL_TESTS, ids=lambda p: p.name)
def test_promtool_unit_tests(test_file: Path) -> None:
    proc = run(["promtool", "test", "rules", str(test_file)], cwd=test_file.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_committed_generated_files_are_fresh(tmp_path: Path) -> None:
    """Regenerating from fleet.yaml gives the committed bytes; else run `inferwatch rules build`."""
    out, books = tmp_path / "generated", tmp_path / "runbooks"
    generate.build(fleet_spec(), out, books)
    for fresh_dir, committed_dir in ((out, GENERATED), (books, RUNBOOKS)):
        fresh = sorted(p.relative_to(fresh_dir) for p in fresh_dir.rglob("*") if p.is_file())
        committed = sorted(p.relative_to(committed_dir) for p in committed_dir.rglob("*") if p.is_file())
        assert fresh == committed, f"{committed_dir}: files differ; run `inferwatch rules build`"
        stale = [str(p) for p in fresh if not filecmp.cmp(fresh_dir / p, committed_dir / p, shallow=False)]
        assert not stale, f"stale generated files {stale}; run `inferwatch rules build`"


def test_build_is_deterministic(tmp_path: Path) -> None:
    a = generate.build(fleet_spec(), tmp_path / "a", tmp_path / "ra")
    b = generate.build(fleet_spec(), tmp_path / "b", tmp_path / "rb")
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]


def test_every_alert_has_severity_links_and_a_runbook() -> None:
    seen = {}
    for path in generate.rule_files(GENERATED):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                if "alert" not in rule:
                    continue
                name = rule["alert"]
                seen[name] = rule["labels"]["severity"]
                assert set(rule["annotations"]) == set(c.ALERT_ANNOTATIONS), name
                assert rule["annotations"]["runbook_url"].endswith(f"/{name}.md")
                assert rule["annotations"]["dashboard_url"].startswith("http://localhost:3000/d/inferwatch-")
                assert (RUNBOOKS / f"{name}.md").is_file()
    assert seen == c.ALL_ALERTS


def test_runbooks_quote_the_spec_and_the_rule() -> None:
    text = (RUNBOOKS / "InferenceHighErrorRate.md").read_text()
    assert "More than 5% of the requests" in text
    assert "[2m59s999ms:1m]" in text  # the rule's own expression
    assert "roll back" in text
    latency = (RUNBOOKS / "InferenceHighP99Latency.md").read_text()
    assert c.TRITON_QUEUE_DURATION_US.name in latency and c.TRITON_COMPUTE_INFER_US.name in latency
    assert "more than 1% of requests slower" in latency


def test_prometheus_rule_resource_carries_the_same_groups() -> None:
    resource = yaml.safe_load((GENERATED / "prometheusrule.yaml").read_text())
    assert resource["apiVersion"] == "monitoring.coreos.com/v1"
    assert resource["kind"] == "PrometheusRule"
    assert resource["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    groups = [g for f in generate.rule_files(GENERATED) for g in yaml.safe_load(f.read_text())["groups"]]
    assert sorted(resource["spec"]["groups"], key=lambda g: g["name"]) == sorted(
        groups, key=lambda g: g["name"]
    )


def test_recording_rule_names_are_in_the_contract() -> None:
    records = {
        rule["record"]
        for f in generate.rule_files(GENERATED)
        for g in yaml.safe_load(f.read_text())["groups"]
        for rule in g["rules"]
        if "record" in rule
    }
    assert records == set(c.RECORDING_RULES)


def test_the_spec_drives_thresholds_and_windows(tmp_path: Path) -> None:
    data = yaml.safe_load((ROOT / "fleet.yaml").read_text())
    data["alerts"]["error_rate"] |= {"threshold": 0.1, "window": "30s", "consecutive_windows": 4}
    data["alerts"]["gpu_memory"]["threshold"] = 0.8
    data["models"] = [{"name": "solo", "latency_sla_ms": 50, "slo": {"objective": 0.99, "period": "7d"}}]
    generate.build(parse_spec(data), tmp_path)
    errors = (tmp_path / "errors.rules.yml").read_text()
    assert "[1m59s999ms:30s]" in errors and "> 0.1\n" in errors and ">= 4" in errors
    assert "> 0.8" in (tmp_path / "gpu.rules.yml").read_text()
    slo = (tmp_path / "slo.rules.yml").read_text()
    # 7-day period: the 30-day workbook windows scale by 7/30 (1h -> 14m, 5m -> 1m10s).
    assert "window: 14m" in slo and "window: 1m10s" in slo and "window: 7d" in slo
    assert "model: solo" in slo
    proc = run(["promtool", "check", "rules", *map(str, generate.rule_files(tmp_path))])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_spec_without_slos_has_an_empty_slo_group(tmp_path: Path) -> None:
    data = yaml.safe_load((ROOT / "fleet.yaml").read_text())
    data["models"] = [{"name": "solo", "latency_sla_ms": 50}]
    generate.build(parse_spec(data), tmp_path)
    assert yaml.safe_load((tmp_path / "slo.rules.yml").read_text())["groups"][0]["rules"] == []


def test_a_missing_required_setting_is_named() -> None:
    data = yaml.safe_load((ROOT / "fleet.yaml").read_text())
    data["links"]["runbook_base_url"] = ""
    with pytest.raises(MissingSetting, match=r"links\.runbook_base_url is required"):
        RulesConfig.from_spec(parse_spec(data))


def test_fmt_duration() -> None:
    assert fmt_duration(179.999) == "2m59s999ms"
    assert fmt_duration(90) == "1m30s"
    assert fmt_duration(3 * 86400) == "3d"
    with pytest.raises(ValueError):
        fmt_duration(0)


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return run(inferwatch_cmd(*args), cwd=cwd)


def test_cli_rules_build_writes_and_checks(tmp_path: Path) -> None:
    proc = cli(
        "rules", "build", "--out", str(tmp_path / "out"), "--runbooks", str(tmp_path / "rb"), "--check"
    )
    assert proc.returncode == 0, proc.stderr
    assert "promtool check rules: ok" in proc.stdout
    assert (tmp_path / "out" / "alertmanager.yml").is_file() and (
        tmp_path / "rb" / "GPUXidErrors.md"
    ).is_file()


def test_cli_rules_build_refuses_a_bad_spec_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("alerts:\n  error_rate:\n    threshold: 5\n")
    proc = cli("rules", "build", "--spec", str(bad), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "alerts.error_rate.threshold" in lines[0] and str(bad) in lines[0]
    assert not (tmp_path / "out").exists()


def _random_traffic(rng: random.Random, samples: int) -> list[dict]:
    """Counters of a dozen model versions whose traffic changes every few samples: idle, 5%
    errors exactly, some errors, none; some start late, some have no error series."""
    series = []
    for i in range(12):
        start = rng.choice([0, 0, rng.randrange(samples // 2)])
        ok = err = 0
        oks, errs = ["_"] * start, ["_"] * start
        for t in range(start, samples):
            if (t - start) % 4 == 0:
                d_ok, d_err = rng.choice([(0, 0), (19, 1), (rng.randrange(5, 30), rng.randrange(6)), (20, 0)])
            ok, err = ok + d_ok, err + d_err
            oks.append(str(ok))
            errs.append(str(err))
        name = f'{c.REQUESTS_TOTAL.name}{{model="m{i}",version="1",outcome="%s"}}'
        series.append({"series": name % c.OUTCOME_SUCCESS, "values": " ".join(oks)})
        if i % 4:
            series.append({"series": name % c.OUTCOME_SERVER_ERROR, "values": " ".join(errs)})
    return series


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_error_alert_fires_exactly_when_the_plain_form_does(tmp_path: Path, seed: int) -> None:
    """The generated alert (one subquery, a ratio without zeros, the recorded ratio over the
    recorded rate) against the plain form it replaced: the ratio with its zeros, min above
    the threshold and N steps present, two subqueries. Same alerts at every evaluation over
    random traffic; the recorded ratio equal to the raw one."""
    cfg = RulesConfig.from_spec(fleet_spec())
    w, n, m = cfg.error_window, cfg.error_windows, f'{c.REQUESTS_TOTAL.name}{{model!=""'
    errors = f'sum by (model, version) (rate({m}, outcome="{c.OUTCOME_SERVER_ERROR}"}}[{w}]))'
    total = f"sum by (model, version) (rate({m}}}[{w}]))"
    ratio = f"(({errors}) or 0 * {total}) / ({total} > {cfg.error_min_rate:g})"
    sub = f"({ratio})[{fmt_duration(n * cfg.error_window_s - 0.001)}:{w}]"
    plain = f"min_over_time({sub}) > {cfg.error_threshold:g} and count_over_time({sub}) >= {n}"
    rules = yaml.safe_load((GENERATED / "errors.rules.yml").read_text())["groups"][0]["rules"]
    alert = next(r["expr"] for r in rules if r.get("alert") == c.ALERT_HIGH_ERROR_RATE)
    rec = c.REC_SERVER_ERROR_RATIO
    samples = 100  # 15 s apart

    def check(exprs: list[str]) -> subprocess.CompletedProcess[str]:
        times = [f"{k * 15}s" for k in range(4, samples)]
        tests = [{"expr": e, "eval_time": t, "exp_samples": []} for t in times for e in exprs]
        doc = {
            "rule_files": [str(GENERATED / "errors.rules.yml")],
            "evaluation_interval": "15s",
            "tests": [{"interval": "15s", "input_series": _random_traffic(random.Random(seed), samples),
                       "promql_expr_test": tests}],
        }  # fmt: skip
        (tmp_path / "eq.test.yml").write_text(yaml.safe_dump(doc, width=10_000))
        return run(["promtool", "test", "rules", str(tmp_path / "eq.test.yml")])

    same = check([
        f"({plain}) unless ({alert})",
        f"({alert}) unless ({plain})",
        f"({ratio}) != {rec} or ({ratio}) unless {rec} or {rec} unless ({ratio})",
    ])  # fmt: skip
    assert same.returncode == 0, same.stdout[-3000:] + same.stderr
    # Not vacuous: the traffic makes the plain form fire at some evaluations.
    assert check([f"count({plain})"]).returncode != 0


def test_each_tiered_alert_exports_its_timing() -> None:
    """The timing a group exports is the timing its rule has (what the demo waits for)."""
    from alert_rules.groups import timings

    data = yaml.safe_load((ROOT / "fleet.yaml").read_text())
    data["alerts"]["error_rate"].update(window="2m", consecutive_windows=4)
    data["alerts"]["latency"].update(window="10m", **{"for": "7m"})
    data["alerts"]["gpu_memory"]["for"] = "3m"
    data["prometheus"]["scrape_interval"] = "20s"
    spec = parse_spec(data)
    got = timings(RulesConfig.from_spec(spec))
    assert set(got) == {*c.TIERED_ALERTS, c.ALERT_LLM_KV_CACHE_SATURATION}
    rules = {r["alert"]: r for _n, g in generate.rule_groups(spec) for r in g["rules"] if "alert" in r}

    errors = got[c.ALERT_HIGH_ERROR_RATE]
    assert (errors.condition_s, errors.window_s) == (3 * 120, 120)
    assert ":2m]" in rules[c.ALERT_HIGH_ERROR_RATE]["expr"]
    latency = got[c.ALERT_HIGH_P99_LATENCY]
    assert rules[c.ALERT_HIGH_P99_LATENCY]["for"] == fmt_duration(latency.condition_s) == "7m"
    assert latency.window_s == 600
    gpu = got[c.ALERT_GPU_MEMORY_PRESSURE]
    assert rules[c.ALERT_GPU_MEMORY_PRESSURE]["for"] == fmt_duration(gpu.condition_s) == "3m"
    assert gpu.window_s == 20
    kv = got[c.ALERT_LLM_KV_CACHE_SATURATION]  # the GPU tier's for; dips of three scrapes ridden out
    assert rules[c.ALERT_LLM_KV_CACHE_SATURATION]["for"] == fmt_duration(kv.condition_s) == "3m"
    assert kv.window_s == 60 and "[1m])" in rules[c.ALERT_LLM_KV_CACHE_SATURATION]["expr"]


def test_rules_and_dashboards_read_the_alert_settings_only_through_rules_config() -> None:
    """RulesConfig is the one place spec.alerts is interpreted for the rules and the panels."""
    readers = [
        str(path.relative_to(ROOT))
        for folder in ("alert_rules", "dashboards")
        for path in (ROOT / folder).rglob("*.py")
        if "node_modules" not in path.parts and re.search(r"\bspec\.alerts\b", path.read_text())
    ]
    assert readers == ["alert_rules/config.py"]
