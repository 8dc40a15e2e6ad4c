"""The metric contract: every metric, label, alert name, severity and port of inferwatch.

The sidecar, the GPU exporter, the rule generator and the dashboards take names from
here; nothing else spells a metric name (``tests/test_contract.py`` enforces it). A
rename here is a breaking change for every fleet that stores these series.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MetricType = Literal["counter", "gauge", "histogram", "info"]


@dataclass(frozen=True, slots=True)
class Metric:
    """One metric family as exposed (for counters, ``name`` excludes the ``_total`` suffix
    only where prometheus_client adds it; ``exposed`` is what Prometheus stores)."""

    name: str
    type: MetricType
    help: str
    labels: tuple[str, ...]
    unit: str = ""
    source: Literal["sidecar", "gpu_exporter", "dcgm", "triton", "vllm", "prometheus"] = "sidecar"

    @property
    def exposed(self) -> str:
        """The series name as Prometheus stores it (histograms add _bucket/_sum/_count)."""
        return self.name


# ---------------------------------------------------------------------------------------
# Label names
# ---------------------------------------------------------------------------------------
L_MODEL = "model"
L_VERSION = "version"
L_PROTOCOL = "protocol"  # "http" | "grpc"
L_CODE = "code"  # HTTP status ("200") or gRPC code name ("UNAVAILABLE")
L_OUTCOME = "outcome"
L_UPSTREAM = "upstream"
L_TOKEN_TYPE = "type"  # on TOKENS_TOTAL: TOKEN_PROMPT or TOKEN_GENERATION
L_REASON = "reason"  # on REQUESTS_SHED: which limit shed it (sidecar.core.admission.SHED_REASONS)
TOKEN_PROMPT = "prompt"
TOKEN_GENERATION = "generation"

# dcgm-exporter's labels, spelled as it spells them.
L_GPU = "gpu"
L_UUID = "UUID"
L_DEVICE = "device"
L_MODEL_NAME = "modelName"
L_HOSTNAME = "Hostname"
L_PCI_BUS_ID = "pci_bus_id"  # NVML's bus id, "00000000:9A:00.0", as dcgm-exporter writes it
L_DRIVER_VERSION = "DCGM_FI_DRIVER_VERSION"  # dcgm-exporter's label field of that name
L_ERR_CODE = "err_code"  # on DCGM_FI_DEV_XID_ERRORS: the XID code, and its text in err_msg
L_ERR_MSG = "err_msg"
L_POD = "pod"
L_NAMESPACE = "namespace"
L_CONTAINER = "container"

PROTOCOL_HTTP = "http"
PROTOCOL_GRPC = "grpc"

OUTCOME_SUCCESS = "success"
OUTCOME_CLIENT_ERROR = "client_error"
OUTCOME_SERVER_ERROR = "server_error"
OUTCOMES = (OUTCOME_SUCCESS, OUTCOME_CLIENT_ERROR, OUTCOME_SERVER_ERROR)

# The value every model name outside the upstream's repository (or past the cap) collapses to.
MODEL_OVERFLOW = "__other__"
# The value for requests that name no model (health checks, repository index, ...).
MODEL_NONE = ""

GPU_LABELS = (L_GPU, L_UUID, L_PCI_BUS_ID, L_DEVICE, L_MODEL_NAME, L_HOSTNAME)  # dcgm-exporter's order
GPU_POD_LABELS = (*GPU_LABELS, L_POD, L_NAMESPACE, L_CONTAINER)

# ---------------------------------------------------------------------------------------
# Sidecar (prefix inferwatch_)
# ---------------------------------------------------------------------------------------
REQUESTS_TOTAL = Metric(
    "inferwatch_requests_total",
    "counter",
    "Requests proxied to the model server, by model, version, protocol, status code and outcome.",
    (L_MODEL, L_VERSION, L_PROTOCOL, L_CODE, L_OUTCOME),
)
REQUEST_DURATION = Metric(
    "inferwatch_request_duration_seconds",
    "histogram",
    "Time from the request's first byte to the response's last byte, as the sidecar saw it.",
    # No protocol label: no rule, panel or canary query splits latency by it, and it would
    # double the histogram, most of a model version's series (deploy/SCALING.md).
    (L_MODEL, L_VERSION, L_OUTCOME),
    unit="seconds",
)
REQUESTS_IN_FLIGHT = Metric(
    "inferwatch_requests_in_flight",
    "gauge",
    "Requests accepted by the sidecar and not yet answered.",
    (L_MODEL,),
)
REQUEST_BYTES = Metric(
    "inferwatch_request_bytes_total",
    "counter",
    "Request body bytes received from clients.",
    (L_MODEL, L_PROTOCOL),
    unit="bytes",
)
RESPONSE_BYTES = Metric(
    "inferwatch_response_bytes_total",
    "counter",
    "Response body bytes sent to clients.",
    (L_MODEL, L_PROTOCOL),
    unit="bytes",
)
MODEL_LATENCY_SLA = Metric(
    "inferwatch_model_latency_sla_seconds",
    "gauge",
    "The latency SLA the sidecar was configured with for this model.",
    (L_MODEL,),
    unit="seconds",
)
REQUESTS_SHED = Metric(
    "inferwatch_requests_shed_total",
    "counter",
    "Requests shed by the sidecar's per-model limits before the server saw them (also in requests_total).",
    (L_MODEL, L_REASON),
)
CONCURRENCY_LIMIT = Metric(
    "inferwatch_concurrency_limit",
    "gauge",
    "The sidecar's concurrency limit for the model (limits.concurrency; adaptive: its value now).",
    (L_MODEL,),
)
UPSTREAM_UP = Metric(
    "inferwatch_upstream_up",
    "gauge",
    "1 when the sidecar's last contact with the upstream succeeded, else 0.",
    (L_UPSTREAM,),
)

# Generative (LLM) serving (sidecar/README.md, "LLM streams"). The TTFT and TPOT
# histograms have a bucket at each model's SLA and 2x it (inferwatch.spec.token_latency_buckets).
# Like the request histogram, they have no protocol label (the series budget).
# The client's clock, as near as a proxy gets: vLLM's own TTFT starts when its engine receives
# the request, after its HTTP handling, chat template and tokenizer, so it reads lower (measured
# here: medians 9-34 ms through the sidecar vs 5-8 ms in vLLM; client-timed, direct and through
# the sidecar were indistinguishable).
TIME_TO_FIRST_TOKEN = Metric(
    "inferwatch_time_to_first_token_seconds",
    "histogram",
    "Time from the request's first byte to the first event carrying generated content.",
    (L_MODEL, L_VERSION),
    unit="seconds",
)
TIME_PER_OUTPUT_TOKEN = Metric(
    "inferwatch_time_per_output_token_seconds",
    "histogram",
    "Per request: (last token - first token) / (output tokens - 1).",
    (L_MODEL, L_VERSION),
    unit="seconds",
)
INTER_TOKEN_LATENCY = Metric(
    "inferwatch_inter_token_latency_seconds",
    "histogram",
    "Each gap between two events carrying generated content.",
    (L_MODEL, L_VERSION),
    unit="seconds",
)
TOKENS_TOTAL = Metric(
    "inferwatch_tokens_total",
    "counter",
    "Prompt and generation tokens, from the answer's usage where it has one, else counted from its events.",
    (L_MODEL, L_VERSION, L_PROTOCOL, L_TOKEN_TYPE),
)
MODEL_TTFT_SLA = Metric(
    "inferwatch_model_ttft_sla_seconds",
    "gauge",
    "The time-to-first-token SLA the sidecar was configured with for this model.",
    (L_MODEL,),
    unit="seconds",
)
MODEL_TPOT_SLA = Metric(
    "inferwatch_model_tpot_sla_seconds",
    "gauge",
    "The time-per-output-token SLA the sidecar was configured with for this model.",
    (L_MODEL,),
    unit="seconds",
)
LLM_SIDECAR_METRICS = (
    TIME_TO_FIRST_TOKEN,
    TIME_PER_OUTPUT_TOKEN,
    INTER_TOKEN_LATENCY,
    TOKENS_TOTAL,
    MODEL_TTFT_SLA,
    MODEL_TPOT_SLA,
)

SIDECAR_METRICS = (
    REQUESTS_TOTAL,
    REQUEST_DURATION,
    REQUESTS_IN_FLIGHT,
    REQUEST_BYTES,
    RESPONSE_BYTES,
    MODEL_LATENCY_SLA,
    UPSTREAM_UP,
    REQUESTS_SHED,
    CONCURRENCY_LIMIT,
    *LLM_SIDECAR_METRICS,
)

# ---------------------------------------------------------------------------------------
# GPU: dcgm-exporter's names, units and labels (so a fleet running dcgm-exporter works
# unchanged with inferwatch's rules and dashboards).
# ---------------------------------------------------------------------------------------


def _dcgm(name: str, type_: MetricType, help_: str, unit: str = "", extra: tuple[str, ...] = ()) -> Metric:
    return Metric(name, type_, help_, (*GPU_POD_LABELS, L_DRIVER_VERSION, *extra), unit=unit, source="dcgm")


DCGM_GPU_UTIL = _dcgm("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", "percent")
DCGM_MEM_COPY_UTIL = _dcgm("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %).", "percent")
DCGM_FB_FREE = _dcgm("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).", "MiB")
DCGM_FB_USED = _dcgm("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).", "MiB")
DCGM_FB_RESERVED = _dcgm("DCGM_FI_DEV_FB_RESERVED", "gauge", "Framebuffer memory reserved (in MiB).", "MiB")
DCGM_SM_CLOCK = _dcgm("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", "MHz")
DCGM_MEM_CLOCK = _dcgm("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz).", "MHz")
DCGM_GPU_TEMP = _dcgm("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", "celsius")
DCGM_MEMORY_TEMP = _dcgm("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C).", "celsius")
DCGM_POWER_USAGE = _dcgm("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", "watts")
DCGM_TOTAL_ENERGY = _dcgm(
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
    "counter",
    "Total energy consumption since boot (in mJ).",
    "millijoules",
)
DCGM_XID_ERRORS = _dcgm(
    "DCGM_FI_DEV_XID_ERRORS",
    "gauge",
    "Value of the last XID error encountered.",
    extra=(L_ERR_CODE, L_ERR_MSG),
)
DCGM_PCIE_REPLAY = _dcgm("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries.")
DCGM_CORRECTABLE_REMAPPED_ROWS = _dcgm(
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
    "counter",
    "Number of remapped rows for correctable errors",
)
DCGM_UNCORRECTABLE_REMAPPED_ROWS = _dcgm(
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
    "counter",
    "Number of remapped rows for uncorrectable errors",
)
DCGM_ROW_REMAP_FAILURE = _dcgm(
    "DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed"
)
# In dcgm-exporter's default-counters.csv too; NVML reads them (encoder/decoder utilization).
DCGM_ENC_UTIL = _dcgm("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %).", "percent")
DCGM_DEC_UTIL = _dcgm("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %).", "percent")

DCGM_METRICS = (
    DCGM_GPU_UTIL,
    DCGM_MEM_COPY_UTIL,
    DCGM_FB_FREE,
    DCGM_FB_USED,
    DCGM_FB_RESERVED,
    DCGM_SM_CLOCK,
    DCGM_MEM_CLOCK,
    DCGM_GPU_TEMP,
    DCGM_MEMORY_TEMP,
    DCGM_POWER_USAGE,
    DCGM_TOTAL_ENERGY,
    DCGM_XID_ERRORS,
    DCGM_PCIE_REPLAY,
    DCGM_CORRECTABLE_REMAPPED_ROWS,
    DCGM_UNCORRECTABLE_REMAPPED_ROWS,
    DCGM_ROW_REMAP_FAILURE,
    DCGM_ENC_UTIL,
    DCGM_DEC_UTIL,
)

# ---------------------------------------------------------------------------------------
# GPU: what dcgm-exporter lacks (inferwatch GPU names)
# ---------------------------------------------------------------------------------------
GPU_FB_TOTAL_BYTES = Metric(
    "inferwatch_gpu_fb_total_bytes",
    "gauge",
    "Total framebuffer memory of the GPU.",
    GPU_LABELS,
    unit="bytes",
    source="gpu_exporter",
)
GPU_XID_ERRORS_TOTAL = Metric(
    "inferwatch_gpu_xid_errors_total",
    "counter",
    "XID errors seen since the exporter started, by XID code.",
    (*GPU_LABELS, "xid"),
    source="gpu_exporter",
)
# What /proc/<pid>/cgroup proves about a GPU process, for when names are unknown.
L_POD_UID = "pod_uid"
L_CONTAINER_ID = "container_id"
GPU_PROCESS_MEMORY = Metric(
    "inferwatch_gpu_process_memory_bytes",
    "gauge",
    "GPU memory used by the processes of one pod/container on one GPU.",
    (*GPU_LABELS, L_POD, L_NAMESPACE, L_CONTAINER, L_POD_UID, L_CONTAINER_ID),
    unit="bytes",
    source="gpu_exporter",
)
GPU_BACKEND_INFO = Metric(
    "inferwatch_gpu_backend_info",
    "gauge",
    "The backend the GPU exporter reads from (nvml or simulated); always 1.",
    ("backend", L_HOSTNAME),
    source="gpu_exporter",
)
GPU_BACKEND_UP = Metric(
    "inferwatch_gpu_backend_up",
    "gauge",
    "1 when the exporter's backend (NVML) is initialized, else 0.",
    ("backend",),
    source="gpu_exporter",
)
GPU_SCRAPE_DURATION = Metric(
    "inferwatch_gpu_scrape_duration_seconds",
    "gauge",
    "Time the last collection of GPU metrics took.",
    (),
    unit="seconds",
    source="gpu_exporter",
)
GPU_BACKEND_ERRORS = Metric(
    "inferwatch_gpu_backend_errors_total",
    "counter",
    "Errors from backend (NVML) calls, by call and GPU.",
    ("call", L_GPU),
    source="gpu_exporter",
)

GPU_UP = Metric(
    "inferwatch_gpu_up",
    "gauge",
    "1 when the last read of this GPU returned values, 0 when it failed, timed out or the GPU is lost.",
    GPU_LABELS,
    source="gpu_exporter",
)
GPU_HOST_PID_NAMESPACE = Metric(
    "inferwatch_gpu_host_pid_namespace",
    "gauge",
    "1 when the exporter runs in the host's PID namespace; 0 when not, and NVML then lists no GPU processes.",
    (),
    source="gpu_exporter",
)
GPU_PROCESS_SCAN_AGE = Metric(
    "inferwatch_gpu_process_scan_age_seconds",
    "gauge",
    "Seconds since this GPU's processes were last listed successfully (per-pod memory's staleness).",
    GPU_LABELS,
    unit="seconds",
    source="gpu_exporter",
)

GPU_EXPORTER_METRICS = (
    GPU_UP,
    GPU_HOST_PID_NAMESPACE,
    GPU_PROCESS_SCAN_AGE,
    GPU_FB_TOTAL_BYTES,
    GPU_XID_ERRORS_TOTAL,
    GPU_PROCESS_MEMORY,
    GPU_BACKEND_INFO,
    GPU_BACKEND_UP,
    GPU_SCRAPE_DURATION,
    GPU_BACKEND_ERRORS,
)

# ---------------------------------------------------------------------------------------
# Triton (scraped from its :8002/metrics; defined by Triton, named here so dashboards and
# rules can refer to them without spelling them).
# ---------------------------------------------------------------------------------------


def _triton(name: str, type_: MetricType, help_: str, unit: str = "") -> Metric:
    return Metric(name, type_, help_, (L_MODEL, L_VERSION), unit=unit, source="triton")


TRITON_REQUEST_SUCCESS = _triton(
    "nv_inference_request_success", "counter", "Number of successful inference requests."
)
TRITON_REQUEST_FAILURE = _triton(
    "nv_inference_request_failure", "counter", "Number of failed inference requests."
)
TRITON_INFERENCE_COUNT = _triton(
    "nv_inference_count", "counter", "Number of inferences performed (a batch of n counts n)."
)
TRITON_EXEC_COUNT = _triton(
    "nv_inference_exec_count", "counter", "Number of model executions (a batch counts once)."
)
TRITON_REQUEST_DURATION_US = _triton(
    "nv_inference_request_duration_us", "counter", "Cumulative request duration.", "microseconds"
)
TRITON_QUEUE_DURATION_US = _triton(
    "nv_inference_queue_duration_us", "counter", "Cumulative time requests spent queued.", "microseconds"
)
TRITON_COMPUTE_INPUT_US = _triton(
    "nv_inference_compute_input_duration_us", "counter", "Cumulative compute input time.", "microseconds"
)
TRITON_COMPUTE_INFER_US = _triton(
    "nv_inference_compute_infer_duration_us", "counter", "Cumulative compute inference time.", "microseconds"
)
TRITON_COMPUTE_OUTPUT_US = _triton(
    "nv_inference_compute_output_duration_us",
    "counter",
    "Cumulative inference compute output time.",
    "microseconds",
)
TRITON_PENDING_REQUESTS = _triton(
    "nv_inference_pending_request_count",
    "gauge",
    "Instantaneous number of pending requests awaiting execution.",
)

TRITON_METRICS = (
    TRITON_REQUEST_SUCCESS,
    TRITON_REQUEST_FAILURE,
    TRITON_INFERENCE_COUNT,
    TRITON_EXEC_COUNT,
    TRITON_REQUEST_DURATION_US,
    TRITON_QUEUE_DURATION_US,
    TRITON_COMPUTE_INPUT_US,
    TRITON_COMPUTE_INFER_US,
    TRITON_COMPUTE_OUTPUT_US,
    TRITON_PENDING_REQUESTS,
)

# ---------------------------------------------------------------------------------------
# vLLM (scraped from its own /metrics; defined by vLLM 0.32). vLLM labels every series with
# model_name = its FIRST served name only, whatever name the request used, and engine = the
# engine index. The rules map model_name to the model label (alert_rules/groups/llm_saturation.py).
# ---------------------------------------------------------------------------------------
L_VLLM_MODEL_NAME = "model_name"
L_VLLM_ENGINE = "engine"
L_VLLM_FINISHED_REASON = "finished_reason"  # on VLLM_REQUEST_SUCCESS: stop, length, abort, ...


def _vllm(name: str, type_: MetricType, help_: str, unit: str = "", extra: tuple[str, ...] = ()) -> Metric:
    return Metric(name, type_, help_, (L_VLLM_MODEL_NAME, L_VLLM_ENGINE, *extra), unit=unit, source="vllm")


VLLM_KV_CACHE_USAGE = _vllm("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.")
VLLM_REQUESTS_WAITING = _vllm(
    "vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed."
)
VLLM_REQUESTS_RUNNING = _vllm(
    "vllm:num_requests_running", "gauge", "Number of requests in model execution batches."
)
VLLM_PREEMPTIONS = _vllm(
    "vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine."
)
VLLM_TIME_TO_FIRST_TOKEN = _vllm(
    "vllm:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.", "seconds"
)
VLLM_TIME_PER_OUTPUT_TOKEN = _vllm(
    "vllm:request_time_per_output_token_seconds",
    "histogram",
    "Histogram of time_per_output_token_seconds per request.",
    "seconds",
)
VLLM_PROMPT_TOKENS = _vllm("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.")
VLLM_GENERATION_TOKENS = _vllm(
    "vllm:generation_tokens_total", "counter", "Number of generation tokens processed."
)
VLLM_REQUEST_SUCCESS = _vllm(
    "vllm:request_success_total",
    "counter",
    "Count of successfully processed requests.",
    extra=(L_VLLM_FINISHED_REASON,),
)
# vLLM's cache configuration as labels of a constant 1 (num_gpu_blocks: the KV cache's size in
# blocks, which `inferwatch vllm --kv-cache-blocks` caps). Labelled by engine, not model_name.
VLLM_CACHE_CONFIG = Metric(
    "vllm:cache_config_info",
    "gauge",
    "Information of the LLMEngine CacheConfig.",
    (L_VLLM_ENGINE, "block_size", "num_gpu_blocks"),
    source="vllm",
)
VLLM_METRICS = (
    VLLM_KV_CACHE_USAGE,
    VLLM_REQUESTS_WAITING,
    VLLM_REQUESTS_RUNNING,
    VLLM_PREEMPTIONS,
    VLLM_TIME_TO_FIRST_TOKEN,
    VLLM_TIME_PER_OUTPUT_TOKEN,
    VLLM_PROMPT_TOKENS,
    VLLM_GENERATION_TOKENS,
    VLLM_REQUEST_SUCCESS,
    VLLM_CACHE_CONFIG,
)

# Series Prometheus itself produces.
PROM_UP = Metric(
    "up", "gauge", "1 if the last scrape of the target succeeded.", ("job", "instance"), source="prometheus"
)
PROM_ALERTS = Metric(
    "ALERTS", "gauge", "Alerts pending or firing.", ("alertname", "alertstate"), source="prometheus"
)
PROMETHEUS_METRICS = (PROM_UP, PROM_ALERTS)

ALL_METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        *SIDECAR_METRICS,
        *DCGM_METRICS,
        *GPU_EXPORTER_METRICS,
        *TRITON_METRICS,
        *VLLM_METRICS,
        *PROMETHEUS_METRICS,
    )
}


def metric(name: str) -> Metric:
    """The contract's entry for ``name``; a KeyError names the unknown metric."""
    try:
        return ALL_METRICS[name]
    except KeyError:
        raise KeyError(f"{name!r} is not in the inferwatch metric contract") from None


# ---------------------------------------------------------------------------------------
# Alerts
# ---------------------------------------------------------------------------------------
SEVERITY_CRITICAL = "critical"
SEVERITY_WARNING = "warning"
SEVERITY_INFO = "info"
SEVERITIES = (SEVERITY_CRITICAL, SEVERITY_WARNING, SEVERITY_INFO)

ALERT_HIGH_ERROR_RATE = "InferenceHighErrorRate"
ALERT_HIGH_P99_LATENCY = "InferenceHighP99Latency"
ALERT_GPU_MEMORY_PRESSURE = "GPUMemoryPressure"
TIERED_ALERTS = {
    ALERT_HIGH_ERROR_RATE: SEVERITY_CRITICAL,
    ALERT_HIGH_P99_LATENCY: SEVERITY_WARNING,
    ALERT_GPU_MEMORY_PRESSURE: SEVERITY_INFO,
}
ALERT_ANNOTATIONS = ("summary", "description", "runbook_url", "dashboard_url")
MODEL_ALERT_LABELS = (L_MODEL, L_VERSION)
GPU_ALERT_LABELS = (L_GPU, L_UUID, L_HOSTNAME)

# Alerts beyond the three tiers (alert_rules/): SLO burn rates and the stack's own health.
ALERT_SLO_FAST_BURN = "InferenceErrorBudgetFastBurn"  # 14.4x over 1h&5m, 6x over 6h&30m: pages
ALERT_SLO_SLOW_BURN = "InferenceErrorBudgetSlowBurn"  # 3x over 1d&2h, 1x over 3d&6h: a ticket
ALERT_TARGET_DOWN = "InferwatchTargetDown"  # a scrape target of JOBS is down
ALERT_UPSTREAM_DOWN = "InferenceUpstreamDown"  # the sidecar cannot reach its model server
ALERT_GPU_XID_ERRORS = "GPUXidErrors"  # the GPU driver reported XID errors
# A version worse than another version of the same model by the spec's canary margins.
ALERT_CANARY_REGRESSION = "InferenceCanaryRegression"
OTHER_ALERTS = {
    ALERT_SLO_FAST_BURN: SEVERITY_CRITICAL,
    ALERT_SLO_SLOW_BURN: SEVERITY_WARNING,
    ALERT_TARGET_DOWN: SEVERITY_WARNING,
    ALERT_UPSTREAM_DOWN: SEVERITY_CRITICAL,
    ALERT_GPU_XID_ERRORS: SEVERITY_WARNING,
    ALERT_CANARY_REGRESSION: SEVERITY_WARNING,
}
# Generative (LLM) serving: the sidecar's TTFT/TPOT (warning), a TTFT latency SLO per LLM
# model (burn rates: 14.4x over 1h&5m, 6x over 6h&30m page; 1x over 3d&6h a ticket), and
# saturation from vLLM's own metrics.
ALERT_HIGH_TTFT = "InferenceHighTTFT"
ALERT_HIGH_TPOT = "InferenceHighTPOT"
ALERT_TTFT_SLO_FAST_BURN = "InferenceTTFTBudgetFastBurn"
ALERT_TTFT_SLO_SLOW_BURN = "InferenceTTFTBudgetSlowBurn"
ALERT_LLM_KV_CACHE_SATURATION = "LLMKVCacheSaturation"
ALERT_LLM_PREEMPTIONS = "LLMPreemptions"
ALERT_LLM_REQUESTS_QUEUED = "LLMRequestsQueued"
LLM_ALERTS = {
    ALERT_HIGH_TTFT: SEVERITY_WARNING,
    ALERT_HIGH_TPOT: SEVERITY_WARNING,
    ALERT_TTFT_SLO_FAST_BURN: SEVERITY_CRITICAL,
    ALERT_TTFT_SLO_SLOW_BURN: SEVERITY_WARNING,
    ALERT_LLM_KV_CACHE_SATURATION: SEVERITY_INFO,
    ALERT_LLM_PREEMPTIONS: SEVERITY_WARNING,
    ALERT_LLM_REQUESTS_QUEUED: SEVERITY_WARNING,
}
OTHER_ALERTS |= LLM_ALERTS
# Overload protection: a model whose limits shed more than the spec's share of its requests.
ALERT_LOAD_SHEDDING = "InferenceLoadShedding"
OTHER_ALERTS[ALERT_LOAD_SHEDDING] = SEVERITY_WARNING
REC_SHED_RATIO = "model:inferwatch_requests_shed:ratio_rate"  # over alerts.load_shedding.window
L_CHECK = "check"  # on ALERT_CANARY_REGRESSION: which comparison failed ("errors" or "latency")
ALL_ALERTS = {**TIERED_ALERTS, **OTHER_ALERTS}

# ---------------------------------------------------------------------------------------
# Ports: each component's default, here once
# ---------------------------------------------------------------------------------------
PORTS = {
    "triton_http": 8000,
    "triton_grpc": 8001,
    "triton_metrics": 8002,
    "sidecar_http": 8010,
    "sidecar_grpc": 8011,
    "sidecar_metrics": 9110,
    "gpu_exporter": 9400,
    "prometheus": 9090,
    "alertmanager": 9093,
    "alertmanager_2": 9094,  # the HA peer (a second Alertmanager, clustered with the first)
    # Gossip between the two. Set explicitly: 9094 is Alertmanager's default gossip port.
    "alertmanager_cluster": 9194,
    "alertmanager_2_cluster": 9195,
    "pager": 9095,
    "grafana": 3000,
    "vllm": 8100,  # the LLM reference server: OpenAI API and its own /metrics
    "llm_sidecar_http": 8020,
    "llm_sidecar_metrics": 9120,
}

# Prometheus job names, shared by the scrape config, the rules (target-down alerts) and
# the dashboards.
JOB_SIDECAR = "inferwatch-sidecar"
JOB_TRITON = "triton"
JOB_GPU_EXPORTER = "gpu-exporter"
JOBS = (JOB_SIDECAR, JOB_TRITON, JOB_GPU_EXPORTER)
# vLLM's own /metrics where an LLM server runs (docker-compose, the Kubernetes PodMonitor);
# the LLM sidecar in front of it is a target of JOB_SIDECAR like any other sidecar.
JOB_VLLM = "vllm"

# ---------------------------------------------------------------------------------------
# Recording rules (alert_rules/generated/); dashboards query these names. Windows come
# from the fleet spec, so the names carry none; see alert_rules/README.md.
# ---------------------------------------------------------------------------------------
L_QUANTILE = "quantile"  # on REC_LATENCY_QUANTILE: "0.99" (alerts.latency.quantile) and "0.5"
L_WINDOW = "window"  # on REC_SLO_ERROR_RATIO: the window the ratio covers ("5m", "1h", ...)
L_SLO_PERIOD = "slo_period"  # on SLO series: the objective's period ("30d")
# Requests/s per model and version over alerts.error_rate.window.
REC_REQUEST_RATE = "model_version:inferwatch_requests:rate"
# Server-error ratio per model and version over alerts.error_rate.window; absent (not NaN)
# for a model that had no traffic in the window.
REC_SERVER_ERROR_RATIO = "model_version:inferwatch_server_errors:ratio"
# Latency quantiles per model and version over alerts.latency.window (label quantile);
# absent for a model without traffic.
REC_LATENCY_QUANTILE = "model_version:inferwatch_request_duration_seconds:quantile"
# The latency histogram's buckets summed over pods, per model, version and le, as rates over
# alerts.latency.window: recorded once, read by every quantile (deploy/SCALING.md).
REC_LATENCY_BUCKET_RATE = "model_version_le:inferwatch_request_duration_seconds_bucket:rate"
# Each model's latency SLA in seconds: the sidecar's SLA gauge, else the spec's default.
REC_LATENCY_SLA = "model:inferwatch_latency_sla_seconds:effective"
# Framebuffer used / (used + free + reserved) per GPU, with the GPU's dcgm labels.
REC_GPU_FB_USED_RATIO = "gpu:inferwatch_fb_used:ratio"
# SLO series, only for models with an slo in the spec.
REC_SLO_ERROR_RATIO = "model:inferwatch_slo_errors:ratio_rate"  # label window
REC_SLO_OBJECTIVE = "model:inferwatch_slo:objective"
REC_SLO_BUDGET_REMAINING = "model:inferwatch_slo_error_budget:remaining"  # 1 = untouched, <0 = spent
# Requests/s and server errors/s over each SLO window under a day (label window); the windows
# of a day or more sum the shortest one's over time instead of scanning the raw counters.
REC_SLO_REQUEST_RATE = "model:inferwatch_slo_requests:rate"
REC_SLO_ERROR_RATE = "model:inferwatch_slo_server_errors:rate"
# Canary comparison (canary.window of the spec), only for versions with at least
# canary.min_requests requests (the error ratio) or successful requests (the quantile).
REC_CANARY_ERROR_RATIO = "model_version:inferwatch_canary_server_errors:ratio"
# Requests per model version over canary.window, every version: the error ratio's denominator.
REC_CANARY_REQUESTS = "model_version:inferwatch_canary_requests:increase"
REC_CANARY_LATENCY_QUANTILE = "model_version:inferwatch_canary_request_duration_seconds:quantile"
# Generative (LLM) serving (alert_rules/groups/llm.py, llm_slo.py, llm_saturation.py).
# TTFT and TPOT quantiles per model and version over alerts.latency.window (label quantile).
REC_TTFT_QUANTILE = "model_version:inferwatch_time_to_first_token_seconds:quantile"
REC_TPOT_QUANTILE = "model_version:inferwatch_time_per_output_token_seconds:quantile"
# Their histograms' buckets summed over pods per model, version and le over alerts.latency.window.
REC_TTFT_BUCKET_RATE = "model_version_le:inferwatch_time_to_first_token_seconds_bucket:rate"
REC_TPOT_BUCKET_RATE = "model_version_le:inferwatch_time_per_output_token_seconds_bucket:rate"
# Each LLM model's TTFT/TPOT SLA in seconds: the sidecar's gauge, else the spec's default.
REC_TTFT_SLA = "model:inferwatch_ttft_sla_seconds:effective"
REC_TPOT_SLA = "model:inferwatch_tpot_sla_seconds:effective"
# The TTFT latency SLO, only for models with a ttft_slo in the spec: the share of requests
# whose first token came later than the SLA (label window), the objective, the budget left.
REC_TTFT_SLO_SLOW_RATIO = "model:inferwatch_ttft_slo_slow:ratio_rate"
REC_TTFT_SLO_OBJECTIVE = "model:inferwatch_ttft_slo:objective"
REC_TTFT_SLO_BUDGET_REMAINING = "model:inferwatch_ttft_slo_error_budget:remaining"
# First tokens/s, and those within the model's TTFT SLA, over each window under a day (label window).
REC_TTFT_SLO_FIRST_TOKEN_RATE = "model:inferwatch_ttft_slo_first_tokens:rate"
REC_TTFT_SLO_ON_TIME_RATE = "model:inferwatch_ttft_slo_first_tokens_on_time:rate"
# vLLM's own series with the model label added (model = vLLM's model_name, its first served
# name); every other label kept, so these are per engine (instance, engine).
REC_VLLM_KV_CACHE_USAGE = "model_engine:vllm_kv_cache_usage:ratio"
REC_VLLM_REQUESTS_WAITING = "model_engine:vllm_requests_waiting:count"
REC_VLLM_REQUESTS_RUNNING = "model_engine:vllm_requests_running:count"
REC_VLLM_PREEMPTIONS_RATE = "model_engine:vllm_preemptions:rate"  # over alerts.latency.window
RECORDING_RULES = (
    REC_TTFT_QUANTILE,
    REC_TPOT_QUANTILE,
    REC_TTFT_SLA,
    REC_TPOT_SLA,
    REC_TTFT_SLO_SLOW_RATIO,
    REC_TTFT_SLO_OBJECTIVE,
    REC_TTFT_SLO_BUDGET_REMAINING,
    REC_VLLM_KV_CACHE_USAGE,
    REC_VLLM_REQUESTS_WAITING,
    REC_VLLM_REQUESTS_RUNNING,
    REC_VLLM_PREEMPTIONS_RATE,
    REC_SHED_RATIO,
    REC_REQUEST_RATE,
    REC_SERVER_ERROR_RATIO,
    REC_LATENCY_QUANTILE,
    REC_LATENCY_SLA,
    REC_GPU_FB_USED_RATIO,
    REC_SLO_ERROR_RATIO,
    REC_SLO_OBJECTIVE,
    REC_SLO_BUDGET_REMAINING,
    REC_CANARY_ERROR_RATIO,
    REC_CANARY_REQUESTS,
    REC_CANARY_LATENCY_QUANTILE,
    REC_LATENCY_BUCKET_RATE,
    REC_TTFT_BUCKET_RATE,
    REC_TPOT_BUCKET_RATE,
    REC_SLO_REQUEST_RATE,
    REC_SLO_ERROR_RATE,
    REC_TTFT_SLO_FIRST_TOKEN_RATE,
    REC_TTFT_SLO_ON_TIME_RATE,
)

# Series names that are not metric families of a component but may appear in generated
# files (recording rules add theirs here), and dcgm-exporter's DCGM_FI_* label field.
EXTRA_SERIES: frozenset[str] = frozenset(RECORDING_RULES) | {L_DRIVER_VERSION}
