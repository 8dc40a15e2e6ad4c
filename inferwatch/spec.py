"""The fleet spec: one YAML file that every generated artifact is derived from.

Thresholds, windows, per-model SLAs and routing live here once, so a dashboard's
threshold line and the alert that pages on it can never disagree. Unknown keys are
errors: a typo must not silently fall back to a default.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from inferwatch.paths import DEFAULT_SPEC

_DURATION_RE = re.compile(r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?(?:(\d+)ms)?$")
_UNIT_SECONDS = (86400, 3600, 60, 1, 0.001)


def duration_seconds(text: str) -> float:
    """Seconds in a Prometheus duration such as ``1m``, ``90s``, ``1h30m``."""
    match = _DURATION_RE.match(text)
    if not text or not match or not any(match.groups()):
        raise ValueError(f"{text!r} is not a duration (use Prometheus syntax such as 30s, 1m, 1h30m)")
    return sum(int(g) * u for g, u in zip(match.groups(), _UNIT_SECONDS, strict=True) if g)


def _check_duration(value: str) -> str:
    if duration_seconds(value) <= 0:
        raise ValueError("must be a positive duration")
    return value


Duration = Annotated[str, AfterValidator(_check_duration)]
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+$", min_length=1, max_length=128)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class ErrorRateAlert(_Strict):
    """critical: the server-error ratio of a model above ``threshold`` in each of
    ``consecutive_windows`` windows of length ``window``."""

    threshold: float = Field(0.05, gt=0, lt=1)
    window: Duration = "1m"
    consecutive_windows: int = Field(3, ge=1, le=60)
    min_request_rate: float = Field(
        0.0, ge=0, description="requests/s below which a model's error ratio is not judged"
    )


class LatencyAlert(_Strict):
    """warning: P(quantile) latency of a model above ``sla_factor`` x its SLA, held ``for``."""

    sla_factor: float = Field(2.0, gt=0)
    quantile: float = Field(0.99, gt=0, lt=1)
    window: Duration = "5m"
    for_: Duration = Field("5m", alias="for")


class GpuMemoryAlert(_Strict):
    """info: framebuffer used / total of a GPU above ``threshold``, held ``for``."""

    threshold: float = Field(0.90, gt=0, lt=1)
    for_: Duration = Field("5m", alias="for")


class LoadSheddingAlert(_Strict):
    """warning: the share of a model's requests the sidecar's limits shed above ``threshold``
    over ``window``, held ``for`` (InferenceLoadShedding)."""

    threshold: float = Field(0.01, gt=0, lt=1)
    window: Duration = "5m"
    for_: Duration = Field("5m", alias="for")


class Alerts(_Strict):
    error_rate: ErrorRateAlert = ErrorRateAlert()
    latency: LatencyAlert = LatencyAlert()
    gpu_memory: GpuMemoryAlert = GpuMemoryAlert()
    load_shedding: LoadSheddingAlert = LoadSheddingAlert()


class Slo(_Strict):
    """An availability objective: the fraction of requests that must not be server errors."""

    objective: float = Field(gt=0, lt=1)
    period: Duration = "30d"


# An LLM's SLAs (time to first token, time per output token) in milliseconds; finite.
TokenSlaMs = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class Bucket(_Strict):
    """A token bucket: holds at most ``capacity`` tokens (the burst), refilled at ``fill_rate``
    tokens per second; a request takes its cost from it or is shed."""

    capacity: int = Field(gt=0, le=1_000_000_000)
    fill_rate: float = Field(gt=0, le=1_000_000_000, allow_inf_nan=False, description="tokens per second")


class Adaptive(_Strict):
    """The concurrency limit follows the latency of admitted requests (sidecar.core.admission):
    it starts at ``concurrency``, grows by one per window of answers whose P90 stays under
    ``target_ms`` while the limit is reached, and shrinks by a fifth as soon as a tenth of a
    window's answers are slower; always within ``min`` .. ``max``."""

    min: int = Field(1, ge=1, le=1_000_000)
    max: int = Field(ge=1, le=1_000_000)
    # Time in the server (admitted to answered; the sidecar's queue wait is the queue's
    # business); unset: half the model's latency_sla_ms, the other half left to the queue.
    target_ms: float | None = Field(None, gt=0, le=3_600_000, allow_inf_nan=False)


class Limits(_Strict):
    """Overload protection, enforced per model by the sidecar (sidecar.core.admission) before a
    request reaches the server. Unset: no such limit. In a model, each key set overrides the
    defaults' (``requests: null`` turns an inherited bucket off)."""

    requests: Bucket | None = None  # one token per request
    tokens: Bucket | None = None  # LLM requests: prompt estimate + max_tokens
    concurrency: int | None = Field(None, ge=1, le=1_000_000, description="in flight to the server")
    queue: int = Field(0, ge=0, le=1_000_000, description="waiting for a concurrency slot beyond that")
    queue_timeout_ms: float = Field(500.0, gt=0, le=3_600_000, allow_inf_nan=False)
    adaptive: Adaptive | None = None  # concurrency follows latency; concurrency is where it starts


def _merge(base: Limits | None, own: Limits | None) -> Limits | None:
    """A model's limits on top of the defaults': the keys the model sets win."""
    if own is None or base is None:
        return own if base is None else base
    merged = base.model_dump()
    merged.update({k: v for k, v in own.model_dump().items() if k in own.model_fields_set})
    return Limits.model_validate(merged)


class Model(_Strict):
    name: Name
    latency_sla_ms: float = Field(gt=0)
    slo: Slo | None = None
    team: str | None = None
    # LLM models: the defaults' SLAs apply where these are unset.
    ttft_sla_ms: TokenSlaMs | None = None
    tpot_sla_ms: TokenSlaMs | None = None
    # A latency objective on TTFT: the fraction of requests whose first token comes within
    # ttft_sla_ms. Its burn-rate windows scale with the period like the availability SLO's.
    ttft_slo: Slo | None = None
    # Names an engine serves this model under (vLLM's --served-model-name), each mapped to the
    # version it stands for: {"tiny-llm": "1", "tiny-llm-canary": "2"}. The sidecar labels a
    # request for a served name with this model and that version.
    served_names: dict[Name, Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+$", max_length=64)]] = {}
    # Overload protection; keys unset here come from defaults.limits.
    limits: Limits | None = None


class Defaults(_Strict):
    latency_sla_ms: float = Field(500.0, gt=0)
    ttft_sla_ms: TokenSlaMs = 1000.0
    tpot_sla_ms: TokenSlaMs = 100.0
    # Every model's limits (each model gets its own buckets and queue), unless it sets its own.
    limits: Limits | None = None


class Prometheus(_Strict):
    scrape_interval: Duration = "15s"
    evaluation_interval: Duration = "15s"


class Webhook(_Strict):
    url: str = Field(pattern=r"^https?://")
    bearer_token_file: str | None = None
    bearer_token: str | None = None
    send_resolved: bool = True


class PagerDuty(_Strict):
    routing_key_file: str
    send_resolved: bool = True


class Slack(_Strict):
    api_url_file: str
    channel: str
    send_resolved: bool = True


class Receiver(_Strict):
    name: Name
    webhooks: list[Webhook] = []
    pagerduty: list[PagerDuty] = []
    slack: list[Slack] = []


class AlertRoute(_Strict):
    """One severity's Alertmanager route (the sidecar's ``Route`` is a URL pattern)."""

    receiver: Name
    group_wait: Duration
    group_interval: Duration = "5m"
    repeat_interval: Duration


class Routing(_Strict):
    """Where each severity goes. ``critical`` pages; ``warning`` opens a ticket;
    ``info`` goes to a low-urgency channel."""

    group_by: list[str] = ["alertname", "model", "version"]
    critical: AlertRoute = AlertRoute(
        receiver="pager", group_wait="10s", group_interval="1m", repeat_interval="1h"
    )
    warning: AlertRoute = AlertRoute(receiver="ticket", group_wait="30s", repeat_interval="4h")
    info: AlertRoute = AlertRoute(receiver="low-urgency", group_wait="1m", repeat_interval="12h")
    receivers: list[Receiver] = [
        Receiver(name="pager", webhooks=[Webhook(url="http://127.0.0.1:9095/webhook")]),
        Receiver(name="ticket", webhooks=[Webhook(url="http://127.0.0.1:9095/webhook")]),
        Receiver(name="low-urgency", webhooks=[Webhook(url="http://127.0.0.1:9095/webhook")]),
    ]

    @model_validator(mode="after")
    def _routes_name_receivers(self) -> Routing:
        names = [r.name for r in self.receivers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate receiver name {dupes[0]!r}")
        for severity in ("critical", "warning", "info"):
            receiver = getattr(self, severity).receiver
            if receiver not in names:
                raise ValueError(f"{severity}.receiver {receiver!r} is not one of the receivers {names}")
        return self


class Links(_Strict):
    runbook_base_url: str = "https://github.com/inferwatch/inferwatch/blob/main/alert_rules/runbooks"
    grafana_url: str = "http://localhost:3000"


class Canary(_Strict):
    """Canary analysis (``inferwatch canary``, the InferenceCanaryRegression alert, the Argo
    Rollouts and Flagger templates): how much worse than its baseline a canary may be."""

    window: Duration = "10m"
    min_requests: int = Field(200, ge=1, description="per version in the window; fewer: inconclusive")
    confidence: float = Field(0.99, gt=0.5, lt=1, description="of the one-sided tests (CLI only)")
    max_error_ratio_increase: float = Field(0.01, ge=0, lt=1, description="absolute, 0.01 = 1 point")
    max_latency_increase: float = Field(
        0.5, gt=0, description="P50/P99 increase allowed, as a fraction of the model's latency SLA"
    )
    max_token_latency_increase: float = Field(
        0.2, gt=0, description="TTFT/TPOT P50/P99 increase allowed, as a fraction of the baseline's"
    )
    for_: Duration = Field("5m", alias="for", description="how long the alert's condition must hold")


class Sidecar(_Strict):
    max_models: int = Field(100, ge=1, le=10000, description="cap on distinct model label values")


class Silences(_Strict):
    """``inferwatch silence add``: a silence longer than this is refused (a forgotten
    silence hides the next real incident)."""

    max_duration: Duration = "7d"


class FleetSpec(_Strict):
    version: Literal[1] = 1
    defaults: Defaults = Defaults()
    alerts: Alerts = Alerts()
    models: list[Model] = []
    prometheus: Prometheus = Prometheus()
    routing: Routing = Routing()
    links: Links = Links()
    sidecar: Sidecar = Sidecar()
    silences: Silences = Silences()
    canary: Canary = Canary()

    @model_validator(mode="after")
    def _unique_models(self) -> FleetSpec:
        seen: set[str] = set()
        for i, model in enumerate(self.models):
            if model.name in seen:
                raise ValueError(f"models[{i}].name: duplicate model name {model.name!r}")
            seen.add(model.name)
        served: dict[str, str] = {}
        for i, model in enumerate(self.models):
            for name in model.served_names:
                if name in served:
                    raise ValueError(
                        f"models[{i}].served_names: {name!r} is already a served name of {served[name]!r}"
                    )
                if name in seen and name != model.name:
                    raise ValueError(f"models[{i}].served_names: {name!r} is the name of another model")
                served[name] = model.name
        # Checked on what each model ends up with: a model may take concurrency from the defaults.
        checks = [("defaults.limits", self.defaults.limits)]
        base = self.defaults.limits
        checks += [(f"models[{i}].limits", _merge(base, m.limits)) for i, m in enumerate(self.models)]
        for where, limits in checks:
            if limits is not None and limits.queue and limits.concurrency is None:
                raise ValueError(f"{where}.queue: a queue waits for a concurrency slot; set concurrency too")
            if limits is not None and limits.adaptive is not None:
                low, high, start = limits.adaptive.min, limits.adaptive.max, limits.concurrency
                if start is None:
                    raise ValueError(
                        f"{where}.adaptive: the limit starts at concurrency; set concurrency too"
                    )
                if low > high:
                    raise ValueError(f"{where}.adaptive.min: {low} is above max ({high})")
                if not low <= start <= high:
                    raise ValueError(
                        f"{where}.concurrency: {start} is outside adaptive's min..max ({low}..{high})"
                    )
        return self

    def served_names(self) -> dict[str, tuple[str, str]]:
        """Every served name the models list -> (model, version)."""
        return {name: (m.name, v) for m in self.models for name, v in m.served_names.items()}

    def model(self, name: str) -> Model | None:
        return next((m for m in self.models if m.name == name), None)

    def latency_sla_seconds(self, name: str) -> float:
        """The model's SLA, the spec's default where the model is not listed."""
        model = self.model(name)
        return (model.latency_sla_ms if model else self.defaults.latency_sla_ms) / 1000.0

    def limits_for(self, name: str) -> Limits | None:
        """The model's limits: the defaults', with the keys the model sets overriding them
        (an ``adaptive`` block's unset ``target_ms`` resolved from the model's SLA); None when
        neither sets any."""
        model = self.model(name)
        limits = _merge(self.defaults.limits, model.limits if model else None)
        if limits is not None and limits.adaptive is not None and limits.adaptive.target_ms is None:
            # Resolved per model: a defaults' adaptive block steers each model to its own SLA.
            target = 0.5 * (model.latency_sla_ms if model else self.defaults.latency_sla_ms)
            adaptive = limits.adaptive.model_copy(update={"target_ms": target})
            limits = limits.model_copy(update={"adaptive": adaptive})
        return limits

    def has_limits(self) -> bool:
        return self.defaults.limits is not None or any(m.limits is not None for m in self.models)

    def ttft_sla_seconds(self, name: str) -> float:
        """The model's time-to-first-token SLA, the spec's default where unset."""
        model = self.model(name)
        ms = model.ttft_sla_ms if model and model.ttft_sla_ms is not None else self.defaults.ttft_sla_ms
        return ms / 1000.0

    def tpot_sla_seconds(self, name: str) -> float:
        """The model's time-per-output-token SLA, the spec's default where unset."""
        model = self.model(name)
        ms = model.tpot_sla_ms if model and model.tpot_sla_ms is not None else self.defaults.tpot_sla_ms
        return ms / 1000.0


# The LLM histograms' fixed ladders (seconds): TTFT spans a cached prompt to a long queue;
# TPOT and inter-token gaps span a fast GPU's ~1 ms to a stalled decode.
TTFT_BASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def token_latency_buckets(
    spec: FleetSpec, kind: Literal["ttft", "tpot"], overrides: Mapping[str, float] | None = None
) -> tuple[float, ...]:
    """Bucket bounds of the sidecar's TTFT (``kind="ttft"``) or TPOT and inter-token
    (``"tpot"``) histograms: the fixed ladder plus every listed model's SLA and the
    default's, each at 1x, 2x and the latency alert's sla_factor x, so "slower than the
    SLA" (the TTFT SLO) and "P99 above 2x the SLA" (the warnings) are exact bucket
    boundaries. ``overrides``: per-model SLAs in seconds on top of the spec's (the
    sidecar's flags), like ``sidecar.core.telemetry.histogram_buckets``."""
    if kind == "ttft":
        base, per_model, default = TTFT_BASE_BUCKETS, "ttft_sla_ms", spec.defaults.ttft_sla_ms
    elif kind == "tpot":
        base, per_model, default = TPOT_BASE_BUCKETS, "tpot_sla_ms", spec.defaults.tpot_sla_ms
    else:
        raise ValueError(f"kind must be 'ttft' or 'tpot', not {kind!r}")
    slas = {m.name: (getattr(m, per_model) or default) / 1000.0 for m in spec.models}
    slas.update(overrides or {})
    factor = spec.alerts.latency.sla_factor
    bounds = set(base)
    for sla in (*slas.values(), default / 1000.0):
        bounds.update((round(sla, 6), round(2 * sla, 6), round(factor * sla, 6)))
    return tuple(sorted(bounds))


class SpecError(Exception):
    """A spec that cannot be used; ``str()`` is one line: ``file: field.path: reason``."""


def _loc(loc: tuple[str | int, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _reason(err: dict) -> str:
    msg = str(err["msg"])
    if err["type"] == "extra_forbidden":
        return "unknown key (check its spelling; see fleet.yaml for the known keys)"
    msg = msg.removeprefix("Value error, ")
    return msg.replace("Input should be", "must be").replace("Field required", "required field is missing")


def parse_spec(data: object, source: str = DEFAULT_SPEC) -> FleetSpec:
    """Validate already-loaded YAML data; raises SpecError with one line per the contract."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(f"{source}: the top level must be a mapping, not {type(data).__name__}")
    try:
        return FleetSpec.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = _loc(err["loc"])
        reason = _reason(err)
        # Model-level validators report their own field path inside the message.
        if (
            not where
            and ": " in reason
            and reason.split(": ", 1)[0].startswith(("models[", "routing", "defaults."))
        ):
            where, reason = reason.split(": ", 1)
        more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
        return_line = f"{source}: {where}: {reason}{more}" if where else f"{source}: {reason}{more}"
        raise SpecError(return_line) from None


def load_spec(path: str | Path) -> FleetSpec:
    """Read and validate a fleet spec file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file (pass the fleet spec with --spec, e.g. fleet.yaml)") from None
    except OSError as exc:
        raise SpecError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise SpecError(f"{path}: {where}invalid YAML: {problem}") from None
    return parse_spec(data, str(path))


def load_spec_for_cli(
    path: str | Path | None,
    *,
    if_none: Literal["default", "default-if-present", "built-in"] = "default",
) -> FleetSpec:
    """The spec a command was given, read the one way every command reads it (the inferwatch
    CLIs, the sidecar and its SIGHUP reload, the stack, deploy/sync.py). A named ``path`` must
    exist. Without one, ``if_none`` says what applies: ``default`` reads DEFAULT_SPEC
    (fleet.yaml in the working directory), which must exist; ``default-if-present`` reads it
    when it exists, else the built-in defaults (for commands that mostly need none); ``built-in``
    never looks for it (the sidecar: a daemon must not pick up whatever fleet.yaml sits in its
    working directory). Raises SpecError, whose text is the one line to print: the file, the
    line or field, the reason and, where there is one, what to do."""
    if path is None or str(path) == "":
        if if_none == "built-in" or (if_none == "default-if-present" and not Path(DEFAULT_SPEC).exists()):
            return FleetSpec()
        path = DEFAULT_SPEC
    return load_spec(path)
