"""GPU: is a GPU saturated, idle, full, hot or failing, and which pod holds its memory?

dcgm-exporter's metric names and labels only (plus inferwatch's per-pod memory and
exporter health), so the dashboard works unchanged on a fleet running dcgm-exporter.
"""

from __future__ import annotations

from grafanalib import core as g

from alert_rules.config import RulesConfig
from alert_rules.groups import gpu as gpu_alert
from dashboards import panels as p
from dashboards import urls
from inferwatch import contract as c
from inferwatch.spec import FleetSpec

NAME = urls.GPU
LEGEND = "{{Hostname}} GPU {{gpu}}"
POD_SEL = p.GPU_SEL + ', namespace=~"$namespace"'


def _per_gpu(metric: c.Metric) -> str:
    return f"max by (Hostname, gpu) ({p.sel(metric, p.GPU_SEL)})"


def dashboard(spec: FleetSpec) -> g.Dashboard:
    cfg = RulesConfig.from_spec(spec)
    low, high = p.GPU_UTIL_BAND
    host, gpu = p.series_label(c.L_HOSTNAME), p.series_label(c.L_GPU)
    # GPU -> pod: the same dashboard narrowed to the clicked GPU, whose "GPU memory by pod"
    # panel then lists the pods holding it.
    to_pods = p.data_link(NAME, f"Pods on GPU {gpu} of {host}", ["namespace"], host=host, gpu=gpu)
    usage = p.Row(
        "Utilization and memory",
        [
            p.timeseries(
                "GPU utilization",
                f"Share of time a kernel was running. Best between {low:g}% and {high:g}% (green band): "
                "lower wastes the GPU, higher leaves no headroom for bursts and queues build.",
                p.targets((_per_gpu(c.DCGM_GPU_UTIL), LEGEND)),
                "percent",
                "utilization",
                thresholds=p.steps(p.NONE, (low, p.OK), (high, p.NONE)),
                thresholds_style="area",
                max_=100,
                links=[to_pods],
                w=12,
            ),
            p.timeseries(
                "Framebuffer used / total",
                f"GPU memory in use. The info alert fires above {cfg.gpu_threshold:.0%} (red line) held "
                f"for {cfg.gpu_for}; past it, a model load or a larger batch can fail with out-of-memory.",
                p.targets((f"max by (Hostname, gpu) ({gpu_alert.signal(p.GPU_SEL)})", LEGEND)),
                "percentunit",
                "used / total",
                thresholds=p.steps(p.NONE, (cfg.gpu_threshold, p.BAD)),
                thresholds_style="line+area",
                max_=1,
                links=[to_pods],
                w=12,
            ),
            p.timeseries(
                "Framebuffer used",
                "GPU memory in use, absolute.",
                p.targets((_per_gpu(c.DCGM_FB_USED), LEGEND)),
                "mbytes",
                "memory used",
                links=[to_pods],
                w=8,
            ),
            p.timeseries(
                "GPU memory by pod",
                "GPU memory held by each pod's processes (inferwatch's exporter; dcgm-exporter has no "
                "per-process memory).",
                p.targets(
                    (
                        f"sum by (namespace, pod) ({p.sel(c.GPU_PROCESS_MEMORY, POD_SEL)})",
                        "{{namespace}}/{{pod}}",
                    )
                ),
                "bytes",
                "memory used",
                stack=True,
                fill=30,
                w=8,
            ),
            p.timeseries(
                "Memory copy utilization",
                "Share of time the memory controller was busy: high with low GPU utilization means "
                "the model is memory-bound.",
                p.targets((_per_gpu(c.DCGM_MEM_COPY_UTIL), LEGEND)),
                "percent",
                "utilization",
                max_=100,
                links=[to_pods],
                w=8,
            ),
        ],
    )
    health = p.Row(
        "Health",
        [
            p.timeseries(
                "Temperature",
                "GPU die temperature; data-center GPUs throttle their clocks near 85-90 C.",
                p.targets((_per_gpu(c.DCGM_GPU_TEMP), LEGEND)),
                "celsius",
                "temperature",
                thresholds=p.steps(p.NONE, (85, p.WARN)),
                thresholds_style="dashed",
                min_=None,
                links=[to_pods],
                w=8,
            ),
            p.timeseries(
                "Power draw",
                "Board power: flat at the limit with falling clocks means power throttling.",
                p.targets((_per_gpu(c.DCGM_POWER_USAGE), LEGEND)),
                "watt",
                "power",
                links=[to_pods],
                w=8,
            ),
            p.timeseries(
                "Clocks",
                "SM and memory clocks: an SM clock that drops under load is thermal or power throttling.",
                p.targets(
                    (_per_gpu(c.DCGM_SM_CLOCK), "SM " + LEGEND),
                    (_per_gpu(c.DCGM_MEM_CLOCK), "memory " + LEGEND),
                ),
                "rotmhz",
                "clock",
                links=[to_pods],
                w=8,
            ),
            p.timeseries(
                "Last XID error",
                "The code of the last XID error the driver reported (0: none). Any non-zero value is "
                "worth a look: 48 and 63/64 are memory errors, 79 means the GPU fell off the bus.",
                p.targets((_per_gpu(c.DCGM_XID_ERRORS), LEGEND)),
                "none",
                "XID code",
                thresholds=p.steps(p.NONE, (1, p.BAD)),
                thresholds_style="line",
                legend_calcs=("lastNotNull", "max"),
                links=[to_pods],
                w=12,
            ),
            p.timeseries(
                "GPU exporter health",
                "Whether inferwatch's GPU exporter reads its backend (1 = up) and how long a collection "
                "takes (right axis). Blank on fleets that run dcgm-exporter instead.",
                p.targets(
                    (f"min by (backend) ({p.sel(c.GPU_BACKEND_UP, '')})", "backend {{backend}} up"),
                    (f"max({p.sel(c.GPU_SCRAPE_DURATION, '')})", "collection time"),
                ),
                "short",
                "up",
                overrides=[
                    {
                        "matcher": {"id": "byName", "options": "collection time"},
                        "properties": [
                            {"id": "unit", "value": "s"},
                            {"id": "custom.axisPlacement", "value": "right"},
                            {"id": "custom.axisLabel", "value": "collection time"},
                        ],
                    }
                ],
                w=12,
            ),
        ],
    )
    return p.dashboard(
        NAME,
        "Per GPU: utilization against the 40-70% band, framebuffer against the alert threshold, memory "
        "per pod, temperature, power, clocks and XID errors. dcgm-exporter names, so it works with "
        "dcgm-exporter too. Generated from the fleet spec.",
        [p.host_var(), p.gpu_var(), p.namespace_var(c.GPU_PROCESS_MEMORY.name)],
        [usage, health],
    )
