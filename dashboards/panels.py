"""Shared panel helpers: the datasource, variables, selectors, thresholds and layout every
inferwatch dashboard uses, so each dashboard module only says what it shows.

Every panel gets a unit (and an axis label where the unit alone is ambiguous); every
query reaches Prometheus through the ``datasource`` variable, which works both when the
JSON is imported through Grafana's UI and when it is loaded by file provisioning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from grafanalib import core as g

from dashboards import urls
from dashboards.tidy import SCHEMA_VERSION
from inferwatch import contract as c

DS_VAR = "datasource"
DATASOURCE = {"type": "prometheus", "uid": "${" + DS_VAR + "}"}
ALL = ".*"  # what "All" means in a regex matcher; also matches series without the label
TAGS = ["inferwatch"]

# Grafana's built-in interval variables a query may use besides the dashboard's own.
BUILTIN_VARS = frozenset({"__rate_interval", "__interval", "__range"})
RATE = "$__rate_interval"

# Grafana colours used for meaning, so every dashboard says "bad" the same way.
OK = "green"
WARN = "orange"
BAD = "red"
NONE = "transparent"


# ---------------------------------------------------------------------------------------
# Variables
# ---------------------------------------------------------------------------------------
def datasource_var() -> g.Template:
    return g.Template(
        name=DS_VAR,
        label="Data source",
        query="prometheus",
        type="datasource",
        default="Prometheus",
    )


def query_var(
    name: str, label: str, metric: str, label_name: str, selector: str = "", multi: bool = True
) -> g.Template:
    """A variable listing the values of ``label_name`` on ``metric{selector}``. A multi-value
    variable offers "All" (``.*``); a single-value one starts on the first value."""
    sel = "{" + selector + "}" if selector else ""
    return g.Template(
        name=name,
        label=label,
        query=f"label_values({metric}{sel}, {label_name})",
        dataSource=DATASOURCE,
        includeAll=multi,
        multi=multi,
        allValue=ALL if multi else None,
        default="$__all" if multi else None,
        refresh=g.REFRESH_ON_TIME_RANGE_CHANGE,
    )


def namespace_var(metric: str) -> g.Template:
    # Locally (no Kubernetes) the label is absent: "All" (.*) still matches every series.
    return query_var("namespace", "Namespace", metric, c.L_NAMESPACE)


def model_var(multi: bool = True) -> g.Template:
    # The overflow value (requests naming a model the upstream does not serve) is counted but
    # not timed, so a panel repeated for it would be empty; "All" (.*) still counts it.
    return query_var(
        "model",
        "Model",
        c.REQUESTS_TOTAL.name,
        c.L_MODEL,
        f'namespace=~"$namespace", {c.L_MODEL}!="{c.MODEL_OVERFLOW}"',
        multi=multi,
    )


def version_var() -> g.Template:
    return query_var(
        "version",
        "Version",
        c.REQUESTS_TOTAL.name,
        c.L_VERSION,
        'namespace=~"$namespace", model=~"$model"',
    )


def host_var() -> g.Template:
    return query_var("host", "Host", c.DCGM_GPU_UTIL.name, c.L_HOSTNAME)


def gpu_var() -> g.Template:
    return query_var("gpu", "GPU", c.DCGM_GPU_UTIL.name, c.L_GPU, 'Hostname=~"$host"')


# ---------------------------------------------------------------------------------------
# Selectors (label matchers every query of a kind carries)
# ---------------------------------------------------------------------------------------
MODEL_SEL = 'namespace=~"$namespace", model=~"$model"'
MODEL_VERSION_SEL = MODEL_SEL + ', version=~"$version"'
HOST_SEL = 'Hostname=~"$host"'
GPU_SEL = HOST_SEL + ', gpu=~"$gpu"'
# The recording rules aggregate across namespaces, as the alerts judge: their series have no
# namespace label to select on.
REC_MODEL_SEL = 'model=~"$model"'
REC_MODEL_VERSION_SEL = REC_MODEL_SEL + ', version=~"$version"'
ACROSS_NAMESPACES = "all namespaces together, as the alert sees them"


def sel(metric: c.Metric | str, selector: str, suffix: str = "") -> str:
    name = metric.name if isinstance(metric, c.Metric) else metric
    return f"{name}{suffix}{{{selector}}}"


def rate(metric: c.Metric | str, selector: str, window: str = RATE, suffix: str = "") -> str:
    return f"rate({sel(metric, selector, suffix)}[{window}])"


def ratio_or_zero(numerator: str, denominator: str, by: str) -> str:
    """``numerator / denominator`` by ``by``, reading 0 (not "No data") where the numerator has
    no series yet: a counter with a label value that never happened does not exist."""
    return (
        f"(sum by ({by}) ({numerator}) or 0 * sum by ({by}) ({denominator})) / sum by ({by}) ({denominator})"
    )


def shed_by_reason(by: str, shed_sel: str, total_sel: str) -> str:
    """Requests/s the sidecars' per-model limits shed, by ``by`` and reason; a model with
    traffic that sheds nothing reads 0 (one series without a reason), not "No data"."""
    labels = ", ".join(x for x in (by, c.L_REASON) if x)
    shed = f"sum by ({labels}) ({rate(c.REQUESTS_SHED, shed_sel)})"
    zero = f"0 * sum by ({by}) ({rate(c.REQUESTS_TOTAL, total_sel)})"
    return f"{shed} or ({zero} unless on ({by}) {shed})"


def quantile(q: float, bucket_rate: str, by: str) -> str:
    labels = ", ".join(x for x in (by, "le") if x)
    return f"histogram_quantile({q:g}, sum by ({labels}) ({bucket_rate}))"


def quantile_label(q: float) -> str:
    return f"P{q * 100:g}"


# ---------------------------------------------------------------------------------------
# Targets, thresholds, overrides, links
# ---------------------------------------------------------------------------------------
def target(
    expr: str,
    legend: str = "",
    ref: str = "A",
    instant: bool = False,
    fmt: str = g.TIME_SERIES_TARGET_FORMAT,
    exemplar: bool = False,
) -> g.Target:
    t = g.Target(
        expr=expr,
        legendFormat=legend,
        refId=ref,
        instant=instant,
        format=fmt,
        datasource=DATASOURCE,
        intervalFactor=1,
    )
    if exemplar:
        # grafanalib's Target has no exemplar flag; Grafana reads it from the target.
        t = _ExemplarTarget(**{a.name: getattr(t, a.name) for a in t.__attrs_attrs__})
    return t


class _ExemplarTarget(g.Target):
    def to_json_data(self) -> dict[str, Any]:
        return {**super().to_json_data(), "exemplar": True}


def targets(*pairs: tuple[str, str], exemplar_ref: str | None = None) -> list[g.Target]:
    """Targets from (expr, legend) pairs, refIds A, B, C, ..."""
    out = []
    for i, (expr, legend) in enumerate(pairs):
        ref = chr(ord("A") + i)
        out.append(target(expr, legend, ref, exemplar=(ref == exemplar_ref)))
    return out


def steps(base: str, *rest: tuple[float, str]) -> list[dict[str, Any]]:
    """Threshold steps: the base colour, then (value, colour) in increasing order."""
    values = [v for v, _ in rest]
    if values != sorted(values):
        raise ValueError(f"threshold values must increase: {values}")
    return [{"color": base, "value": None}, *({"color": col, "value": v} for v, col in rest)]


def dashed(name: str, color: str) -> dict[str, Any]:
    """An override drawing the series named ``name`` as a fixed-colour dashed reference line."""
    return {
        "matcher": {"id": "byName", "options": name},
        "properties": [
            {"id": "color", "value": {"mode": "fixed", "fixedColor": color}},
            {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
            {"id": "custom.lineWidth", "value": 2},
        ],
    }


def data_link(name: str, title: str, carry: Sequence[str] = (), **variables: str) -> dict[str, Any]:
    """A data link (``fieldConfig.defaults.links``) to another inferwatch dashboard: offered
    on a click on a series, where ``${__field.labels.X}`` is the clicked series' label X
    (a panel link, in the header menu, has no series and never resolves it). ``variables``
    are set from the series; the dashboard variables in ``carry``, the data source and the
    time range go along as they are."""
    params = [f"var-{k}={v}" for k, v in variables.items()]
    params += ["${" + v + ":queryparam}" for v in (DS_VAR, *carry)]
    query = "&".join([*params, "${__url_time_range}"])
    return {"title": title, "url": f"{urls.path(name)}?{query}", "targetBlank": False}


def series_label(label: str) -> str:
    """The clicked series' value of ``label``, in a data link."""
    return "${__field.labels." + label + "}"


def dashboard_links(current: str) -> list[g.DashboardLink]:
    """Header links to the other inferwatch dashboards, carrying time range and variables."""
    return [
        g.DashboardLink(
            title=urls.TITLES[name].split(" / ", 1)[-1],
            type="link",
            uri=urls.path(name),
            icon="dashboard",
            includeVars=True,
            keepTime=True,
            tooltip=f"Open {urls.TITLES[name]}",
        )
        for name in urls.TITLES
        if name != current
    ]


# ---------------------------------------------------------------------------------------
# Panels
# ---------------------------------------------------------------------------------------
@dataclass
class Panel:
    """A panel before layout: grafanalib object plus its width and height in grid units."""

    obj: g.Panel
    w: int = 12
    h: int = 8


def timeseries(
    title: str,
    description: str,
    tgts: Sequence[g.Target],
    unit: str,
    axis_label: str,
    *,
    thresholds: list[dict[str, Any]] | None = None,
    thresholds_style: str = "off",
    min_: float | None = 0,
    max_: float | None = None,
    soft_max: float | None = None,
    overrides: Sequence[dict[str, Any]] = (),
    links: Sequence[dict[str, Any]] = (),
    repeat: str | None = None,
    stack: bool = False,
    fill: int = 0,
    legend_calcs: Sequence[str] = ("lastNotNull", "max"),
    w: int = 12,
    h: int = 8,
) -> Panel:
    custom: dict[str, Any] = {}
    if soft_max is not None:
        custom["axisSoftMax"] = round(soft_max, 6)
    obj = g.TimeSeries(
        title=title,
        description=description,
        dataSource=DATASOURCE,
        targets=list(tgts),
        unit=unit,
        axisLabel=axis_label,
        thresholds=thresholds or steps(OK),
        thresholdsStyleMode=thresholds_style,
        overrides=list(overrides),
        repeat=g.Repeat(direction="h", variable=repeat, maxPerRow=3) if repeat else g.Repeat(),
        stacking={"mode": "normal", "group": "A"} if stack else {"mode": "none", "group": "A"},
        fillOpacity=fill,
        legendDisplayMode="table",
        legendCalcs=list(legend_calcs),
        tooltipMode="multi",
        tooltipSort="desc",
        maxDataPoints=300,
        extraJson={
            "fieldConfig": {"defaults": {"min": min_, "max": max_, "custom": custom, "links": list(links)}},
            "options": {"legend": {"showLegend": True}},
        },
    )
    return Panel(obj, w, h)


def heatmap(
    title: str, description: str, expr: str, unit: str, axis_label: str, w: int = 12, h: int = 8
) -> Panel:
    """A heatmap of pre-bucketed histogram data (one series per ``le``), with the options of
    the current (non-Angular) heatmap panel; grafanalib's Angular keys go in tidy()."""
    obj = g.Heatmap(
        title=title,
        description=description,
        dataSource=DATASOURCE,
        targets=[target(expr, "{{le}}", fmt="heatmap")],
        thresholds=steps(OK),
        maxDataPoints=60,
        extraJson={
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {
                "calculate": False,
                "cellGap": 1,
                "cellValues": {"unit": "short"},
                "color": {
                    "mode": "scheme",
                    "scheme": "Oranges",
                    "fill": BAD,
                    "scale": "exponential",
                    "exponent": 0.5,
                    "steps": 64,
                    "reverse": False,
                },
                "exemplars": {"color": "rgba(255,0,255,0.7)"},
                "yAxis": {"axisPlacement": "left", "unit": unit, "axisLabel": axis_label, "reverse": False},
                "rowsFrame": {"layout": "le"},
                "tooltip": {"mode": "single", "yHistogram": True, "showColorScale": False},
                "legend": {"show": True},
                "showValue": "never",
                "filterValues": {"le": 1e-9},
            },
        },
    )
    return Panel(obj, w, h)


def table(
    title: str,
    description: str,
    expr: str,
    unit: str = "short",
    hide: Sequence[str] = (),
    first: Sequence[str] = (),
    w: int = 24,
    h: int = 7,
) -> Panel:
    """An instant-query table (one row per series, labels as columns; ``first`` leads)."""
    obj = g.Table(
        title=title,
        description=description,
        dataSource=DATASOURCE,
        targets=[target(expr, instant=True, fmt=g.TABLE_TARGET_FORMAT)],
        thresholds=steps(OK),
        unit=unit,
        extraJson={
            "fieldConfig": {
                "defaults": {"custom": {"align": "auto", "cellOptions": {"type": "auto"}, "inspect": False}}
            },
            "options": {
                "cellHeight": "sm",
                "frameIndex": 0,
                "showHeader": True,
                "footer": {"show": False, "reducer": ["sum"], "countRows": False},
            },
            "transformations": [
                {
                    "id": "organize",
                    "options": {
                        "excludeByName": dict.fromkeys(("Time", "Value", *hide), True),
                        "indexByName": {name: i for i, name in enumerate(first)},
                    },
                }
            ],
        },
    )
    return Panel(obj, w, h)


@dataclass
class Row:
    title: str
    panels: list[Panel] = field(default_factory=list)


def layout(rows: Sequence[Row]) -> list[g.Panel]:
    """Place rows top to bottom; panels fill each row left to right, wrapping at 24 columns."""
    out: list[g.Panel] = []
    y = 0
    for row in rows:
        out.append(g.RowPanel(title=row.title, gridPos=g.GridPos(h=1, w=24, x=0, y=y)))
        y += 1
        x = 0
        line_h = 0
        for p in row.panels:
            if x + p.w > 24:
                y += line_h
                x, line_h = 0, 0
            p.obj.gridPos = g.GridPos(h=p.h, w=p.w, x=x, y=y)
            out.append(p.obj)
            x += p.w
            line_h = max(line_h, p.h)
        y += line_h
    return out


def dashboard(
    name: str, description: str, variables: Sequence[g.Template], rows: Sequence[Row]
) -> g.Dashboard:
    return g.Dashboard(
        title=urls.TITLES[name],
        uid=urls.uid(name),
        description=description,
        tags=TAGS,
        timezone="browser",
        refresh="30s",
        time=g.Time("now-1h", "now"),
        schemaVersion=SCHEMA_VERSION,
        graphTooltip=g.GRAPH_TOOLTIP_MODE_SHARED_CROSSHAIR,
        templating=g.Templating([datasource_var(), *variables]),
        links=dashboard_links(name),
        panels=layout(rows),
    ).auto_panel_ids()


# ---------------------------------------------------------------------------------------
# Expressions more than one dashboard shows (kept here so they cannot drift apart)
# ---------------------------------------------------------------------------------------
# The sidecar's codes for a request that ran out of time: HTTP 504 and gRPC DEADLINE_EXCEEDED.
TIMEOUT_CODES = ("504", "DEADLINE_EXCEEDED")
HEALTHY_ERROR_RATIO = 0.001  # the source material's healthy band: under 0.1% errors
HEALTHY_TIMEOUT_RATIO = 0.01  # and under 1% timeouts
GPU_UTIL_BAND = (40.0, 70.0)  # GPU utilization is best between 40% and 70%


# Requests that name no version carry version="" at the sidecar; the server picks its default
# version for them. Shown under this name, so a legend never reads as an empty string.
UNVERSIONED = "default"


def name_unversioned(expr: str) -> str:
    return f'label_replace({expr}, "version", "{UNVERSIONED}", "version", "")'
