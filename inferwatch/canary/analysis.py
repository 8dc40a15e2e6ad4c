"""Judge a canary against its baseline from what Prometheus holds, over one window.

Each check compares the two versions of one model on the same window and answers
``pass``, ``fail`` or ``inconclusive``:

- ``errors``: server-error ratio. Fails when the canary's ratio is above the baseline's by
  more than ``canary.max_error_ratio_increase`` *and* a one-sided two-proportion z-test is
  significant at ``canary.confidence``.
- ``latency``: request duration of successful requests. Fails when the canary's P50 or P99
  is above the baseline's by more than ``canary.max_latency_increase`` x the model's SLA
  *and* a one-sided Mann-Whitney test over the histogram buckets is significant.
- ``ttft``, ``tpot``: the same for LLM token latencies, with ``max_token_latency_increase`` x
  the baseline's quantile as the margin, when the contract has those histograms and the
  model has data for them (otherwise they are left out).

Significance alone is not enough (with a lot of traffic a harmless millisecond is
significant) and the margin alone is noise with little traffic; a version with fewer than
``canary.min_requests`` requests (or observations) in the window makes a check inconclusive.
The verdict is ``fail`` if any check fails, else ``inconclusive`` if any is, else ``pass``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import httpx

from inferwatch import contract as c
from inferwatch.canary import queries as q
from inferwatch.canary.stats import binned_mann_whitney, two_proportion_test
from inferwatch.spec import FleetSpec

PASS, FAIL, INCONCLUSIVE, SKIPPED = "pass", "fail", "inconclusive", "skipped"
# Exit codes of `inferwatch canary`, so a deploy pipeline can gate on them.
EXIT_CODES = {PASS: 0, FAIL: 1, INCONCLUSIVE: 2}
EXIT_ERROR = 3
QUANTILES = (0.5, 0.99)
# LLM token latencies, judged when the contract defines them (contract attribute names).
TOKEN_HISTOGRAMS = (("ttft", "TIME_TO_FIRST_TOKEN"), ("tpot", "TIME_PER_OUTPUT_TOKEN"))


class CanaryError(Exception):
    """Prometheus cannot answer, or the arguments cannot be judged; one line for the user."""


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    verdict: str
    baseline: str  # the baseline's figures, for the table
    canary: str
    limit: str  # what would be too much
    p_value: float | None
    reason: str
    values: dict[str, float | int | None] = field(default_factory=dict)  # raw figures for --json


@dataclass(frozen=True, slots=True)
class Report:
    model: str
    baseline: str
    canary: str
    window: str
    evaluated_at: float  # unix seconds
    verdict: str
    checks: tuple[Check, ...]

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    @property
    def why(self) -> str:
        """One line for a table cell: the checks that decided the verdict, and why."""
        deciding = [ch for ch in self.checks if ch.verdict == self.verdict] or list(self.checks)
        return "; ".join(f"{ch.name}: {ch.reason}" for ch in deciding)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["exit_code"] = self.exit_code
        return out


class Prometheus:
    """Instant queries at one fixed time, so every figure of a report covers the same window."""

    def __init__(self, url: str, at: float, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.at = at
        self._http = httpx.Client(timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def vector(self, query: str) -> list[tuple[dict[str, str], float]]:
        try:
            resp = self._http.get(f"{self.url}/api/v1/query", params={"query": query, "time": self.at})
        except httpx.HTTPError as exc:
            raise CanaryError(f"cannot reach Prometheus at {self.url}: {exc}") from None
        try:
            body = resp.json()
        except ValueError:
            raise CanaryError(
                f"{self.url} answered HTTP {resp.status_code}, not the Prometheus API"
            ) from None
        if resp.status_code != 200 or body.get("status") != "success":
            raise CanaryError(f"Prometheus refused a query: {body.get('error', resp.status_code)}")
        data = body["data"]
        if data["resultType"] == "scalar":
            return [({}, float(data["result"][1]))]
        return [(r["metric"], float(r["value"][1])) for r in data["result"]]

    def value(self, query: str) -> float | None:
        """The single sample of ``query``, None when it has none."""
        result = self.vector(query)
        return result[0][1] if result else None


def _count(value: float | None) -> int:
    # increase() extrapolates to the window's edges, so counts arrive as near-integers.
    return 0 if value is None or math.isnan(value) else max(0, round(value))


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or math.isnan(seconds) else f"{seconds * 1000:.3g} ms"


def _too_few(counts: dict[str, int], what: str, window: str, minimum: int) -> str | None:
    short = [f"{role} {n}" for role, n in counts.items() if n < minimum]
    if not short:
        return None
    return f"too little traffic: {', '.join(short)} {what} in {window} (need {minimum} each)"


def _significant(p: float | None, confidence: float) -> bool:
    return p is not None and p < 1.0 - confidence


def check_errors(
    prom: Prometheus, spec: FleetSpec, model: str, baseline: str, canary: str, window: str
) -> Check:
    cs = spec.canary
    n = {
        r: _count(prom.value(q.requests(model, v, window)))
        for r, v in (("baseline", baseline), ("canary", canary))
    }
    e = {
        r: min(n[r], _count(prom.value(q.server_errors(model, v, window))))
        for r, v in (("baseline", baseline), ("canary", canary))
    }
    values = {"baseline_requests": n["baseline"], "canary_requests": n["canary"]}
    values |= {"baseline_errors": e["baseline"], "canary_errors": e["canary"]}
    limit = f"+{cs.max_error_ratio_increase:.2%}"

    def shown(role: str) -> str:
        return f"{e[role]}/{n[role]}" + (f" = {e[role] / n[role]:.2%}" if n[role] else "")

    short = _too_few(n, "requests", window, cs.min_requests)
    if short:
        return Check("errors", INCONCLUSIVE, shown("baseline"), shown("canary"), limit, None, short, values)
    test = two_proportion_test(e["baseline"], n["baseline"], e["canary"], n["canary"])
    values |= {"increase": test.increase, "z": test.z}
    worse = test.increase > cs.max_error_ratio_increase
    significant = _significant(test.p_value, cs.confidence)
    if worse and significant:
        verdict, why = FAIL, f"server errors up {test.increase:+.2%}, beyond {limit} and significant"
    elif worse:
        verdict, why = PASS, f"up {test.increase:+.2%}, but not significant at {cs.confidence:.0%}"
    else:
        verdict, why = PASS, f"{test.increase:+.2%}, within {limit}"
    return Check("errors", verdict, shown("baseline"), shown("canary"), limit, test.p_value, why, values)


def _bucket_counts(prom: Prometheus, query: str) -> dict[float, float]:
    return {float(labels["le"]): value for labels, value in prom.vector(query) if "le" in labels}


def _per_bucket(cumulative: dict[float, float], bounds: list[float]) -> list[int]:
    out, previous = [], 0
    for le in bounds:
        now = _count(cumulative[le])
        out.append(max(0, now - previous))
        previous = max(previous, now)
    return out


def check_histogram(
    prom: Prometheus,
    name: str,
    histogram: c.Metric,
    limit_of: Callable[[float, float | None], float],
    limit_text: str,
    spec: FleetSpec,
    model: str,
    baseline: str,
    canary: str,
    window: str,
) -> Check | None:
    """A latency-like histogram: the rank test over the buckets and P50/P99 against the limit
    that ``limit_of(q, baseline's quantile)`` gives (seconds). None when neither version has
    a series (the model does not export this histogram)."""
    cs = spec.canary
    cum = {
        r: _bucket_counts(prom, q.buckets(histogram, model, v, window))
        for r, v in (("baseline", baseline), ("canary", canary))
    }
    if not cum["baseline"] and not cum["canary"]:
        return None
    n = {r: _count(cum[r].get(math.inf)) for r in cum}
    quant = {
        (r, qq): prom.value(q.quantile(qq, histogram, model, v, window))
        for r, v in (("baseline", baseline), ("canary", canary))
        for qq in QUANTILES
    }
    values: dict[str, float | int | None] = {"baseline_count": n["baseline"], "canary_count": n["canary"]}
    for (r, qq), v in quant.items():
        values[f"{r}_p{qq * 100:g}_seconds"] = None if v is None or math.isnan(v) else v

    def shown(role: str) -> str:
        return " / ".join(_ms(quant[role, qq]) for qq in QUANTILES) + f" (n={n[role]})"

    short = _too_few(n, "observations", window, cs.min_requests)
    if short:
        return Check(name, INCONCLUSIVE, shown("baseline"), shown("canary"), limit_text, None, short, values)
    # Buckets both versions have (the sidecar gives every version of a model the same ladder).
    bounds = sorted(set(cum["baseline"]) & set(cum["canary"]))
    test = binned_mann_whitney(_per_bucket(cum["baseline"], bounds), _per_bucket(cum["canary"], bounds))
    values |= {"rank_effect": test.effect, "z": test.z}
    over = []
    for qq in QUANTILES:
        b, cn = quant["baseline", qq], quant["canary", qq]
        if b is None or cn is None or math.isnan(b) or math.isnan(cn):
            continue
        allowed = limit_of(qq, b)
        values[f"limit_p{qq * 100:g}_seconds"] = allowed
        if cn - b > allowed:
            over.append(f"P{qq * 100:g} +{_ms(cn - b)} (limit +{_ms(allowed)})")
    significant = _significant(test.p_value, cs.confidence)
    effect = f"P(canary slower) = {test.effect:.2f}"
    if over and significant:
        verdict, why = FAIL, f"{'; '.join(over)}; slower by the rank test ({effect})"
    elif over:
        verdict, why = PASS, f"{'; '.join(over)}, but not significant at {cs.confidence:.0%} ({effect})"
    else:
        verdict, why = PASS, f"P50 and P99 within {limit_text} ({effect})"
    return Check(name, verdict, shown("baseline"), shown("canary"), limit_text, test.p_value, why, values)


def token_histograms() -> list[tuple[str, c.Metric]]:
    """The LLM histograms the contract defines (none until the LLM sidecar's names land)."""
    found = [(name, getattr(c, attr, None)) for name, attr in TOKEN_HISTOGRAMS]
    return [(name, m) for name, m in found if isinstance(m, c.Metric) and m.type == "histogram"]


def judge(
    prometheus_url: str,
    model: str,
    baseline: str,
    canary: str,
    spec: FleetSpec | None = None,
    window: str | None = None,
    at: float | None = None,
) -> Report:
    """The canary verdict for ``model``: version ``canary`` against version ``baseline``, over
    ``window`` (default: the spec's ``canary.window``) ending at ``at`` (default: now).
    Raises CanaryError when Prometheus cannot answer."""
    spec = spec or FleetSpec()
    window = window or spec.canary.window
    if baseline == canary:
        raise CanaryError(f"baseline and canary are the same version ({baseline})")
    prom = Prometheus(prometheus_url, time.time() if at is None else at)
    try:
        checks = [check_errors(prom, spec, model, baseline, canary, window)]
        sla = prom.value(q.latency_sla(model, spec.latency_sla_seconds(model)))
        sla = sla if sla is not None and sla > 0 else spec.latency_sla_seconds(model)
        margin = spec.canary.max_latency_increase
        latency = check_histogram(
            prom, "latency", c.REQUEST_DURATION, lambda _q, _b: margin * sla,
            f"+{margin:g} x SLA ({_ms(sla)})", spec, model, baseline, canary, window,
        )  # fmt: skip
        checks.append(
            latency
            or Check("latency", INCONCLUSIVE, "-", "-", "", None, f"no latency histogram in {window}", {})
        )
        token_margin = spec.canary.max_token_latency_increase
        for name, histogram in token_histograms():
            check = check_histogram(
                prom, name, histogram, lambda _q, b: token_margin * b,
                f"+{token_margin:.0%} of baseline", spec, model, baseline, canary, window,
            )  # fmt: skip
            if check is not None:
                checks.append(check)
    finally:
        prom.close()
    verdicts = {ch.verdict for ch in checks}
    verdict = FAIL if FAIL in verdicts else INCONCLUSIVE if INCONCLUSIVE in verdicts else PASS
    return Report(model, baseline, canary, window, prom.at, verdict, tuple(checks))
