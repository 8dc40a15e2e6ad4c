"""Saturation of vLLM engines, from vLLM's own metrics: a full KV cache (info), preemptions
that keep happening (warning), and requests that keep waiting (warning).

vLLM labels its series ``model_name`` with its FIRST served name only, whatever name a
request used (a canary served as a second name of the same engine is counted under the
first). The decision, written down in alert_rules/README.md: vLLM's first served name is
the model's name in the fleet spec, and these recording rules copy ``model_name`` into
``model`` (``label_replace``), keeping every other label (instance, engine), so an engine's
saturation alert carries the model label that the Alertmanager inhibition and routes key
on, and dashboards select it like the sidecar's series. Versions are invisible here: one
engine serves every name it was given.
"""

from __future__ import annotations

from alert_rules.config import KV_CACHE_THRESHOLD, AlertTiming, RulesConfig, fmt_duration
from inferwatch import contract as c

NAME = "inferwatch-llm-saturation"


def with_model(expr: str) -> str:
    """``expr`` with vLLM's model_name copied into the model label."""
    return f'label_replace({expr}, "{c.L_MODEL}", "$1", "{c.L_VLLM_MODEL_NAME}", "(.+)")'


# Scrapes a KV-cache dip may last without restarting the alert's ``for``. Under sustained
# saturation vLLM's gauge dips for one engine step whenever a request finishes (its
# replacement's prefill makes that step slow): measured on the reference vLLM, 7% of samples
# two or three requests short of the plateau, and one such sample reset a 5m ``for``. The max
# over three scrapes rides out a dip of up to two; the price is a resolution up to two scrapes
# later.
KV_DIP_SCRAPES = 3


def timing(cfg: RulesConfig) -> AlertTiming:
    # Held for the GPU tier's ``for``; a cleared cache still reads full for the dip window.
    return AlertTiming(c.ALERT_LLM_KV_CACHE_SATURATION, cfg.gpu_for_s, KV_DIP_SCRAPES * cfg.scrape_interval_s)


def kv_usage(cfg: RulesConfig, selector: str = "") -> str:
    """The KV-cache usage the alert judges (and the dashboard draws): its max over the dip window."""
    window = fmt_duration(KV_DIP_SCRAPES * cfg.scrape_interval_s)
    series = f"{c.REC_VLLM_KV_CACHE_USAGE}{{{selector}}}" if selector else c.REC_VLLM_KV_CACHE_USAGE
    return f"max_over_time({series}[{window}])"


def kv_expr(cfg: RulesConfig) -> str:
    return f"{kv_usage(cfg)} > {KV_CACHE_THRESHOLD:g}"


def preemptions_expr() -> str:
    return f"{c.REC_VLLM_PREEMPTIONS_RATE} > 0"


def queued_expr(cfg: RulesConfig) -> str:
    return f"min_over_time({c.REC_VLLM_REQUESTS_WAITING}[{cfg.latency_window}]) > 0"


def group(cfg: RulesConfig) -> dict:
    model = f"{{{{ $labels.{c.L_MODEL} }}}}"
    where = f"{model} on {{{{ $labels.instance }}}}"
    rules: list[dict] = [
        {"record": c.REC_VLLM_KV_CACHE_USAGE, "expr": with_model(c.VLLM_KV_CACHE_USAGE.name)},
        {"record": c.REC_VLLM_REQUESTS_WAITING, "expr": with_model(c.VLLM_REQUESTS_WAITING.name)},
        {"record": c.REC_VLLM_REQUESTS_RUNNING, "expr": with_model(c.VLLM_REQUESTS_RUNNING.name)},
        {
            "record": c.REC_VLLM_PREEMPTIONS_RATE,
            "expr": with_model(f"rate({c.VLLM_PREEMPTIONS.name}[{cfg.latency_window}])"),
        },
        {
            "alert": c.ALERT_LLM_KV_CACHE_SATURATION,
            "expr": kv_expr(cfg),
            "for": cfg.gpu_for,
            "labels": {"severity": c.SEVERITY_INFO},
            "annotations": {
                "summary": f"{where}: KV cache {{{{ $value | humanizePercentage }}}} full",
                "description": (
                    f"The vLLM engine of {where} has used more than {KV_CACHE_THRESHOLD:.0%} of its "
                    f"KV-cache blocks for {cfg.gpu_for} (dips of a scrape or two ridden out). New "
                    "requests wait and running ones get preempted next: add replicas or KV-cache "
                    "memory, or cap prompt and output lengths."
                ),
            },
        },
        {
            "alert": c.ALERT_LLM_PREEMPTIONS,
            "expr": preemptions_expr(),
            "for": cfg.latency_for,
            "labels": {"severity": c.SEVERITY_WARNING},
            "annotations": {
                "summary": f"{where}: vLLM keeps preempting requests",
                "description": (
                    f"The vLLM engine of {where} has preempted requests in every {cfg.latency_window} "
                    f'window for {cfg.latency_for} ({{{{ $value | printf "%.2f" }}}}/s now): '
                    "its KV cache is too small for the requests it runs, and each preempted request "
                    "recomputes its prompt."
                ),
            },
        },
        {
            "alert": c.ALERT_LLM_REQUESTS_QUEUED,
            "expr": queued_expr(cfg),
            "for": cfg.latency_for,
            "labels": {"severity": c.SEVERITY_WARNING},
            "annotations": {
                "summary": f"{where}: requests keep waiting in vLLM",
                "description": (
                    f"The vLLM engine of {where} has had requests waiting (at least "
                    f"{{{{ $value }}}} at every sample) throughout {cfg.latency_window}, for "
                    f"{cfg.latency_for}: it is at capacity (batch slots or KV cache), and every "
                    "waiting request adds to time to first token."
                ),
            },
        },
    ]
    return {"name": NAME, "rules": rules}
