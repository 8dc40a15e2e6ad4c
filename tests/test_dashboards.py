"""The dashboards, checked without a server: built from the spec, committed and fresh, every
query parsed by promtool and naming only contract metrics, labels and defined variables,
units on every panel, links and uids that resolve."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from alert_rules import generate
from alert_rules.config import KV_CACHE_THRESHOLD, RulesConfig
from dashboards import build, live, panels, urls
from inferwatch import contract as c
from inferwatch.spec import load_spec, parse_spec

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ROOT / "dashboards" / "generated"
PROVISIONING = ROOT / "dashboards" / "provisioning"
SPEC = load_spec(ROOT / "fleet.yaml")
BUILT = build.build(SPEC)

# PromQL's aggregations, keywords and the functions the dashboards may use.
PROMQL_KEYWORDS = {
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "group",
    "count_values", "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
    "unless", "bool", "offset",
}  # fmt: skip
PROMQL_FUNCTIONS = {
    "rate", "irate", "increase", "delta", "histogram_quantile", "vector", "scalar", "clamp_min",
    "clamp_max", "abs", "label_replace", "sort_desc", "sort", "max_over_time", "min_over_time",
    "avg_over_time", "time", "absent",
}  # fmt: skip
KNOWN_LABELS = (
    {label for m in c.ALL_METRICS.values() for label in m.labels}
    | {v for k, v in vars(c).items() if k.startswith("L_") and isinstance(v, str)}
    | {"le", "job", "instance", "__name__", "severity"}
)
STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')
MATCHERS_RE = re.compile(r"\{([^{}]*)\}")
GROUPING_RE = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
IDENT_RE = re.compile(r"(?<![\w.:])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")


def queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) for every target of every panel."""
    return [(p["title"], t["expr"]) for p in live.panels(dash) for t in p.get("targets", [])]


def variable_queries(dash: dict[str, Any]) -> list[str]:
    return [v["query"] for v in dash["templating"]["list"] if v["type"] == "query"]


def defined_variables(dash: dict[str, Any]) -> set[str]:
    return {v["name"] for v in dash["templating"]["list"]}


def known_series(name: str) -> bool:
    if name in c.ALL_METRICS or name in c.EXTRA_SERIES:
        return True
    return any(name.endswith(s) and name[: -len(s)] in c.ALL_METRICS for s in ("_bucket", "_sum", "_count"))


def promql_names(expr: str) -> tuple[set[str], set[str], set[str]]:
    """(metric names, label names, function names) an expression uses; a small lexer, enough
    for the dashboards' PromQL (variables are replaced by a duration first)."""
    expr = live.VAR_RE.sub("5m", STRING_RE.sub('""', expr))
    labels: set[str] = set()
    for body in MATCHERS_RE.findall(expr):
        labels |= {m.group(1) for m in re.finditer(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", body)}
    expr = MATCHERS_RE.sub(" ", expr)
    for _kw, body in GROUPING_RE.findall(expr):
        labels |= {x.strip() for x in body.split(",") if x.strip()}
    expr = GROUPING_RE.sub(r"\1 ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    metrics: set[str] = set()
    functions: set[str] = set()
    for m in IDENT_RE.finditer(expr):
        ident, call = m.group(1), m.group(2)
        if ident in PROMQL_KEYWORDS:
            continue
        if call:
            functions.add(ident)
        elif not re.fullmatch(r"(?i)inf|nan", ident):
            metrics.add(ident)
    return metrics, labels, functions


def test_builds_every_dashboard_and_counts_them() -> None:
    modules = sorted(
        p.stem
        for p in (ROOT / "dashboards").glob("*.py")
        if re.search(r"^def dashboard\(spec: FleetSpec\)", p.read_text(), re.M)
    )
    assert len(modules) == 4, modules
    assert len(build.DASHBOARDS) == len(modules) == len(BUILT) == 4
    assert {d["title"] for d in BUILT.values()} == {
        "inferwatch / Fleet overview",
        "inferwatch / Model detail",
        "inferwatch / GPU",
        "inferwatch / LLM serving",
    }
    for name, dash in BUILT.items():
        assert dash["uid"] == urls.uid(name)
        assert len(list(live.panels(dash))) >= 6, name


def test_generated_json_is_committed_and_fresh() -> None:
    assert build.stale(SPEC, GENERATED) == [], "run: inferwatch dashboards build"
    assert sorted(p.name for p in GENERATED.glob("*.json")) == sorted(build.filename(n) for n in BUILT)
    tracked = subprocess.run(
        ["git", "ls-files", "dashboards/generated"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert sorted(Path(p).name for p in tracked) == sorted(build.filename(n) for n in BUILT)


def test_json_has_sorted_keys_and_fixed_indent() -> None:
    for path in GENERATED.glob("*.json"):
        text = path.read_text()
        assert text == json.dumps(json.loads(text), sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def test_stale_check_notices_a_spec_change(tmp_path: Path) -> None:
    build.write(SPEC, tmp_path)
    assert build.stale(SPEC, tmp_path) == []
    data = yaml.safe_load((ROOT / "fleet.yaml").read_text())
    data["alerts"]["gpu_memory"]["threshold"] = 0.8
    changed = parse_spec(data)
    assert build.stale(changed, tmp_path) == [tmp_path / "fleet-overview.json", tmp_path / "gpu.json"]


@pytest.mark.parametrize("name", list(BUILT))
def test_every_query_names_only_contract_metrics_labels_and_defined_variables(name: str) -> None:
    dash = BUILT[name]
    defined = defined_variables(dash) | panels.BUILTIN_VARS
    problems = []
    exprs = queries(dash) + [("variable", q) for q in variable_queries(dash)]
    assert len(exprs) >= 10
    for title, expr in exprs:
        if title == "variable":
            m = live.LABEL_VALUES_RE.match(expr)
            assert m, expr
            expr = m.group("match") or ""
            problems += [
                f"{title}: label {m.group('label')}" for _ in [0] if m.group("label") not in KNOWN_LABELS
            ]
        metrics, labels, functions = promql_names(expr)
        problems += [f"{title}: metric {n}" for n in metrics if not known_series(n)]
        problems += [f"{title}: label {n}" for n in labels if n not in KNOWN_LABELS]
        problems += [f"{title}: function {n}" for n in functions if n not in PROMQL_FUNCTIONS]
        for m in live.VAR_RE.finditer(expr):
            var = m.group(1) or m.group(2) or m.group(3)
            if var not in defined:
                problems.append(f"{title}: undefined variable ${var}")
    for panel in live.panels(dash):
        for m in live.VAR_RE.finditer(panel["title"]):
            var = m.group(1) or m.group(2) or m.group(3)
            if var not in defined:
                problems.append(f"{panel['title']}: undefined variable ${var}")
        if panel.get("repeat"):
            assert panel["repeat"] in defined
    assert not problems, "\n".join(problems)


def test_the_lexer_catches_unknown_names() -> None:
    """The name check above must be able to fail: a typo'd metric, label or function is seen."""
    typo = c.REQUESTS_TOTAL.name.replace("requests", "request")  # built, so no file spells it
    metrics, labels, functions = promql_names(
        f'sum by (modle) (rat({typo}{{modle=~"$model"}}[$__rate_interval])) / 1e6'
    )
    assert metrics == {typo} and not known_series(typo)
    assert labels == {"modle"}
    assert functions == {"rat"}


def test_every_query_parses_as_promql(tmp_path: Path) -> None:
    """promtool parses each expression (variables expanded as Grafana would) as a recording rule."""
    ctx = live.Context(
        {
            name: live.Variable(name, ["a", "b.c"], [live.ALL_TOKEN], panels.ALL, True)
            for dash in BUILT.values()
            for name in defined_variables(dash)
        },
        start=0,
        end=3600,
        step=15,
        scrape_interval=15,
    )
    rules = []
    for dash in BUILT.values():
        for _title, expr in queries(dash):
            rules.append({"record": f"dashboard_query_{len(rules)}", "expr": ctx.expand(expr)})
        for q in variable_queries(dash):
            match = live.LABEL_VALUES_RE.match(q).group("match")
            if match:
                rules.append({"record": f"dashboard_query_{len(rules)}", "expr": ctx.expand(match)})
    assert len(rules) >= 40
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    proc = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules)} rules found" in proc.stdout


def test_promtool_check_would_catch_a_broken_query(tmp_path: Path) -> None:
    path = tmp_path / "bad.yml"
    rule = {"record": "x", "expr": "sum by (model) (rate(up[5m])"}
    path.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [rule]}]}))
    assert subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True).returncode != 0


@pytest.mark.parametrize("name", list(BUILT))
def test_every_panel_has_a_unit_an_axis_label_and_the_datasource_variable(name: str) -> None:
    dash = BUILT[name]
    assert "__inputs" not in dash
    for panel in live.panels(dash):
        defaults = panel["fieldConfig"]["defaults"]
        assert defaults.get("unit"), f"{panel['title']}: no unit"
        assert panel["description"], f"{panel['title']}: no description"
        assert panel["datasource"] == panels.DATASOURCE
        for t in panel["targets"]:
            assert t["datasource"] == panels.DATASOURCE
        if panel["type"] == "timeseries":
            assert defaults["custom"]["axisLabel"], f"{panel['title']}: no axis label"
            for ov in panel["fieldConfig"]["overrides"]:
                props = {p["id"]: p["value"] for p in ov["properties"]}
                if props.get("custom.axisPlacement") == "right":
                    assert props.get("unit") and props.get("custom.axisLabel"), panel["title"]
        if panel["type"] == "heatmap":
            assert panel["options"]["yAxis"]["unit"] == "s"


def test_variables_work_for_provisioning_and_import() -> None:
    required = {
        urls.FLEET_OVERVIEW: {"datasource", "namespace", "model", "version", "host"},
        urls.MODEL_DETAIL: {"datasource", "namespace", "model", "version"},
        urls.GPU: {"datasource", "host", "gpu", "namespace"},
        urls.LLM_SERVING: {"datasource", "namespace", "model", "version"},
    }
    for name, dash in BUILT.items():
        variables = {v["name"]: v for v in dash["templating"]["list"]}
        assert required[name] <= set(variables), name
        ds = variables["datasource"]
        assert ds["type"] == "datasource" and ds["query"] == "prometheus"
        for v in variables.values():
            if v["type"] == "query":
                assert v["datasource"] == panels.DATASOURCE
                if v["includeAll"]:
                    assert v["allValue"] == ".*", "All must also match series without the label"


def _panel(dash: dict[str, Any], title: str) -> dict[str, Any]:
    return next(p for p in live.panels(dash) if p["title"] == title)


def _steps(panel: dict[str, Any]) -> list[float]:
    return [
        s["value"] for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"] if s["value"] is not None
    ]


def test_thresholds_and_windows_come_from_the_spec() -> None:
    data = yaml.safe_load((ROOT / "fleet.yaml").read_text())
    data["alerts"]["error_rate"].update(threshold=0.02, window="2m")
    data["alerts"]["latency"].update(sla_factor=3, quantile=0.95, window="10m")
    data["alerts"]["gpu_memory"]["threshold"] = 0.8
    data["defaults"]["latency_sla_ms"] = 750
    spec = parse_spec(data)
    built = build.build(spec)
    fleet, model, gpu = built[urls.FLEET_OVERVIEW], built[urls.MODEL_DETAIL], built[urls.GPU]

    errors = _panel(fleet, "Server-error ratio by model and version")
    assert _steps(errors) == [panels.HEALTHY_ERROR_RATIO, 0.02]
    assert "over 2m windows" in errors["description"]
    assert _steps(_panel(model, "Server-error ratio by version")) == [panels.HEALTHY_ERROR_RATIO, 0.02]
    assert _steps(_panel(fleet, "Timeout ratio by model")) == [panels.HEALTHY_TIMEOUT_RATIO]
    assert 'code=~"504|DEADLINE_EXCEEDED"' in _panel(fleet, "Timeout ratio by model")["targets"][0]["expr"]

    ratio = _panel(fleet, "P95 latency / SLA by model and version")
    assert _steps(ratio) == [1.0, 3.0]
    assert 'quantile="0.95"' in ratio["targets"][0]["expr"]
    assert "over 10m" in ratio["description"] and "default 0.75s" in ratio["description"]
    per_model = _panel(fleet, "Latency: $model")
    assert per_model["repeat"] == "model"
    legends = [t["legendFormat"] for t in per_model["targets"]]
    assert legends == ["P50 version {{version}}", "P95 version {{version}}", "SLA", "3x SLA"]
    assert per_model["targets"][3]["expr"].startswith("(3 * ")

    assert _steps(_panel(gpu, "Framebuffer used / total")) == [0.8]
    assert _steps(_panel(fleet, "GPU framebuffer used by GPU")) == [0.8]
    util = _panel(gpu, "GPU utilization")
    assert _steps(util) == list(panels.GPU_UTIL_BAND)
    assert [s["color"] for s in util["fieldConfig"]["defaults"]["thresholds"]["steps"]] == [
        "transparent",
        "green",
        "transparent",
    ]
    assert util["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] == "area"


def test_alerts_firing_now_panel() -> None:
    panel = _panel(BUILT[urls.FLEET_OVERVIEW], "Alerts firing now")
    assert panel["type"] == "table"
    assert panel["targets"][0]["instant"] is True
    assert panel["targets"][0]["expr"] == 'ALERTS{alertstate="firing"}'


FIELD_LABEL_RE = re.compile(r"\$\{__field\.labels\.(\w+)\}")
# Drill-downs: (dashboard, panel title) -> the dashboard its series link to.
DRILL_DOWNS = {
    **{
        (urls.FLEET_OVERVIEW, title): urls.MODEL_DETAIL
        for title in (
            "Request rate by model",
            "Server-error ratio by model and version",
            "Timeout ratio by model",
            "Shed requests by model and reason",
            "P99 latency / SLA by model and version",
            "Requests in flight by model",
        )
    },
    (urls.FLEET_OVERVIEW, "GPU framebuffer used by GPU"): urls.GPU,
    **{
        (urls.GPU, title): urls.GPU  # GPU -> its pods ("GPU memory by pod" narrowed to it)
        for title in (
            "GPU utilization",
            "Framebuffer used / total",
            "Framebuffer used",
            "Memory copy utilization",
            "Temperature",
            "Power draw",
            "Clocks",
            "Last XID error",
        )
    },
}


def test_links_between_dashboards_resolve() -> None:
    paths = {urls.path(n) for n in BUILT}
    for name, dash in BUILT.items():
        linked = {link["url"] for link in dash["links"]}
        assert linked == paths - {urls.path(name)}
        assert all(link["includeVars"] and link["keepTime"] for link in dash["links"])


def test_drill_downs_are_data_links_on_the_clicked_series() -> None:
    """Every drill-down is a data link (fieldConfig.defaults.links, offered on a click on a
    series), to an existing dashboard, setting only variables that dashboard defines, from
    labels every series of the panel carries, with the time range and data source kept."""
    found = {}
    for name, dash in BUILT.items():
        for panel in live.panels(dash):
            assert not panel.get("links"), f"{panel['title']}: panel links; drill-downs are data links"
            for link in panel["fieldConfig"]["defaults"].get("links", []):
                path, query = link["url"].split("?", 1)
                (target,) = [n for n in BUILT if urls.path(n) == path]
                found[(name, panel["title"])] = target
                params = query.split("&")
                assert "${__url_time_range}" in params and "${datasource:queryparam}" in params, link
                set_vars = {p.split("=", 1)[0].removeprefix("var-") for p in params if p.startswith("var-")}
                carried = {m.group(1) for p in params if (m := re.fullmatch(r"\$\{(\w+):queryparam\}", p))}
                assert set_vars | carried <= defined_variables(BUILT[target]), link
                labels = set(FIELD_LABEL_RE.findall(link["url"]))
                assert labels, link
                for t in panel["targets"]:
                    assert all("{{" + label + "}}" in t["legendFormat"] for label in labels), (
                        f"{panel['title']}: series without {labels}"
                    )
    assert found == DRILL_DOWNS
    rate = _panel(BUILT[urls.FLEET_OVERVIEW], "Request rate by model")
    assert rate["fieldConfig"]["defaults"]["links"][0]["url"].startswith(
        urls.path(urls.MODEL_DETAIL) + "?var-model=${__field.labels.model}&"
    )


def test_uids_are_stable_and_dashboard_url_points_at_them() -> None:
    for name, dash in BUILT.items():
        assert dash["uid"] == urls.uid(name) == urls.uid(dash["title"])
        assert len(dash["uid"]) <= 40
        assert re.fullmatch(r"[a-z0-9-]+", dash["uid"])
        assert urls.dashboard_url(SPEC, name) == (
            f"{SPEC.links.grafana_url.rstrip('/')}/d/{dash['uid']}/{urls.slug(dash['title'])}"
        )
        # The committed JSON carries the same uid (what an alert link resolves to).
        assert json.loads((GENERATED / build.filename(name)).read_text())["uid"] == dash["uid"]
    assert len({d["uid"] for d in BUILT.values()}) == len(BUILT)
    url = urls.dashboard_url(SPEC, urls.MODEL_DETAIL, {"model": "{{ $labels.model }}"})
    assert url.endswith("/d/inferwatch-model-detail/inferwatch-model-detail?var-model={{ $labels.model }}")
    with pytest.raises(KeyError, match="unknown dashboard"):
        urls.uid("nope")


def test_configmaps_for_kube_prometheus_stack() -> None:
    maps = build.configmaps(SPEC, namespace="monitoring")
    assert len(maps) == len(BUILT)
    for cm in maps:
        assert cm["kind"] == "ConfigMap" and cm["metadata"]["namespace"] == "monitoring"
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        ((key, text),) = cm["data"].items()
        name = key.removesuffix(".json")
        assert json.loads(text) == BUILT[name]
        assert text == (GENERATED / key).read_text()


def test_provisioning_files_point_grafana_at_the_generated_json() -> None:
    ds = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yaml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"] is True
    assert source["url"].endswith(f":{c.PORTS['prometheus']}")
    assert source["jsonData"]["timeInterval"] == SPEC.prometheus.scrape_interval
    # Exemplars (trace_id) are asked for where the P99 is drawn.
    p99 = _panel(BUILT[urls.MODEL_DETAIL], "P50 and P99 latency by version")
    assert [t.get("exemplar", False) for t in p99["targets"]] == [False, True, False, False]
    prov = yaml.safe_load((PROVISIONING / "dashboards" / "inferwatch.yaml").read_text())
    (provider,) = prov["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]


def test_variable_expansion_matches_grafana() -> None:
    variables = {
        "model": live.Variable("model", ["a.b", "c"], [live.ALL_TOKEN], ".*", True),
        "version": live.Variable("version", ["1", "2"], ["1", "2"], ".*", True),
        "host": live.Variable("host", ["h1"], ["h1"], None, False),
    }
    ctx = live.Context(variables, start=0, end=600, step=15, scrape_interval=1)
    assert ctx.expand('x{model=~"$model", version=~"${version}", Hostname="[[host]]"}') == (
        'x{model=~".*", version=~"(1|2)", Hostname="h1"}'
    )
    assert ctx.expand("rate(x[$__rate_interval])") == "rate(x[16s])"
    assert ctx.with_overrides({"model": "c"}).expand("Latency: $model") == "Latency: c"
    assert live.Variable("m", ["a.b", "c"], ["a.b", "c"], None, True).value() == r"(a\\.b|c)"
    assert live.legend("v{{version}} P99", {"version": "2"}) == "v2 P99"


def test_cli_build_writes_and_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from inferwatch.cli import main

    exe = str(ROOT / ".venv" / "bin" / "inferwatch")
    out = tmp_path / "gen"
    # The console script once, end to end; the rest in-process (same code, no interpreter start).
    proc = subprocess.run([exe, "dashboards", "build", "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(build.filename(n) for n in BUILT)
    assert main(["dashboards", "build", "--out", str(out), "--check"]) == 0
    (out / "gpu.json").write_text("{}")
    assert main(["dashboards", "build", "--out", str(out), "--check"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("inferwatch: error: stale dashboards") and "gpu.json" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("alerts:\n  error_rate:\n    threshold: 7\n")
    assert main(["dashboards", "build", "--spec", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "alerts.error_rate.threshold" in err
    assert (out / "gpu.json").read_text() == "{}", "a bad spec must not touch the output"
    # A spec the alert rules' config refuses (the panels read the alert settings through it).
    bad.write_text('links:\n  runbook_base_url: ""\n')
    assert main(["dashboards", "build", "--spec", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "links.runbook_base_url is required" in err
    assert (out / "gpu.json").read_text() == "{}"


def test_cli_snapshot_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from inferwatch.cli import main

    for args, msg in (
        (["--prometheus", "localhost:9090"], "is not a Prometheus URL"),
        (["--prometheus", "http://127.0.0.1:9", "--range", "soon"], "is not a duration"),
        (["--prometheus", "http://127.0.0.1:9", "--var", "model"], "use NAME=VALUE"),
        (["--prometheus", "http://127.0.0.1:9", "--dashboard", "nope"], "unknown dashboard 'nope'"),
        (["--prometheus", "http://127.0.0.1:9"], "cannot reach Prometheus"),
    ):
        code = main(["dashboards", "snapshot", "--out", str(tmp_path / "snap"), *args])
        err = capsys.readouterr().err
        assert code != 0, args
        assert err.startswith("inferwatch: error: ") and msg in err and err.count("\n") == 1, err


# Panels that draw an alert's threshold -> the alert. Each must query the alert's own expression.
THRESHOLD_PANELS = {
    (urls.FLEET_OVERVIEW, "Server-error ratio by model and version"): c.ALERT_HIGH_ERROR_RATE,
    (urls.MODEL_DETAIL, "Server-error ratio by version"): c.ALERT_HIGH_ERROR_RATE,
    (urls.FLEET_OVERVIEW, "P99 latency / SLA by model and version"): c.ALERT_HIGH_P99_LATENCY,
    (urls.FLEET_OVERVIEW, "Latency: $model"): c.ALERT_HIGH_P99_LATENCY,
    (urls.MODEL_DETAIL, "P50 and P99 latency by version"): c.ALERT_HIGH_P99_LATENCY,
    (urls.FLEET_OVERVIEW, "GPU framebuffer used by GPU"): c.ALERT_GPU_MEMORY_PRESSURE,
    (urls.GPU, "Framebuffer used / total"): c.ALERT_GPU_MEMORY_PRESSURE,
    (urls.LLM_SERVING, "Time to first token: $model"): c.ALERT_HIGH_TTFT,
    (urls.LLM_SERVING, "Time per output token: $model"): c.ALERT_HIGH_TPOT,
    (urls.LLM_SERVING, "KV-cache usage"): c.ALERT_LLM_KV_CACHE_SATURATION,
}
VAR_MATCHER_RE = re.compile(r'(,\s*)?\w+=~"\$\w+"')
UNVERSIONED_RE = re.compile(r'label_replace\((.*), "version", "default", "version", ""\)', re.S)


def _without_dashboard_variables(expr: str) -> str:
    """The expression as the rules would write it: no ``label=~"$var"`` matchers, no legend renaming."""
    expr = VAR_MATCHER_RE.sub("", expr).replace("{, ", "{").replace("{}", "")
    m = UNVERSIONED_RE.fullmatch(expr)
    return m.group(1) if m else expr


def _flat(expr: str) -> str:
    return re.sub(r"\s+", "", expr)


def test_each_threshold_panel_queries_its_alerts_expression() -> None:
    """A panel that draws an alert's threshold shows the very series the alert compares (its
    recording rule, or the alert's two sides), so the panel and the page cannot disagree."""
    rules = [r for _name, group in generate.rule_groups(SPEC) for r in group["rules"]]
    alert = {r["alert"]: r["expr"] for r in rules if "alert" in r}
    record = {r["record"]: r["expr"] for r in rules if "record" in r and "labels" not in r}
    cfg = RulesConfig.from_spec(SPEC)

    # Every panel with an alert's threshold line (or an "Nx SLA" line) is in the table.
    factor_line = f"{cfg.latency_factor:g}x SLA"
    alert_values = {cfg.error_threshold, cfg.gpu_threshold, cfg.latency_factor, KV_CACHE_THRESHOLD}
    drawn = {
        (name, panel["title"])
        for name, dash in BUILT.items()
        for panel in live.panels(dash)
        if alert_values & set(_steps(panel))
        or any(t["legendFormat"] == factor_line for t in panel["targets"])
    }
    assert drawn == set(THRESHOLD_PANELS)

    def exprs(name: str, title: str) -> dict[str, str]:
        panel = _panel(BUILT[name], title)
        return {t["legendFormat"]: _without_dashboard_variables(t["expr"]) for t in panel["targets"]}

    # Errors: the panels read the recorded ratio. It divides by the recorded request rate; with
    # that record's own expression put back, and without its zeros (which never pass a
    # threshold above 0), it is the ratio the alert judges window by window.
    ratio = re.fullmatch(
        r"\(\s*(?P<errors>.+?)\s+or\s+0 \* (?P<total>\S+)\s*\)\s*/\s*\((?P=total) > (?P<min>\S+)\)",
        record[c.REC_SERVER_ERROR_RATIO],
        re.S,
    )
    assert ratio, record[c.REC_SERVER_ERROR_RATIO]
    judged = f"{ratio['errors']} / ({record[ratio['total']]} > {ratio['min']}) > {cfg.error_threshold:g}"
    assert _flat(judged) in _flat(alert[c.ALERT_HIGH_ERROR_RATE])
    assert alert[c.ALERT_HIGH_ERROR_RATE].count(f"> {cfg.error_threshold:g}\n") == 1
    for key in [k for k, v in THRESHOLD_PANELS.items() if v == c.ALERT_HIGH_ERROR_RATE]:
        assert list(exprs(*key).values()) == [c.REC_SERVER_ERROR_RATIO], key
        assert _steps(_panel(BUILT[key[0]], key[1]))[-1] == cfg.error_threshold

    # Latency: the alert is "quantile > factor x SLA"; the panels draw those two sides.
    lhs, rhs = alert[c.ALERT_HIGH_P99_LATENCY].split(f"\n> on ({c.L_MODEL}) group_left ()\n")
    assert rhs == f"({cfg.latency_factor:g} * {c.REC_LATENCY_SLA})"
    q = cfg.quantile_name
    fleet_ratio = f"P{cfg.latency_quantile * 100:g} latency / SLA by model and version"
    assert list(exprs(urls.FLEET_OVERVIEW, fleet_ratio).values()) == [
        f"{lhs} / on ({c.L_MODEL}) group_left () {c.REC_LATENCY_SLA}"
    ]
    assert _steps(_panel(BUILT[urls.FLEET_OVERVIEW], fleet_ratio))[-1] == cfg.latency_factor
    per_model = exprs(urls.FLEET_OVERVIEW, "Latency: $model")
    assert per_model[f"{q} version {{{{version}}}}"] == lhs
    assert per_model[factor_line] == rhs and per_model["SLA"] == c.REC_LATENCY_SLA
    detail = exprs(urls.MODEL_DETAIL, f"P50 and {q} latency by version")
    assert detail[factor_line] == rhs and detail["SLA"] == c.REC_LATENCY_SLA

    # GPU memory: the alert compares the recorded ratio; the panels draw it per GPU.
    gpu_lhs, gpu_threshold = alert[c.ALERT_GPU_MEMORY_PRESSURE].split(" > ")
    assert float(gpu_threshold) == cfg.gpu_threshold
    assert list(exprs(urls.FLEET_OVERVIEW, "GPU framebuffer used by GPU").values()) == [gpu_lhs]
    assert list(exprs(urls.GPU, "Framebuffer used / total").values()) == [
        f"max by (Hostname, gpu) ({gpu_lhs})"
    ]

    # LLM: TTFT and TPOT as the latency warning (recorded quantile > factor x recorded SLA); the
    # KV cache as the info alert (the recorded usage above its threshold).
    for alertname, title, sla in (
        (c.ALERT_HIGH_TTFT, "Time to first token: $model", c.REC_TTFT_SLA),
        (c.ALERT_HIGH_TPOT, "Time per output token: $model", c.REC_TPOT_SLA),
    ):
        lhs, rhs = alert[alertname].split(f"\n> on ({c.L_MODEL}) group_left ()\n")
        assert rhs == f"({cfg.latency_factor:g} * {sla})"
        drawn_exprs = exprs(urls.LLM_SERVING, title)
        assert drawn_exprs[f"{q} version {{{{version}}}}"] == lhs
        assert drawn_exprs[factor_line] == rhs and drawn_exprs["SLA"] == sla
    kv_lhs, kv_threshold = alert[c.ALERT_LLM_KV_CACHE_SATURATION].split(" > ")
    assert float(kv_threshold) == KV_CACHE_THRESHOLD
    assert list(exprs(urls.LLM_SERVING, "KV-cache usage").values()) == [kv_lhs]
    assert _steps(_panel(BUILT[urls.LLM_SERVING], "KV-cache usage"))[-1] == KV_CACHE_THRESHOLD


def test_the_panel_expression_check_sees_a_drifted_panel() -> None:
    """The comparison above is textual on purpose: a panel with its own PromQL does not pass."""
    own = panels.ratio_or_zero('rate(x{outcome="server_error"}[1m])', "rate(x[1m])", "model")
    assert _without_dashboard_variables(own) != c.REC_SERVER_ERROR_RATIO
    recorded = f'{c.REC_SERVER_ERROR_RATIO}{{model=~"$model", version=~"$version"}}'
    assert _without_dashboard_variables(recorded) == c.REC_SERVER_ERROR_RATIO
