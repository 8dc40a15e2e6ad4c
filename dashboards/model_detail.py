"""Model detail: for one model, where does the time go, and is the canary worse?

The latency distribution over time, the sidecar's end-to-end latency beside Triton's
queue and compute phases per request, the batch size Triton achieved, the queue, and
every version side by side.
"""

from __future__ import annotations

from grafanalib import core as g

from alert_rules.config import RulesConfig
from alert_rules.groups import errors as error_alert
from alert_rules.groups import latency as latency_alert
from dashboards import panels as p
from dashboards import urls
from inferwatch import contract as c
from inferwatch.spec import FleetSpec

NAME = urls.MODEL_DETAIL
US_PER_S = 1e6


def _per_request_s(counter_us: c.Metric, tsel: str) -> str:
    """Triton's cumulative microsecond counters, per successful request, in seconds."""
    return f"sum({p.rate(counter_us, tsel)}) / sum({p.rate(c.TRITON_REQUEST_SUCCESS, tsel)}) / {US_PER_S:g}"


def dashboard(spec: FleetSpec) -> g.Dashboard:
    cfg = RulesConfig.from_spec(spec)
    q_label = cfg.quantile_name
    factor = f"{cfg.latency_factor:g}"
    sel = p.MODEL_VERSION_SEL
    tsel = p.MODEL_VERSION_SEL  # Triton labels its series model and version too
    dur = c.REQUEST_DURATION.name
    bucket = dur + "_bucket"

    latency = p.Row(
        "Latency",
        [
            p.heatmap(
                "Latency distribution",
                "How many requests finished in each latency bucket of the sidecar's histogram, over time. "
                "A second band appearing above the first is a slow path (a canary, a cold cache, a queue).",
                f"sum by (le) (increase({p.sel(bucket, sel)}[{p.RATE}]))",
                "s",
                "latency",
                w=12,
            ),
            p.timeseries(
                f"P50 and {q_label} latency by version",
                "Sidecar latency per version ('default': requests that named no version, served by the "
                "server's default version); a canary slower than the stable version shows here first. "
                f"Dashed: the SLA (orange) and {factor}x the SLA (red), as the warning alert compares them. "
                "Quantiles here are at the dashboard's resolution from the raw histogram (the alert's are "
                f"over {cfg.latency_window}, on the Fleet overview), so dots on {q_label} are exemplars: "
                "click one to open its trace.",
                [
                    p.target(
                        p.name_unversioned(p.quantile(0.5, p.rate(bucket, sel), "version")),
                        "version {{version}} P50",
                        "A",
                    ),
                    p.target(
                        p.name_unversioned(p.quantile(cfg.latency_quantile, p.rate(bucket, sel), "version")),
                        f"version {{{{version}}}} {q_label}",
                        "B",
                        exemplar=True,
                    ),
                    p.target(latency_alert.sla_signal(p.REC_MODEL_SEL), "SLA", "C"),
                    p.target(latency_alert.limit_expr(cfg, p.REC_MODEL_SEL), f"{factor}x SLA", "D"),
                ],
                "s",
                "latency",
                overrides=[p.dashed("SLA", p.WARN), p.dashed(f"{factor}x SLA", p.BAD)],
                w=12,
            ),
            p.timeseries(
                "Where the time goes: sidecar vs Triton (mean per request)",
                "The sidecar's end-to-end mean latency beside Triton's own accounting per successful "
                "request: time queued (waiting for a batch or an instance), compute input, compute infer "
                "and compute output. Sidecar minus Triton request time is network and proxy time.",
                p.targets(
                    (
                        f"sum({p.rate(dur, sel, suffix='_sum')}) / sum({p.rate(dur, sel, suffix='_count')})",
                        "sidecar end to end",
                    ),
                    (_per_request_s(c.TRITON_REQUEST_DURATION_US, tsel), "Triton request"),
                    (_per_request_s(c.TRITON_QUEUE_DURATION_US, tsel), "Triton queue"),
                    (_per_request_s(c.TRITON_COMPUTE_INPUT_US, tsel), "Triton compute input"),
                    (_per_request_s(c.TRITON_COMPUTE_INFER_US, tsel), "Triton compute infer"),
                    (_per_request_s(c.TRITON_COMPUTE_OUTPUT_US, tsel), "Triton compute output"),
                ),
                "s",
                "mean time per request",
                w=24,
            ),
        ],
    )

    load = p.Row(
        "Traffic, errors and batching by version",
        [
            p.timeseries(
                "Request rate by version",
                "Requests per second per version: the traffic split of a canary rollout.",
                p.targets(
                    (
                        p.name_unversioned(f"sum by (version) ({p.rate(c.REQUESTS_TOTAL, sel)})"),
                        "version {{version}}",
                    )
                ),
                "reqps",
                "requests/s",
                w=8,
            ),
            p.timeseries(
                "Server-error ratio by version",
                f"Server-side failures / requests over {cfg.error_window} windows: the paging alert's own "
                f"recorded ratio ({p.ACROSS_NAMESPACES}). Red line: the paging threshold "
                f"({cfg.error_threshold:.2%}); green band: healthy (under {p.HEALTHY_ERROR_RATIO:.1%}).",
                p.targets(
                    (
                        p.name_unversioned(error_alert.signal(p.REC_MODEL_VERSION_SEL)),
                        "version {{version}}",
                    )
                ),
                "percentunit",
                "server errors / requests",
                thresholds=p.steps(p.OK, (p.HEALTHY_ERROR_RATIO, p.NONE), (cfg.error_threshold, p.BAD)),
                thresholds_style="line+area",
                soft_max=cfg.error_threshold * 1.5,
                w=8,
            ),
            p.timeseries(
                "Requests by outcome and code",
                "Every answer the sidecar gave, by outcome (success, client_error, server_error) and "
                "status code (HTTP status or gRPC code name).",
                p.targets(
                    (
                        f"sum by (outcome, code) ({p.rate(c.REQUESTS_TOTAL, sel)})",
                        "{{outcome}} {{code}}",
                    )
                ),
                "reqps",
                "requests/s",
                w=8,
            ),
            p.timeseries(
                "Achieved batch size by version",
                f"Inferences per model execution in Triton ({c.TRITON_INFERENCE_COUNT.name} / "
                f"{c.TRITON_EXEC_COUNT.name}): 1 means dynamic batching is not batching; the preferred "
                "batch sizes are the target.",
                p.targets(
                    (
                        f"sum by (version) ({p.rate(c.TRITON_INFERENCE_COUNT, tsel)}) / "
                        f"sum by (version) ({p.rate(c.TRITON_EXEC_COUNT, tsel)})",
                        "version {{version}}",
                    )
                ),
                "short",
                "inferences per execution",
                w=8,
            ),
            p.timeseries(
                "Pending requests in Triton by version",
                "Requests Triton accepted and has not started executing: a queue that keeps growing "
                "means the model instances cannot keep up.",
                p.targets(
                    (
                        f"sum by (version) ({p.sel(c.TRITON_PENDING_REQUESTS, tsel)})",
                        "version {{version}}",
                    )
                ),
                "short",
                "requests",
                w=8,
            ),
            p.timeseries(
                "In flight at the sidecar and payload throughput",
                "Requests the sidecars are holding (left axis) and request/response bytes per second. "
                "Dashed: the sum of the sidecars' concurrency limits for the model (the fleet spec's "
                "limits.concurrency; with limits.adaptive, where each limit stands now): in flight "
                "at the line means requests queue, then shed. No line: the model has no limit.",
                p.targets(
                    (f"sum({p.sel(c.REQUESTS_IN_FLIGHT, p.MODEL_SEL)})", "in flight"),
                    (f"sum({p.sel(c.CONCURRENCY_LIMIT, p.MODEL_SEL)})", "concurrency limit"),
                    (
                        f"sum by (protocol) ({p.rate(c.REQUEST_BYTES, p.MODEL_SEL)})",
                        "request bytes {{protocol}}",
                    ),
                    (
                        f"sum by (protocol) ({p.rate(c.RESPONSE_BYTES, p.MODEL_SEL)})",
                        "response bytes {{protocol}}",
                    ),
                ),
                "short",
                "requests",
                overrides=[
                    p.dashed("concurrency limit", p.WARN),
                    {
                        "matcher": {"id": "byRegexp", "options": "^(request|response) bytes.*"},
                        "properties": [
                            {"id": "unit", "value": "Bps"},
                            {"id": "custom.axisPlacement", "value": "right"},
                            {"id": "custom.axisLabel", "value": "bytes/s"},
                        ],
                    },
                ],
                w=8,
            ),
            p.timeseries(
                "Shed requests by reason",
                "Requests per second the sidecars' per-model limits (the fleet spec's limits) answered "
                "themselves, HTTP 429 or gRPC RESOURCE_EXHAUSTED, before the model server saw them, by "
                "reason: requests (request bucket), tokens (LLM token bucket), queue_full (concurrency "
                "cap and queue full), queue_timeout (waited too long for a slot). They are also in the "
                f"request rate. {c.ALERT_LOAD_SHEDDING} fires above {cfg.shed_threshold:.1%} of a "
                f"model's requests over {cfg.shed_window}. 0: nothing shed.",
                p.targets((p.shed_by_reason("", p.MODEL_SEL, sel), "shed: {{reason}}")),
                "reqps",
                "shed requests/s",
                w=24,
                h=6,
            ),
        ],
    )
    return p.dashboard(
        NAME,
        "One model: latency distribution, sidecar vs Triton time per phase, achieved batch size, queue, "
        "and versions side by side for canaries. Generated from the fleet spec.",
        [p.namespace_var(c.REQUESTS_TOTAL.name), p.model_var(multi=False), p.version_var()],
        [latency, load],
    )
