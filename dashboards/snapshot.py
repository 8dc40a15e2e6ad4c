"""Render every panel of every dashboard from live Prometheus data to PNG, plus one index.html.

For hosts without Grafana and for incident reports: each panel is drawn with matplotlib
from the same JSON Grafana would load (its queries, legend formats, unit, axis label,
thresholds and their style, dashed reference series), so what the PNG shows is what the
dashboard shows.
"""

from __future__ import annotations

import html
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display here; must precede pyplot
import matplotlib.dates as mdates
import matplotlib.pyplot as plt
from matplotlib.colors import PowerNorm
from matplotlib.ticker import FuncFormatter

from dashboards import build, live, urls
from inferwatch.spec import FleetSpec

PALETTE = ["#1F78C1", "#EAB839", "#6ED0E0", "#EF843C", "#7EB26D", "#BA43A9", "#705DA0", "#E24D42", "#508642"]
NAMED = {"green": "#56A64B", "orange": "#FF9830", "red": "#E02F44", "yellow": "#FADE2A", "blue": "#3274D9"}


# ---------------------------------------------------------------------------------------
# Units: Grafana unit id -> (how a tick reads, what the axis says)
# ---------------------------------------------------------------------------------------
def _si(v: float, suffix: str = "") -> str:
    for div, pre in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:.3g}{pre}{suffix}"
    return f"{v:.3g}{suffix}" if v else f"0{suffix}"


def _iec(v: float, suffix: str = "B") -> str:
    for div, pre in ((2**40, "Ti"), (2**30, "Gi"), (2**20, "Mi"), (2**10, "Ki")):
        if abs(v) >= div:
            return f"{v / div:.3g} {pre}{suffix}"
    return f"{v:.3g} {suffix}"


def _seconds(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) < 1e-3:
        return f"{v * 1e6:.3g} µs"
    if abs(v) < 1:
        return f"{v * 1e3:.3g} ms"
    return f"{v:.3g} s"


UNITS: dict[str, tuple[Callable[[float], str], str]] = {
    "s": (_seconds, "seconds"),
    "percentunit": (lambda v: f"{v * 100:.3g}%", "percent"),
    "percent": (lambda v: f"{v:.3g}%", "percent"),
    "reqps": (lambda v: _si(v, " req/s"), "req/s"),
    "Bps": (lambda v: _iec(v, "B/s"), "bytes/s"),
    "bytes": (_iec, "bytes"),
    "mbytes": (lambda v: _iec(v * 2**20), "bytes"),
    "celsius": (lambda v: f"{v:.3g} °C", "°C"),
    "watt": (lambda v: f"{v:.3g} W", "watts"),
    "rotmhz": (lambda v: f"{v:.4g} MHz", "MHz"),
    "short": (_si, ""),
    "none": (lambda v: f"{v:.6g}", ""),
}


def unit_formatter(unit: str) -> Callable[[float], str]:
    return UNITS.get(unit, UNITS["none"])[0]


def axis_label(label: str, unit: str) -> str:
    word = UNITS.get(unit, ("", unit))[1]
    return f"{label} ({word})" if word and word not in label else (label or word)


def _color(name: str | None, i: int) -> str:
    if not name:
        return PALETTE[i % len(PALETTE)]
    return NAMED.get(name, name)


# ---------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------
@dataclass
class QueryResult:
    ref: str
    expr: str
    series: int


@dataclass
class RenderedPanel:
    dashboard: str
    title: str
    kind: str
    file: str
    series: int
    queries: list[QueryResult] = field(default_factory=list)
    error: str = ""


@dataclass
class SnapshotResult:
    index: Path
    panels: list[RenderedPanel]


@dataclass
class Series:
    name: str
    labels: dict[str, str]
    t: list[float]
    v: list[float]


def _series(result: list[dict[str, Any]], legend_fmt: str) -> list[Series]:
    out = []
    for item in result:
        labels = item.get("metric", {})
        points = item.get("values") or ([item["value"]] if "value" in item else [])
        t = [float(p[0]) for p in points]
        v = [float(p[1]) for p in points]
        out.append(Series(live.legend(legend_fmt, labels), labels, t, v))
    return out


# ---------------------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------------------
def _overrides_for(panel: dict[str, Any], name: str) -> dict[str, Any]:
    props: dict[str, Any] = {}
    for ov in panel.get("fieldConfig", {}).get("overrides", []):
        m = ov.get("matcher", {})
        hit = (m.get("id") == "byName" and m.get("options") == name) or (
            m.get("id") == "byRegexp" and re.search(m.get("options", "$^"), name)
        )
        if hit:
            props.update({p["id"]: p["value"] for p in ov.get("properties", [])})
    return props


def _thresholds(ax: Any, panel: dict[str, Any]) -> None:
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    mode = defaults.get("custom", {}).get("thresholdsStyle", {}).get("mode", "off")
    stepsl = defaults.get("thresholds", {}).get("steps", [])
    if mode == "off" or not stepsl:
        return
    lo, hi = ax.get_ylim()
    for i, step in enumerate(stepsl):
        color = step.get("color")
        start = step.get("value")
        end = stepsl[i + 1]["value"] if i + 1 < len(stepsl) else None
        if color == "transparent":
            continue
        c = _color(color, 0)
        if "area" in mode:
            ax.axhspan(lo if start is None else start, hi if end is None else end, color=c, alpha=0.13, lw=0)
        if start is not None and ("line" in mode or "dashed" in mode):
            ax.axhline(start, color=c, lw=1.5, ls="--" if "dashed" in mode else "-")
    ax.set_ylim(lo, hi)


def _ylimits(ax: Any, panel: dict[str, Any], series: Sequence[Series]) -> None:
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    custom = defaults.get("custom", {})
    values = [x for s in series for x in s.v if math.isfinite(x)]
    top = max(values, default=1.0)
    top = max(top * 1.1, custom.get("axisSoftMax") or 0, 1e-9)
    if defaults.get("max") is not None:
        top = defaults["max"]
    bottom = defaults.get("min")
    if bottom is None:
        bottom = min(values, default=0.0)
        bottom = bottom - abs(bottom) * 0.1
    if top <= bottom:
        top = bottom + 1
    ax.set_ylim(bottom, top)


def _time_axis(ax: Any) -> None:
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S", tz=UTC))
    locator = mdates.AutoDateLocator(minticks=3, maxticks=8)
    locator.intervald[mdates.SECONDLY] = [1, 2, 5, 10, 15, 30]  # short ranges, e.g. a test's minutes
    ax.xaxis.set_major_locator(locator)
    ax.tick_params(labelsize=8)
    ax.grid(True, alpha=0.25)


def _calcs(panel: dict[str, Any], s: Series, unit: str) -> str:
    """The legend's calculations (Grafana's table legend), e.g. "  last 42 req/s  max 63 req/s"."""
    calcs = panel.get("options", {}).get("legend", {}).get("calcs", [])
    values = [v for v in s.v if math.isfinite(v)]
    if not values or not calcs:
        return ""
    fmt = unit_formatter(unit)
    named = {"lastNotNull": ("last", values[-1]), "max": ("max", max(values)), "min": ("min", min(values))}
    named["mean"] = ("mean", sum(values) / len(values))
    return "".join(f"   {named[c][0]} {fmt(named[c][1])}" for c in calcs if c in named)


def _draw_timeseries(fig: Any, panel: dict[str, Any], series: list[Series]) -> None:
    ax = fig.add_subplot(111)
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    unit = defaults.get("unit", "none")
    custom = defaults.get("custom", {})
    stacked = custom.get("stacking", {}).get("mode") == "normal"
    right: Any = None
    right_unit = ""
    main: list[Series] = []
    handles = []
    for i, s in enumerate(series):
        props = _overrides_for(panel, s.name)
        color = props.get("color", {}).get("fixedColor")
        dash = props.get("custom.lineStyle", {}).get("fill") == "dash"
        target = ax
        if props.get("custom.axisPlacement") == "right":
            if right is None:
                right = ax.twinx()
                right_unit = props.get("unit", unit)
                right.set_ylabel(axis_label(props.get("custom.axisLabel", ""), right_unit), fontsize=8)
                right.yaxis.set_major_formatter(
                    FuncFormatter(lambda v, _p, u=right_unit: unit_formatter(u)(v))
                )
                right.tick_params(labelsize=8)
            target = right
        else:
            main.append(s)
        t = [datetime.fromtimestamp(x, UTC) for x in s.t]
        # Reference lines (dashed overrides: SLA, 2x SLA) need no statistics in the legend.
        label = s.name if dash else s.name + _calcs(panel, s, props.get("unit", unit))
        kw = {"color": _color(color, i), "lw": props.get("custom.lineWidth", 1.4), "label": label}
        if dash:
            kw["ls"] = "--"
        if stacked and target is ax:
            handles.append((s, kw))
        else:
            target.plot(t, s.v, **kw)
    if handles:
        # Series may start or stop inside the range: stack them on the union of their
        # timestamps, a missing point counting as 0 (as Grafana stacks nulls).
        grid = sorted({x for h, _kw in handles for x in h.t})
        layers = [[dict(zip(h.t, h.v, strict=True)).get(x, 0.0) for x in grid] for h, _kw in handles]
        ax.stackplot(
            [datetime.fromtimestamp(x, UTC) for x in grid],
            *layers,
            labels=[kw["label"] for _h, kw in handles],
            colors=[kw["color"] for _h, kw in handles],
            alpha=0.6,
        )
        main = [Series("stack", {}, grid, [sum(col) for col in zip(*layers, strict=True)])]
    if right is not None:
        right.set_ylim(bottom=0)
    _ylimits(ax, panel, main)
    _thresholds(ax, panel)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _p: unit_formatter(unit)(v)))
    ax.set_ylabel(axis_label(custom.get("axisLabel", ""), unit), fontsize=8)
    _time_axis(ax)
    lines, labels = ax.get_legend_handles_labels()
    if right is not None:
        rl, rlab = right.get_legend_handles_labels()
        lines, labels = lines + rl, labels + rlab
    if lines:
        ncol = 1 if len(lines) <= 3 else 2 if len(lines) <= 8 else 3
        ax.legend(
            lines, labels, fontsize=7, ncol=ncol, loc="upper left", bbox_to_anchor=(0, -0.14), frameon=False
        )


def _le(s: Series) -> float:
    return float(s.labels.get("le", "inf").replace("+Inf", "inf"))


def _draw_heatmap(fig: Any, panel: dict[str, Any], series: list[Series]) -> None:
    ax = fig.add_subplot(111)
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "s")
    fmt = unit_formatter(unit)
    buckets = sorted((s for s in series if s.v), key=_le)
    if not buckets:
        return
    n = min(len(b.v) for b in buckets)
    import numpy as np

    cum = np.array([b.v[:n] for b in buckets])
    counts = np.diff(cum, axis=0, prepend=0).clip(min=0)  # cumulative "le" buckets -> per bucket
    used = np.nonzero(counts.sum(axis=1) > 0)[0]
    lo, hi = (used.min(), used.max()) if len(used) else (0, len(buckets) - 1)
    counts = counts[lo : hi + 1]
    labels = [
        ("> " + fmt(_le(buckets[i - 1]))) if math.isinf(_le(buckets[i])) else fmt(_le(buckets[i]))
        for i in range(lo, hi + 1)
    ]
    times = buckets[0].t[:n]
    step = (times[-1] - times[0]) / (n - 1) if n > 1 else 60.0
    edges = [times[0] - step / 2 + i * step for i in range(n + 1)]
    x = mdates.date2num([datetime.fromtimestamp(e, UTC) for e in edges])
    color = panel.get("options", {}).get("color", {})
    norm = None
    if color.get("scale") == "exponential":  # as the panel says: faint bands stay visible
        norm = PowerNorm(gamma=float(color.get("exponent", 0.5)), vmin=0)
    cmap = color.get("scheme", "Oranges")
    y = np.arange(len(labels) + 1) - 0.5
    mesh = ax.pcolormesh(x, y, counts, cmap=cmap, norm=norm, shading="flat")
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.xaxis_date()
    ax.set_ylabel("latency bucket (upper bound)", fontsize=8)
    cb = fig.colorbar(mesh, ax=ax, pad=0.01)
    cb.set_label("requests per interval", fontsize=8)
    cb.ax.tick_params(labelsize=7)
    _time_axis(ax)


def _draw_table(fig: Any, panel: dict[str, Any], series: list[Series]) -> None:
    ax = fig.add_subplot(111)
    ax.axis("off")
    hidden: set[str] = set()
    order: dict[str, int] = {}
    for tr in panel.get("transformations", []):
        if tr.get("id") == "organize":
            hidden |= {k for k, v in tr.get("options", {}).get("excludeByName", {}).items() if v}
            order.update(tr.get("options", {}).get("indexByName", {}))
    if not series:
        ax.text(
            0.5,
            0.5,
            "No rows: nothing matches (for alerts: nothing is firing)",
            ha="center",
            va="center",
            fontsize=10,
            color="#555",
        )
        return
    present = {k for s in series for k in s.labels if k not in hidden}
    cols = sorted(present, key=lambda k: (order.get(k, len(order)), k))
    rows = [[s.labels.get(k, "")[:40] for k in cols] for s in series]
    widths = [max(len(col), *(len(r[i]) for r in rows)) + 2 for i, col in enumerate(cols)]
    tbl = ax.table(
        cellText=rows,
        colLabels=cols,
        colWidths=[w / sum(widths) for w in widths],
        loc="upper center",
        cellLoc="left",
    )
    tbl.auto_set_font_size(False)
    tbl.set_fontsize(8)
    tbl.scale(1, 1.4)


def _draw(panel: dict[str, Any], title: str, series: list[Series], path: Path) -> None:
    kind = panel.get("type", "timeseries")
    fig = plt.figure(figsize=(8, 4.2 if kind != "table" else 3.2), dpi=100)
    try:
        if kind == "heatmap":
            _draw_heatmap(fig, panel, series)
        elif kind == "table":
            _draw_table(fig, panel, series)
        else:
            _draw_timeseries(fig, panel, series)
        fig.suptitle(title, fontsize=11, x=0.02, ha="left", fontweight="bold")
        if not series and kind != "table":
            fig.text(0.5, 0.5, "No data", ha="center", va="center", fontsize=14, color="#999")
        fig.tight_layout(rect=(0, 0, 1, 0.97))
        fig.savefig(path)
    finally:
        plt.close(fig)


# ---------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------
def _file_slug(text: str) -> str:
    return urls.slug(text)[:60] or "panel"


def snapshot(
    prometheus_url: str,
    out_dir: Path,
    spec: FleetSpec,
    *,
    range_s: float = 900,
    scrape_interval_s: float = 15,
    end: float | None = None,
    pins: dict[str, str] | None = None,
    only: Sequence[str] | None = None,
    dashboards: dict[str, dict[str, Any]] | None = None,
    progress: Callable[[str], None] = lambda _m: None,
) -> SnapshotResult:
    """Render every panel of ``dashboards`` (default: built from ``spec``) into ``out_dir``."""
    dashes = dashboards or build.build(spec)
    if only:
        unknown = [n for n in only if n not in dashes]
        if unknown:
            raise live.LiveError(f"unknown dashboard {unknown[0]!r}; known: {', '.join(dashes)}")
        dashes = {n: d for n, d in dashes.items() if n in only}
    out_dir.mkdir(parents=True, exist_ok=True)
    end = end if end is not None else time.time()
    start = end - range_s
    step = max(float(math.ceil(range_s / 200)), scrape_interval_s, 1.0)
    known_vars = {v["name"] for d in dashes.values() for v in d.get("templating", {}).get("list", [])}
    for pin in pins or {}:
        if pin not in known_vars:
            raise live.LiveError(
                f"--var {pin}: no dashboard has that variable ({', '.join(sorted(known_vars))})"
            )
    rendered: list[RenderedPanel] = []
    with live.Prometheus(prometheus_url) as prom:
        for name, dash in dashes.items():
            variables = live.resolve_variables(dash, prom, start, end, pins)
            ctx = live.Context(variables, start, end, step, scrape_interval_s)
            instances = list(live.panel_instances(dash, ctx))
            progress(f"{dash['title']}: {len(instances)} panels")
            for i, inst in enumerate(instances, 1):
                rendered.append(_render_panel(prom, name, i, inst, out_dir, start, end, step))
    index = _write_index(out_dir, dashes, rendered, start, end)
    (out_dir / "manifest.json").write_text(
        json.dumps([asdict(r) for r in rendered], indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    return SnapshotResult(index, rendered)


def _render_panel(
    prom: live.Prometheus,
    name: str,
    i: int,
    inst: live.PanelInstance,
    out_dir: Path,
    start: float,
    end: float,
    step: float,
) -> RenderedPanel:
    """Query and draw one panel. A query Prometheus refuses or a drawing failure costs only
    this panel: its image says why and the manifest records the error."""
    series: list[Series] = []
    results = []
    error = ""
    try:
        for q in inst.queries:
            if q.instant or q.fmt == "table":
                raw = prom.query(q.expr, end)
            else:
                raw = prom.query_range(q.expr, start, end, step)
            got = _series(raw, q.legend)
            series += got
            results.append(QueryResult(q.ref, q.expr, len(got)))
    except live.QueryError as exc:
        error = f"query refused: {exc}"
    fname = f"{name}-{i:02d}-{_file_slug(inst.title)}.png"
    if not error:
        try:
            _draw(inst.panel, inst.title, series, out_dir / fname)
        except Exception as exc:  # one panel's drawing bug must not lose the other panels
            error = f"cannot draw: {type(exc).__name__}: {exc}"
    if error:
        _draw_error(inst.title, error, out_dir / fname)
    kind = inst.panel.get("type", "")
    return RenderedPanel(name, inst.title, kind, fname, len(series), results, error)


def _draw_error(title: str, message: str, path: Path) -> None:
    fig = plt.figure(figsize=(8, 3), dpi=100)
    try:
        fig.suptitle(title, fontsize=11, x=0.02, ha="left", fontweight="bold")
        fig.text(0.5, 0.5, message[:300], ha="center", va="center", fontsize=9, color="#C4162A", wrap=True)
        fig.savefig(path)
    finally:
        plt.close(fig)


def _write_index(
    out_dir: Path, dashes: dict[str, dict[str, Any]], rendered: list[RenderedPanel], start: float, end: float
) -> Path:
    fmt = "%Y-%m-%d %H:%M:%S UTC"
    window = f"{datetime.fromtimestamp(start, UTC):{fmt}} to {datetime.fromtimestamp(end, UTC):{fmt}}"
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>inferwatch dashboard snapshot</title>",
        "<style>body{font-family:sans-serif;margin:1.5em;background:#fafafa}"
        "figure{display:inline-block;margin:.5em;vertical-align:top;background:#fff;padding:.3em;"
        "border:1px solid #ddd}figcaption{font-size:.8em;max-width:800px}code{font-size:.75em;"
        "word-break:break-all}</style></head><body>",
        "<h1>inferwatch dashboard snapshot</h1>",
        f"<p>{html.escape(window)}</p>",
    ]
    for name, dash in dashes.items():
        parts.append(
            f"<h2>{html.escape(dash['title'])}</h2><p>{html.escape(dash.get('description', ''))}</p>"
        )
        for r in (r for r in rendered if r.dashboard == name):
            queries = "".join(
                f"<li><code>{html.escape(q.expr)}</code> ({q.series} series)</li>" for q in r.queries
            )
            parts.append(
                f"<figure><img src='{html.escape(r.file)}' alt='{html.escape(r.title)}' width='800'>"
                f"<figcaption><details><summary>queries</summary><ul>{queries}</ul></details>"
                "</figcaption></figure>"
            )
    parts.append("</body></html>")
    index = out_dir / "index.html"
    index.write_text("\n".join(parts) + "\n", encoding="utf-8")
    return index
