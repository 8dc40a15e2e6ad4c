"""deploy/sync.py: the deployment files that derive from the fleet spec are fresh, follow
the spec when it changes, and a bad spec is refused with one line and nothing written."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import yaml

from alert_rules.alertmanager import render_alertmanager_config
from inferwatch.stack.config import local_routing
from tests.fixtures.deploy import ROOT

SCRIPT = ROOT / "deploy" / "sync.py"


def _load_sync():
    spec = importlib.util.spec_from_file_location("deploy_sync", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


sync = _load_sync()


def run_sync(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_committed_files_are_fresh() -> None:
    proc = run_sync("--check")
    assert proc.returncode == 0, proc.stderr


def test_files_follow_the_spec(tmp_path: Path) -> None:
    data = yaml.safe_load((ROOT / "fleet.yaml").read_text())
    data["prometheus"]["scrape_interval"] = "30s"
    data["routing"]["critical"]["group_wait"] = "20s"
    spec_path = tmp_path / "fleet.yaml"
    spec_path.write_text(yaml.safe_dump(data))
    base = sync.outputs(ROOT / "fleet.yaml")
    changed = sync.outputs(spec_path)
    differ = {p.relative_to(ROOT).as_posix() for p in base if base[p] != changed[p]}
    # (the rules and dashboards may follow the scrape interval too)
    assert differ >= {
        "deploy/docker/prometheus.yml",
        "deploy/docker/alertmanager.yml",
        "deploy/kubernetes/base/alertmanager/alertmanagerconfig.yaml",
        "deploy/kubernetes/components/sidecar/fleet.yaml",
    }
    prom = yaml.safe_load(changed[sync.DOCKER / "prometheus.yml"])
    assert prom["global"]["scrape_interval"] == "30s"
    amc = yaml.safe_load(changed[sync.K8S / "base/alertmanager/alertmanagerconfig.yaml"])
    (critical,) = [r for r in amc["spec"]["route"]["routes"] if r["matchers"][0]["value"] == "critical"]
    assert critical["groupWait"] == "20s"


def test_alertmanagerconfig_matches_the_rule_generators_routing() -> None:
    """The CR is a translation of the native config the rule generator renders, not a
    second routing design: same receivers, grouping, timings and matchers per severity."""
    from inferwatch.spec import load_spec

    spec = load_spec(ROOT / "fleet.yaml")
    native = render_alertmanager_config(local_routing(spec, sync.K8S_PAGER_URL, Path("t")))
    amc = yaml.safe_load((sync.K8S / "base/alertmanager/alertmanagerconfig.yaml").read_text())["spec"]
    route = amc["route"]
    assert route["receiver"] == native["route"]["receiver"]
    assert route["groupBy"] == native["route"]["group_by"]
    assert len(route["routes"]) == len(native["route"]["routes"])
    for got, want in zip(route["routes"], native["route"]["routes"], strict=True):
        assert got["receiver"] == want["receiver"]
        assert (got["groupWait"], got["groupInterval"], got["repeatInterval"]) == (
            want["group_wait"],
            want["group_interval"],
            want["repeat_interval"],
        )
        assert [f'{m["name"]}{m["matchType"]}"{m["value"]}"' for m in got["matchers"]] == want["matchers"]
    assert [r["name"] for r in amc["receivers"]] == [r["name"] for r in native["receivers"]]
    assert len(amc["inhibitRules"]) == len(native["inhibit_rules"])
    for got, want in zip(amc["inhibitRules"], native["inhibit_rules"], strict=True):
        assert [f'{m["name"]}{m["matchType"]}"{m["value"]}"' for m in got["sourceMatch"]] == want[
            "source_matchers"
        ]
        assert [f'{m["name"]}{m["matchType"]}"{m["value"]}"' for m in got["targetMatch"]] == want[
            "target_matchers"
        ]
        assert got["equal"] == want["equal"]


def test_a_bad_spec_is_refused_with_one_line_and_nothing_written(tmp_path: Path) -> None:
    bad = tmp_path / "fleet.yaml"
    bad.write_text("version: 1\nalerts:\n  error_rate:\n    threshold: 7\n")
    before = {p: p.read_bytes() for p in sync.outputs(ROOT / "fleet.yaml")}
    proc = run_sync("--spec", str(bad))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("deploy/sync.py: error: ")
    assert "threshold" in lines[0]
    assert {p: p.read_bytes() for p in before} == before
    missing = run_sync("--spec", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1


def test_check_names_a_stale_file(tmp_path: Path) -> None:
    data = yaml.safe_load((ROOT / "fleet.yaml").read_text())
    data["prometheus"]["evaluation_interval"] = "30s"
    spec_path = tmp_path / "fleet.yaml"
    spec_path.write_text(yaml.safe_dump(data))
    proc = run_sync("--check", "--spec", str(spec_path))
    assert proc.returncode == 1
    assert "stale: deploy/docker/prometheus.yml" in proc.stderr
