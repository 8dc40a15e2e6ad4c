"""Fleet overview: is any model failing, slow or starved, right now?

Per model: request rate, server-error ratio against the paging threshold, timeouts,
latency against the SLA and twice the SLA, requests in flight; per GPU: framebuffer
pressure; and the alerts firing now.
"""

from __future__ import annotations

from grafanalib import core as g

from dashboards import panels as p
from dashboards import urls
from inferwatch import contract as c
from inferwatch.spec import FleetSpec

NAME = urls.FLEET_OVERVIEW


def dashboard(spec: FleetSpec) -> g.Dashboard:
    er = spec.alerts.error_rate
    lat = spec.alerts.latency
    gpu_mem = spec.alerts.gpu_memory
    default_sla = spec.defaults.latency_sla_ms / 1000.0
    q_label = p.quantile_label(lat.quantile)
    factor = f"{lat.sla_factor:g}"
    sel = p.MODEL_VERSION_SEL
    bucket = c.REQUEST_DURATION.name + "_bucket"
    server_error = sel + f', outcome="{c.OUTCOME_SERVER_ERROR}"'
    timeouts = sel + ', code=~"' + "|".join(p.TIMEOUT_CODES) + '"'
    model, host, gpu = p.series_label(c.L_MODEL), p.series_label(c.L_HOSTNAME), p.series_label(c.L_GPU)
    to_model = p.data_link(urls.MODEL_DETAIL, f"Model detail: {model}", ["namespace"], model=model)
    to_gpu = p.data_link(urls.GPU, f"GPU {gpu} on {host}", host=host, gpu=gpu)

    traffic = p.Row(
        "Traffic and errors",
        [
            p.timeseries(
                "Request rate by model",
                "Requests per second the sidecars answered, all outcomes.",
                p.targets((f"sum by (model) ({p.rate(c.REQUESTS_TOTAL, sel)})", "{{model}}")),
                "reqps",
                "requests/s",
                links=[to_model],
                w=8,
            ),
            p.timeseries(
                "Server-error ratio by model",
                f"Share of requests that failed on the server side (5xx, gRPC server codes, upstream "
                f"failures) over {er.window} windows, as the paging alert computes it. The alert pages when "
                f"this stays above {er.threshold:.2%} (red line) for {er.consecutive_windows} consecutive "
                f"windows. Healthy: under {p.HEALTHY_ERROR_RATIO:.1%} (green band).",
                p.targets(
                    (
                        p.ratio_or_zero(
                            p.rate(c.REQUESTS_TOTAL, server_error, er.window),
                            p.rate(c.REQUESTS_TOTAL, sel, er.window),
                            "model",
                        ),
                        "{{model}}",
                    )
                ),
                "percentunit",
                "server errors / requests",
                thresholds=p.steps(p.OK, (p.HEALTHY_ERROR_RATIO, p.NONE), (er.threshold, p.BAD)),
                thresholds_style="line+area",
                soft_max=er.threshold * 1.5,
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
        ],
    )

    latency = p.Row(
        "Latency against the SLA",
        [
            p.timeseries(
                f"{q_label} latency / SLA by model",
                f"{q_label} latency over {lat.window} divided by the model's SLA (the sidecar's exported "
                f"SLA, else the spec's default {default_sla:g}s). 100% is the SLA (orange line); the warning "
                f"alert fires above {factor}x the SLA (red line) held for {lat.for_}.",
                p.targets(
                    (
                        p.quantile(lat.quantile, p.rate(bucket, sel, lat.window), "model")
                        + " / on (model) "
                        + p.sla_seconds(p.MODEL_SEL, "model", default_sla, lat.window),
                        "{{model}}",
                    )
                ),
                "percentunit",
                f"{q_label} / SLA",
                thresholds=p.steps(p.NONE, (1.0, p.WARN), (lat.sla_factor, p.BAD)),
                thresholds_style="dashed",
                soft_max=lat.sla_factor * 1.25,
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
                f"P50, P95 and {q_label} of the sidecar's request duration for one model, against its SLA "
                f"(orange, dashed) and {factor}x the SLA (red, dashed).",
                p.targets(
                    *(
                        (p.quantile(q, p.rate(bucket, sel), ""), p.quantile_label(q))
                        for q in sorted({0.5, 0.95, lat.quantile})
                    ),
                    (p.sla_seconds(p.MODEL_SEL, "", default_sla), "SLA"),
                    (f"{factor} * " + p.sla_seconds(p.MODEL_SEL, "", default_sla), f"{factor}x SLA"),
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
                f"Framebuffer used / total per GPU. The info alert fires above {gpu_mem.threshold:.0%} "
                f"(red line) held for {gpu_mem.for_}.",
                p.targets((p.fb_used_ratio('Hostname=~"$host"'), "{{Hostname}} GPU {{gpu}}")),
                "percentunit",
                "used / total",
                thresholds=p.steps(p.NONE, (gpu_mem.threshold, p.BAD)),
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
                # Hostname and gpu name a GPU; UUID, device, instance and job add width, not meaning.
                hide=("__name__", "alertstate", "instance", "job", c.L_UUID, c.L_DEVICE, c.L_MODEL_NAME),
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
