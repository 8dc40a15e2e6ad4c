"""The snapshot renderer without a server: generated panels drawn from recorded series show
the panel's unit, axis label, thresholds from the spec, dashed reference lines, heatmap
buckets and alert rows the way the dashboard defines them."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.colors import to_rgb

from dashboards import build, live, snapshot, urls
from inferwatch.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
SPEC = load_spec(ROOT / "fleet.yaml")
BUILT = build.build(SPEC)
T0 = 1_800_000_000.0


def panel(dashboard: str, title: str) -> dict:
    return next(p for p in live.panels(BUILT[dashboard]) if p["title"] == title)


def series(
    name: str, values: list[float], labels: dict[str, str] | None = None, start: int = 0
) -> snapshot.Series:
    return snapshot.Series(name, labels or {}, [T0 + 15 * (start + i) for i in range(len(values))], values)


@pytest.fixture
def fig():
    figure = plt.figure()
    yield figure
    plt.close(figure)


def test_units_read_like_grafana() -> None:
    assert snapshot.unit_formatter("s")(0.0005) == "500 µs"
    assert snapshot.unit_formatter("s")(0.25) == "250 ms"
    assert snapshot.unit_formatter("percentunit")(0.05) == "5%"
    assert snapshot.unit_formatter("reqps")(1500) == "1.5k req/s"
    assert snapshot.unit_formatter("mbytes")(2048) == "2 GiB"
    assert snapshot.unit_formatter("rotmhz")(1980) == "1980 MHz"
    assert snapshot.axis_label("latency", "s") == "latency (seconds)"


def test_error_ratio_panel_draws_the_spec_threshold_and_the_healthy_band(fig) -> None:
    p = panel(urls.FLEET_OVERVIEW, "Server-error ratio by model and version")
    snapshot._draw_timeseries(fig, p, [series("ranker", [0.0, 0.02, 0.08]), series("dense", [0, 0, 0])])
    ax = fig.axes[0]
    assert ax.get_ylabel() == "server errors / requests (percent)"
    assert ax.yaxis.get_major_formatter()(0.05, 0) == "5%"
    threshold = SPEC.alerts.error_rate.threshold
    hlines = [line for line in ax.lines if list(line.get_ydata()) == [threshold, threshold]]
    assert hlines and hlines[0].get_color() == snapshot.NAMED["red"]
    # The healthy band (green, under 0.1%) is a shaded span; the ratio axis shows the threshold.
    green = to_rgb(snapshot.NAMED["green"])
    assert any(tuple(patch.get_facecolor()[:3]) == green for patch in ax.patches)
    assert ax.get_ylim()[1] >= 0.08
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[0].startswith("ranker") and "last 8%" in legend[0] and "max 8%" in legend[0]


def test_latency_panel_draws_sla_lines_dashed_and_without_statistics(fig) -> None:
    p = panel(urls.FLEET_OVERVIEW, "Latency: $model")
    snapshot._draw_timeseries(
        fig, p, [series("P99", [0.05, 0.3]), series("SLA", [0.1, 0.1]), series("2x SLA", [0.2, 0.2])]
    )
    ax = fig.axes[0]
    styles = {line.get_label().split("   ")[0]: line.get_linestyle() for line in ax.lines}
    assert styles == {"P99": "-", "SLA": "--", "2x SLA": "--"}
    assert [t.get_text() for t in ax.get_legend().get_texts()][1:] == ["SLA", "2x SLA"]
    assert ax.yaxis.get_major_formatter()(0.25, 0) == "250 ms"


def test_right_axis_override_gets_its_own_unit(fig) -> None:
    p = panel(urls.MODEL_DETAIL, "In flight at the sidecar and payload throughput")
    snapshot._draw_timeseries(
        fig, p, [series("in flight", [1, 2]), series("request bytes http", [2048.0, 4096.0])]
    )
    left, right = fig.axes
    assert left.get_ylabel() == "requests" and right.get_ylabel() == "bytes/s"
    assert right.yaxis.get_major_formatter()(4096, 0) == "4 KiB/s"


def test_stacked_series_with_different_spans_stack_on_a_common_grid(fig) -> None:
    p = panel(urls.GPU, "GPU memory by pod")
    pods = [series("a/pod-1", [1e9, 1e9, 1e9]), series("b/pod-2", [2e9], start=1)]
    snapshot._draw_timeseries(fig, p, pods)
    ax = fig.axes[0]
    assert ax.get_ylim()[1] >= 3e9  # the stack's top, not one layer's
    assert len(ax.collections) == 2


def test_heatmap_turns_cumulative_buckets_into_counts(fig) -> None:
    p = panel(urls.MODEL_DETAIL, "Latency distribution")
    buckets = [
        series("0.01", [5, 0], {"le": "0.01"}),
        series("0.1", [8, 4], {"le": "0.1"}),
        series("1", [8, 10], {"le": "1"}),
        series("+Inf", [8, 10], {"le": "+Inf"}),
    ]
    snapshot._draw_heatmap(fig, p, buckets)
    ax = fig.axes[0]
    mesh = ax.collections[0]
    # Rows: 10 ms, 100 ms, 1 s (the empty +Inf row is trimmed); columns: the two times.
    assert np.asarray(mesh.get_array()).reshape(3, 2).tolist() == [[5, 0], [3, 4], [0, 6]]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["10 ms", "100 ms", "1 s"]


def test_alert_table_leads_with_what_broke_and_hides_noise(fig) -> None:
    p = panel(urls.FLEET_OVERVIEW, "Alerts firing now")
    alert = {
        "__name__": "ALERTS",
        "alertname": "GPUMemoryPressure",
        "alertstate": "firing",
        "severity": "info",
        "Hostname": "node-1",
        "gpu": "0",
        "UUID": "GPU-123",
        "instance": "10.0.0.1:9400",
    }
    snapshot._draw_table(fig, p, [series("", [1], alert)])
    table = fig.axes[0].tables[0]
    header = [table[0, i].get_text().get_text() for i in range(len(table.get_celld()) // 2)]
    assert header == ["alertname", "severity", "Hostname", "gpu"]


def test_draw_writes_a_png_even_without_data(tmp_path: Path) -> None:
    path = tmp_path / "empty.png"
    snapshot._draw(panel(urls.GPU, "GPU utilization"), "GPU utilization", [], path)
    assert path.read_bytes()[:4] == b"\x89PNG"
