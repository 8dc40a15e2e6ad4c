"""LLM serving: are first tokens and the tokens after them fast enough, and is it the engine's
capacity or the model when they are not?

Per model, the TTFT and TPOT quantiles the warnings compare against the SLA and
sla_factor x SLA; the sidecar's TTFT beside vLLM's own; tokens per second; vLLM's queue,
KV cache and preemptions (overload); finish reasons; cancelled streams and error events.
vLLM's series name a model by ``model_name`` (its first served name, which is the spec's
model; see ``alert_rules/groups/llm_saturation.py``), so panels on vLLM's raw series select
``model_name=~"$model"``, and panels on the recording rules select the model label they add.
"""

from __future__ import annotations

from grafanalib import core as g

from alert_rules.config import KV_CACHE_THRESHOLD, RulesConfig
from alert_rules.groups import llm as llm_alert
from alert_rules.groups import llm_saturation
from dashboards import panels as p
from dashboards import urls
from inferwatch import contract as c
from inferwatch.spec import FleetSpec

NAME = urls.LLM_SERVING
# vLLM's own series: selected by its model_name (= the spec's model), namespace where it runs.
VLLM_SEL = f'namespace=~"$namespace", {c.L_VLLM_MODEL_NAME}=~"$model"'
# The recording rules over vLLM's series keep its labels (namespace too) and add model.
REC_VLLM_SEL = p.MODEL_SEL
MODEL_VERSION = f"{c.L_MODEL}, {c.L_VERSION}"


def _sla_panel(cfg: RulesConfig, title: str, what: str, record: str, sla_record: str, alert: str) -> p.Panel:
    factor = f"{cfg.latency_factor:g}"
    q_label = cfg.quantile_name
    sla = p.sel(sla_record, p.REC_MODEL_SEL)
    return p.timeseries(
        title,
        f"P50 and {q_label} of the sidecar's {what} over {cfg.latency_window} per version of one model "
        f"(the recorded quantiles {alert} compares, {p.ACROSS_NAMESPACES}), against its SLA (orange, "
        f"dashed) and {factor}x the SLA (red, dashed): the warning fires while {q_label} stays above "
        f"the red line for {cfg.latency_for}.",
        p.targets(
            *(
                (
                    p.name_unversioned(llm_alert.quantile_signal(record, q, p.REC_MODEL_VERSION_SEL)),
                    f"{p.quantile_label(q)} version {{{{version}}}}",
                )
                for q in sorted({0.5, cfg.latency_quantile})
            ),
            (sla, "SLA"),
            (llm_alert.limit_expr(cfg, sla_record, p.REC_MODEL_SEL), f"{factor}x SLA"),
        ),
        "s",
        what,
        overrides=[p.dashed("SLA", p.WARN), p.dashed(f"{factor}x SLA", p.BAD)],
        repeat="model",
        w=12,
    )


def _zero_fill(expr: str, traffic: str, by: str) -> str:
    """``expr`` by ``by``, reading 0 for a model with traffic and no such event yet."""
    return f"sum by ({by}) ({expr}) or 0 * sum by ({by}) ({traffic})"


def dashboard(spec: FleetSpec) -> g.Dashboard:
    cfg = RulesConfig.from_spec(spec)
    ttft = c.TIME_TO_FIRST_TOKEN.name
    sidecar_requests = p.rate(c.REQUESTS_TOTAL, p.MODEL_VERSION_SEL)

    latency = p.Row(
        "Time to first token and time per output token",
        [
            _sla_panel(
                cfg,
                "Time to first token: $model",
                "time to first token",
                c.REC_TTFT_QUANTILE,
                c.REC_TTFT_SLA,
                c.ALERT_HIGH_TTFT,
            ),
            _sla_panel(
                cfg,
                "Time per output token: $model",
                "time per output token",
                c.REC_TPOT_QUANTILE,
                c.REC_TPOT_SLA,
                c.ALERT_HIGH_TPOT,
            ),
            p.timeseries(
                "Time to first token: sidecar vs vLLM",
                "P50 and P99 of time to first token per model as the sidecar measured it (the request's "
                "first byte in to the first content event out) and as vLLM measured it itself. The "
                "sidecar's sits a little above vLLM's (network and proxy); a wide gap is time spent "
                "before the engine. vLLM leaves aborted requests out of its histogram; the sidecar does not.",
                p.targets(
                    *(
                        (
                            p.quantile(q, p.rate(ttft, p.MODEL_VERSION_SEL, suffix="_bucket"), c.L_MODEL),
                            f"{{{{model}}}} sidecar {p.quantile_label(q)}",
                        )
                        for q in (0.5, 0.99)
                    ),
                    *(
                        (
                            p.quantile(
                                q,
                                p.rate(c.VLLM_TIME_TO_FIRST_TOKEN, VLLM_SEL, suffix="_bucket"),
                                c.L_VLLM_MODEL_NAME,
                            ),
                            f"{{{{model_name}}}} vLLM {p.quantile_label(q)}",
                        )
                        for q in (0.5, 0.99)
                    ),
                ),
                "s",
                "time to first token",
                w=24,
            ),
        ],
    )

    tokens = p.Row(
        "Tokens and capacity",
        [
            p.timeseries(
                "Prompt and generation tokens/s",
                "Tokens per second per model: the sidecar's count (from each answer's usage, else counted "
                "from its events) by type, and vLLM's own prompt (prefill) and generation counters.",
                p.targets(
                    (
                        f"sum by ({c.L_MODEL}, {c.L_TOKEN_TYPE}) "
                        f"({p.rate(c.TOKENS_TOTAL, p.MODEL_VERSION_SEL)})",
                        "{{model}} sidecar {{type}}",
                    ),
                    (
                        f"sum by ({c.L_VLLM_MODEL_NAME}) ({p.rate(c.VLLM_PROMPT_TOKENS, VLLM_SEL)})",
                        "{{model_name}} vLLM prompt",
                    ),
                    (
                        f"sum by ({c.L_VLLM_MODEL_NAME}) ({p.rate(c.VLLM_GENERATION_TOKENS, VLLM_SEL)})",
                        "{{model_name}} vLLM generation",
                    ),
                ),
                "short",
                "tokens/s",
                w=12,
            ),
            p.timeseries(
                "Requests running and waiting",
                "Requests each vLLM engine is running (in its batch) and waiting to be scheduled. Requests "
                f"that keep waiting mean the engine is at capacity ({c.ALERT_LLM_REQUESTS_QUEUED} fires when "
                f"some waited at every sample of {cfg.latency_window} for {cfg.latency_for}): overload, "
                "not a slow model.",
                p.targets(
                    (p.sel(c.REC_VLLM_REQUESTS_RUNNING, REC_VLLM_SEL), "{{model}} {{instance}} running"),
                    (p.sel(c.REC_VLLM_REQUESTS_WAITING, REC_VLLM_SEL), "{{model}} {{instance}} waiting"),
                ),
                "short",
                "requests",
                w=12,
            ),
            p.timeseries(
                "KV-cache usage",
                "Share of each vLLM engine's KV-cache blocks in use (the highest of the last three "
                f"scrapes, as the alert reads it). Above the red line ({KV_CACHE_THRESHOLD:.0%}) for "
                f"{cfg.gpu_for}, {c.ALERT_LLM_KV_CACHE_SATURATION} (info) fires; a full cache makes "
                "requests wait and running ones get preempted.",
                p.targets((llm_saturation.kv_usage(cfg, REC_VLLM_SEL), "{{model}} {{instance}}")),
                "percentunit",
                "KV cache used",
                thresholds=p.steps(p.OK, (KV_CACHE_THRESHOLD, p.BAD)),
                thresholds_style="line",
                max_=1,
                w=12,
            ),
            p.timeseries(
                "Preemptions",
                "Requests per second each vLLM engine evicted from its KV cache to make room (they "
                f"recompute their prompt later). {c.ALERT_LLM_PREEMPTIONS} fires when preemptions keep "
                f"happening for {cfg.latency_for}.",
                p.targets(
                    (
                        f"sum by ({c.L_VLLM_MODEL_NAME}, instance) ({p.rate(c.VLLM_PREEMPTIONS, VLLM_SEL)})",
                        "{{model_name}} {{instance}}",
                    )
                ),
                "short",
                "preemptions/s",
                w=12,
            ),
        ],
    )

    outcomes = p.Row(
        "How streams end",
        [
            p.timeseries(
                "Finish reasons",
                "Requests per second vLLM finished, by reason: stop (the model ended), length (max_tokens "
                "reached), abort (the client left or the request was cancelled).",
                p.targets(
                    (
                        f"sum by ({c.L_VLLM_MODEL_NAME}, {c.L_VLLM_FINISHED_REASON}) "
                        f"({p.rate(c.VLLM_REQUEST_SUCCESS, VLLM_SEL)})",
                        "{{model_name}} {{finished_reason}}",
                    )
                ),
                "reqps",
                "requests/s",
                w=12,
            ),
            p.timeseries(
                "Cancelled streams and error events",
                "Per model and version, from the sidecar: streams the client left before the end "
                "(counted as 499, with the tokens they got), and streams that answered 200 and then "
                "carried an error event (a server error that a status-code count would call a success).",
                p.targets(
                    (
                        p.name_unversioned(
                            _zero_fill(
                                p.rate(c.REQUESTS_TOTAL, p.MODEL_VERSION_SEL + ', code="499"'),
                                sidecar_requests,
                                MODEL_VERSION,
                            )
                        ),
                        "{{model}} v{{version}} cancelled",
                    ),
                    (
                        p.name_unversioned(
                            _zero_fill(
                                p.rate(
                                    c.REQUESTS_TOTAL,
                                    p.MODEL_VERSION_SEL + f', code="200", outcome="{c.OUTCOME_SERVER_ERROR}"',
                                ),
                                sidecar_requests,
                                MODEL_VERSION,
                            )
                        ),
                        "{{model}} v{{version}} error event",
                    ),
                ),
                "reqps",
                "streams/s",
                w=12,
            ),
        ],
    )
    return p.dashboard(
        NAME,
        "LLM models: time to first token and per output token against their SLAs, the sidecar beside "
        "vLLM, tokens/s, the engine's queue, KV cache and preemptions, and how streams end. Generated "
        "from the fleet spec.",
        [
            p.namespace_var(c.TIME_TO_FIRST_TOKEN.name + "_count"),
            p.query_var(
                "model",
                "Model",
                f'{{__name__=~"{ttft}_count|{c.REC_VLLM_REQUESTS_RUNNING}"}}',
                c.L_MODEL,
            ),
            p.query_var("version", "Version", f"{ttft}_count", c.L_VERSION, 'model=~"$model"'),
        ],
        [latency, tokens, outcomes],
    )
