"""The one config object every alert group reads: selectors, thresholds, windows and links,
all taken from the fleet spec (kubernetes-mixin's ``config.libsonnet`` in Python).

Groups never read the spec directly, so a setting has exactly one place where it is
interpreted. A required setting that is missing raises ``MissingSetting`` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

from inferwatch import contract as c
from inferwatch.spec import FleetSpec, duration_seconds

# The SRE workbook's multi-window, multi-burn-rate pairs for a 30-day objective:
# (severity, burn-rate factor, long window, short window), windows in seconds.
_DAY = 86400
SLO_REFERENCE_PERIOD = 30 * _DAY
SLO_BURN_PAIRS: tuple[tuple[str, float, int, int], ...] = (
    (c.SEVERITY_CRITICAL, 14.4, 3600, 300),
    (c.SEVERITY_CRITICAL, 6.0, 6 * 3600, 1800),
    (c.SEVERITY_WARNING, 3.0, _DAY, 2 * 3600),
    (c.SEVERITY_WARNING, 1.0, 3 * _DAY, 6 * 3600),
)
# The TTFT latency SLO's pairs (same workbook windows): pages at 14.4x and 6x; one ticket at
# 1x over 3d and 6h (the 3x pair is left out: a latency budget spent slowly is a capacity
# question for the next planning round, not for this week).
TTFT_SLO_BURN_PAIRS: tuple[tuple[str, float, int, int], ...] = (
    (c.SEVERITY_CRITICAL, 14.4, 3600, 300),
    (c.SEVERITY_CRITICAL, 6.0, 6 * 3600, 1800),
    (c.SEVERITY_WARNING, 1.0, 3 * _DAY, 6 * 3600),
)
# vLLM's KV cache above this share of its blocks is saturation (LLMKVCacheSaturation, info).
KV_CACHE_THRESHOLD = 0.90
# How long after an XID error the XID alert stays firing (an XID is an event, not a state).
XID_WINDOW = "10m"
# Scrape intervals a target must stay down before it alerts (rides out a restart).
TARGET_DOWN_SCRAPES = 10


class MissingSetting(ValueError):
    """A setting the rules need is absent or empty; the message names it."""


def fmt_duration(seconds: float) -> str:
    """A Prometheus duration for ``seconds`` (``1h30m``, ``8s999ms``), largest units first."""
    ms = round(seconds * 1000)
    if ms <= 0:
        raise ValueError(f"duration must be positive, got {seconds}s")
    out = ""
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000), ("ms", 1)):
        n, ms = divmod(ms, size)
        if n:
            out += f"{n}{unit}"
    return out


def _required(value: object, name: str) -> object:
    if value is None or value == "" or value == []:
        raise MissingSetting(f"{name} is required by the alert rules but is not set in the fleet spec")
    return value


@dataclass(frozen=True, slots=True)
class SloTarget:
    model: str
    objective: float
    period: str  # the spec's spelling, used as the slo_period label value
    period_s: float

    def window(self, reference_seconds: int) -> str:
        """A workbook window scaled from the 30-day reference to this objective's period."""
        return fmt_duration(reference_seconds * self.period_s / SLO_REFERENCE_PERIOD)


@dataclass(frozen=True, slots=True)
class TtftSloTarget:
    """A TTFT latency objective: ``objective`` of the requests get their first token within
    ``sla_s`` (a bucket boundary of the sidecar's TTFT histogram)."""

    model: str
    objective: float
    period: str
    period_s: float
    sla_s: float

    def window(self, reference_seconds: int) -> str:
        return fmt_duration(reference_seconds * self.period_s / SLO_REFERENCE_PERIOD)


@dataclass(frozen=True, slots=True)
class AlertTiming:
    """How long an alert's rule takes, from the spec: what the demo and the alert-pipeline
    benchmark wait for, exported by the alert's group (``timing(cfg)``) so nothing else
    recomputes it from the spec."""

    alertname: str
    # The shortest time a fault must last before the rule's condition holds.
    condition_s: float
    # The data window the condition looks at: how long it still holds after the fault clears.
    window_s: float


@dataclass(frozen=True, slots=True)
class RulesConfig:
    # errors (critical)
    error_threshold: float
    error_window: str
    error_window_s: float
    error_windows: int
    error_min_rate: float
    # latency (warning)
    latency_quantile: float
    latency_factor: float
    latency_window: str
    latency_for: str
    latency_window_s: float
    latency_for_s: float
    default_sla_seconds: float
    # GPU memory (info)
    gpu_threshold: float
    gpu_for: str
    gpu_for_s: float
    # health
    scrape_interval_s: float
    target_down_for: str
    slos: tuple[SloTarget, ...]
    # LLM serving: TTFT/TPOT warnings reuse the latency tier's quantile, factor, window and
    # hold; the KV-cache info reuses the GPU-memory tier's hold.
    default_ttft_sla_seconds: float
    default_tpot_sla_seconds: float
    ttft_slos: tuple[TtftSloTarget, ...]
    # canary (warning): versions of a model against each other
    canary_window: str
    canary_min_requests: int
    canary_max_error_increase: float
    canary_max_latency_increase: float
    canary_for: str
    # links
    runbook_base_url: str
    grafana_url: str
    # load shedding (warning): the share of a model's requests its limits shed
    shed_threshold: float = 0.01
    shed_window: str = "5m"
    shed_for: str = "5m"

    @classmethod
    def from_spec(cls, spec: FleetSpec) -> RulesConfig:
        er, lat, gpu = spec.alerts.error_rate, spec.alerts.latency, spec.alerts.gpu_memory
        for value, name in (
            (er.window, "alerts.error_rate.window"),
            (er.threshold, "alerts.error_rate.threshold"),
            (lat.window, "alerts.latency.window"),
            (lat.for_, "alerts.latency.for"),
            (gpu.for_, "alerts.gpu_memory.for"),
            (spec.links.runbook_base_url, "links.runbook_base_url"),
            (spec.links.grafana_url, "links.grafana_url"),
            (spec.prometheus.scrape_interval, "prometheus.scrape_interval"),
        ):
            _required(value, name)
        slos = tuple(
            SloTarget(m.name, m.slo.objective, m.slo.period, duration_seconds(m.slo.period))
            for m in spec.models
            if m.slo is not None
        )
        return cls(
            error_threshold=er.threshold,
            error_window=er.window,
            error_window_s=duration_seconds(er.window),
            error_windows=er.consecutive_windows,
            error_min_rate=er.min_request_rate,
            latency_quantile=lat.quantile,
            latency_factor=lat.sla_factor,
            latency_window=lat.window,
            latency_for=lat.for_,
            latency_window_s=duration_seconds(lat.window),
            latency_for_s=duration_seconds(lat.for_),
            default_sla_seconds=spec.defaults.latency_sla_ms / 1000.0,
            gpu_threshold=gpu.threshold,
            gpu_for=gpu.for_,
            gpu_for_s=duration_seconds(gpu.for_),
            scrape_interval_s=duration_seconds(spec.prometheus.scrape_interval),
            target_down_for=fmt_duration(
                TARGET_DOWN_SCRAPES * duration_seconds(spec.prometheus.scrape_interval)
            ),
            slos=slos,
            default_ttft_sla_seconds=spec.defaults.ttft_sla_ms / 1000.0,
            default_tpot_sla_seconds=spec.defaults.tpot_sla_ms / 1000.0,
            ttft_slos=tuple(
                TtftSloTarget(
                    m.name,
                    m.ttft_slo.objective,
                    m.ttft_slo.period,
                    duration_seconds(m.ttft_slo.period),
                    spec.ttft_sla_seconds(m.name),
                )
                for m in spec.models
                if m.ttft_slo is not None
            ),
            canary_window=spec.canary.window,
            canary_min_requests=spec.canary.min_requests,
            canary_max_error_increase=spec.canary.max_error_ratio_increase,
            canary_max_latency_increase=spec.canary.max_latency_increase,
            canary_for=spec.canary.for_,
            runbook_base_url=spec.links.runbook_base_url.rstrip("/"),
            grafana_url=spec.links.grafana_url.rstrip("/"),
            shed_threshold=spec.alerts.load_shedding.threshold,
            shed_window=spec.alerts.load_shedding.window,
            shed_for=spec.alerts.load_shedding.for_,
        )

    @property
    def quantile_label(self) -> str:
        return f"{self.latency_quantile:g}"

    @property
    def quantile_name(self) -> str:
        """``P99`` for 0.99, ``P99.9`` for 0.999."""
        return f"P{self.latency_quantile * 100:g}"
