"""Fleet overview: is any model failing, slow or starved, right now?

Per model: request rate, server-error ratio against the paging threshold, timeouts,
latency against the SLA and twice the SLA, requests in flight; per GPU: framebuffer
pressure; and the alerts firing now.
"""

from __future__ import annotations

from grafanalib import core as g

from alert_rules import promql
from alert_rules.config import RulesConfig
from alert_rules.groups import errors as error_alert
from alert_rules.groups import gpu as gpu_alert
from alert_rules.groups import latency as latency_alert
from dashboards import panels as p
from dashboards import urls
from inferwatch import contract as c
from inferwatch.spec import FleetSpec

NAME = urls.FLEET_OVERVIEW


def dashboard(spec: FleetSpec) -> g.Dashboard:
    cfg = RulesConfig.from_spec(spec)
    q_label = cfg.quantile_name
    factor = f"{cfg.latency_factor:g}"
    sel = p.MODEL_VERSION_SEL
    timeouts = sel + ', code=~"' + "|".join(p.TIMEOUT_CODES) + '"'
    model, host, gpu = p.series_label(c.L_MODEL), p.series_label(c.L_HOSTNAME), p.series_label(c.L_GPU)
    to_model = p.data_link(urls.MODEL_DETAIL, f"Model detail: {model}", ["namespace"], model=model)
    to_gpu = p.data_link(urls.GPU, f"GPU {gpu} on {host}", host=host, gpu=gpu)

    traffic = p.Row(
        "Traffic and errors",
        [
            p.timeseries(
                "Request rate by model",
                f"Requests per second the sidecars answered, all outcomes (recorded over {cfg.error_window}, "
                f"{p.ACROSS_NAMESPACES}).",
                p.targets(
                    (
                        f"sum by (model) ({promql.recorded(c.REC_REQUEST_RATE, p.REC_MODEL_VERSION_SEL)})",
                        "{{model}}",
                    )
                ),
                "reqps",
                "requests/s",
                links=[to_model],
                w=8,
            ),
            p.timeseries(
                "Server-error ratio by model and version",
                f"Share of requests that failed on the server side (5xx, gRPC server codes, upstream "
                f"failures) over {cfg.error_window} windows: the paging alert's own recorded ratio, per "
                f"model and version as it judges them ({p.ACROSS_NAMESPACES}). The alert pages when this "
                f"stays above {cfg.error_threshold:.2%} (red line) for {cfg.error_windows} consecutive "
                f"windows. Healthy: under {p.HEALTHY_ERROR_RATIO:.1%} (green band).",
                p.targets(
                    (
                        p.name_unversioned(error_alert.signal(p.REC_MODEL_VERSION_SEL)),
                        "{{model}} version {{version}}",
                    )
                ),
                "percentunit",
                "server errors / requests",
                thresholds=p.steps(p.OK, (p.HEALTHY_ERROR_RATIO, p.NONE), (cfg.error_threshold, p.BAD)),
                thresholds_style="line+area",
                soft_max=cfg.error_threshold * 1.5,
                links=[to_model],
                w=8,
            ),
            p.timeseries(
                "Timeout ratio by model",
                "Share of requests answered with HTTP 504 or gRPC DEADLINE_EXCEEDED. "
                f"Healthy: under {p.HEALTHY_TIMEOUT_RATIO:.0%} (green band).",
                p.targets(
                    (
                        p.ratio_or_zero(
                            p.rate(c.REQUESTS_TOTAL, timeouts), p.rate(c.REQUESTS_TOTAL, sel), "model"
                        ),
                        "{{model}}",
                    )
                ),
                "percentunit",
                "timeouts / requests",
                thresholds=p.steps(p.OK, (p.HEALTHY_TIMEOUT_RATIO, p.WARN)),
                thresholds_style="line+area",
                soft_max=p.HEALTHY_TIMEOUT_RATIO * 2,
                links=[to_model],
                w=8,
            ),
            p.timeseries(
                "Shed requests by model and reason",
                "Requests per second the sidecars' per-model limits (the fleet spec's limits) answered "
                "themselves, HTTP 429 or gRPC RESOURCE_EXHAUSTED, before the model server saw them, by "
                "reason: requests (request bucket), tokens (LLM token bucket), queue_full (concurrency "
                "cap and queue full), queue_timeout (waited too long for a slot). They are also in the "
                f"request rate. {c.ALERT_LOAD_SHEDDING} fires above {cfg.shed_threshold:.1%} of a "
                f"model's requests over {cfg.shed_window}. 0: nothing shed.",
                p.targets((p.shed_by_reason(c.L_MODEL, p.MODEL_SEL, sel), "{{model}} {{reason}}")),
                "reqps",
                "shed requests/s",
                links=[to_model],
                w=24,
                h=6,
            ),
        ],
    )

    latency = p.Row(
        "Latency against the SLA",
        [
            p.timeseries(
                f"{q_label} latency / SLA by model and version",
                f"{q_label} latency over {cfg.latency_window} (the warning alert's recorded quantile, "
                f"{p.ACROSS_NAMESPACES}) divided by the model's SLA (the sidecar's exported SLA, else the "
                f"spec's default {cfg.default_sla_seconds:g}s). 100% is the SLA (orange line); the alert "
                f"fires above {factor}x the SLA (red line) held for {cfg.latency_for}.",
                p.targets(
                    (
                        p.name_unversioned(
                            f"{latency_alert.quantile_signal(cfg.latency_quantile, p.REC_MODEL_VERSION_SEL)}"
                            f" / {latency_alert.SLA_MATCH} {latency_alert.sla_signal(p.REC_MODEL_SEL)}"
                        ),
                        "{{model}} version {{version}}",
                    )
                ),
                "percentunit",
                f"{q_label} / SLA",
                thresholds=p.steps(p.NONE, (1.0, p.WARN), (cfg.latency_factor, p.BAD)),
                thresholds_style="dashed",
                soft_max=cfg.latency_factor * 1.25,
                links=[to_model],
                w=12,
            ),
            p.timeseries(
                "Requests in flight by model",
                "Requests the sidecars accepted and have not answered yet: a rising line with a flat "
                "request rate means the model server is falling behind.",
                p.targets(
                    (f"sum by (model) ({p.sel(c.REQUESTS_IN_FLIGHT, p.MODEL_SEL)})", "{{model}}"),
                ),
                "short",
                "requests",
                links=[to_model],
                w=12,
            ),
            p.timeseries(
                "Latency: $model",
                f"P50 and {q_label} of the sidecar's request duration over {cfg.latency_window} per version "
                f"of one model (the recorded quantiles the warning alert compares, "
                f"{p.ACROSS_NAMESPACES}), against its SLA (orange, dashed) and {factor}x the SLA (red, "
                f"dashed): the alert fires while {q_label} stays above the red line for {cfg.latency_for}.",
                p.targets(
                    *(
                        (
                            p.name_unversioned(latency_alert.quantile_signal(q, p.REC_MODEL_VERSION_SEL)),
                            f"{p.quantile_label(q)} version {{{{version}}}}",
                        )
                        for q in sorted({0.5, cfg.latency_quantile})
                    ),
                    (latency_alert.sla_signal(p.REC_MODEL_SEL), "SLA"),
                    (latency_alert.limit_expr(cfg, p.REC_MODEL_SEL), f"{factor}x SLA"),
                ),
                "s",
                "latency",
                overrides=[p.dashed("SLA", p.WARN), p.dashed(f"{factor}x SLA", p.BAD)],
                repeat="model",
                w=8,
            ),
        ],
    )

    gpus = p.Row(
        "GPUs, targets and alerts",
        [
            p.timeseries(
                "GPU framebuffer used by GPU",
                f"Framebuffer used / total per GPU (the info alert's recorded ratio). The alert fires above "
                f"{cfg.gpu_threshold:.0%} (red line) held for {cfg.gpu_for}.",
                p.targets((gpu_alert.signal(p.HOST_SEL), "{{Hostname}} GPU {{gpu}}")),
                "percentunit",
                "used / total",
                thresholds=p.steps(p.NONE, (cfg.gpu_threshold, p.BAD)),
                thresholds_style="line+area",
                max_=1,
                links=[to_gpu],
                w=8,
            ),
            p.timeseries(
                "Scrape targets up by job",
                "Targets Prometheus scraped successfully, per job; a drop means a component is down "
                "and its panels go blank.",
                p.targets(
                    (
                        f'sum by (job) ({c.PROM_UP.name}{{job=~"{"|".join(c.JOBS)}"}})',
                        "{{job}}",
                    ),
                    (f"sum by (upstream) ({p.sel(c.UPSTREAM_UP, '')})", "sidecar upstream {{upstream}}"),
                ),
                "short",
                "targets up",
                legend_calcs=("lastNotNull", "min"),
                w=8,
            ),
            p.table(
                "Alerts firing now",
                "Every alert Prometheus reports as firing at the end of the time range, with its labels. "
                "Empty means nothing is firing.",
                f'{c.PROM_ALERTS.name}{{alertstate="firing"}}',
                # Hostname and gpu name a GPU; UUID, device, bus id, driver version, instance and job
                # add width, not meaning.
                hide=(
                    "__name__",
                    "alertstate",
                    "instance",
                    "job",
                    c.L_UUID,
                    c.L_DEVICE,
                    c.L_MODEL_NAME,
                    c.L_PCI_BUS_ID,
                    c.L_DRIVER_VERSION,
                ),
                first=("alertname", "severity", c.L_MODEL, c.L_VERSION, c.L_HOSTNAME, c.L_GPU),
                w=8,
                h=8,
            ),
        ],
    )
    return p.dashboard(
        NAME,
        "Per model: traffic, server errors against the paging threshold, timeouts, latency against the "
        "SLA; per GPU: memory pressure; and the alerts firing now. Generated from the fleet spec.",
        [p.namespace_var(c.REQUESTS_TOTAL.name), p.model_var(), p.version_var(), p.host_var()],
        [traffic, latency, gpus],
    )
