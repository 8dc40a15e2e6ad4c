"""Small PromQL builders shared by the alert groups and the dashboards, so each selector is
written once and a panel showing an alert's signal builds it with the alert's own code."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from alert_rules.config import SLO_REFERENCE_PERIOD, fmt_duration
from inferwatch import contract as c
from inferwatch.spec import duration_seconds

MODEL_VERSION = f"{c.L_MODEL}, {c.L_VERSION}"
# Requests that name no model (health checks, repository index) are not a model's traffic.
_HAS_MODEL = f'{c.L_MODEL}!=""'


def models_matcher(models: Iterable[str]) -> str:
    """A matcher for exactly these models (spec names: letters, digits, ``_``, ``.``, ``-``;
    only ``.`` means something in a regex). A rule that keeps only some models selects them
    here, so Prometheus never reads the other models' series."""
    names = "|".join(sorted(m.replace(".", "\\\\.") for m in models))
    return f'{c.L_MODEL}=~"{names}"'


def requests(outcome: str | None = None, models: Iterable[str] | None = None) -> str:
    """The sidecar's request counter, restricted to requests that name a model (to ``models``
    when given)."""
    matchers = [_HAS_MODEL if models is None else models_matcher(models)]
    if outcome:
        matchers.append(f'{c.L_OUTCOME}="{outcome}"')
    return f"{c.REQUESTS_TOTAL.name}{{{', '.join(matchers)}}}"


def request_rate(window: str, by: str, models: Iterable[str] | None = None) -> str:
    return f"sum by ({by}) (rate({requests(models=models)}[{window}]))"


def server_error_rate(window: str, by: str, models: Iterable[str] | None = None) -> str:
    return f"sum by ({by}) (rate({requests(c.OUTCOME_SERVER_ERROR, models)}[{window}]))"


def server_error_ratio(window: str, by: str, min_rate: float = 0.0, total: str | None = None) -> str:
    """Server errors / all requests over ``window``. A model without server-error series
    counts 0 errors; a model with no traffic (rate <= min_rate) has no result at all, so
    the ratio is never NaN and a silent model never alerts. ``total``: the same
    ``request_rate(window, by)`` already recorded, read instead of every pod's counters twice."""
    total = total or request_rate(window, by)
    return f"(\n  {server_error_rate(window, by)}\n  or\n  0 * {total}\n)\n/\n({total} > {min_rate:g})"


def server_error_ratio_where_errors(window: str, by: str, min_rate: float = 0.0) -> str:
    """``server_error_ratio`` without its zeros (no result where there are no server-error
    series), reading the request counters once instead of twice: for a comparison with a
    threshold above 0, which drops the zeros anyway."""
    return f"{server_error_rate(window, by)}\n/\n({request_rate(window, by)} > {min_rate:g})"


def recorded(name: str, *matchers: str) -> str:
    """A recorded series, narrowed by ``matchers`` (a dashboard adds its variables this way)."""
    body = ", ".join(m for m in matchers if m)
    return f"{name}{{{body}}}" if body else name


def indent(expr: str, spaces: int = 2) -> str:
    pad = " " * spaces
    return "\n".join(pad + line for line in expr.splitlines())


# ---------------------------------------------------------------------------------------
# Histograms: the buckets summed over pods once, every quantile read from that record
# ---------------------------------------------------------------------------------------
INF_BUCKET = 'le="+Inf"'


def bucket_rate(histogram: str, window: str, by: str = MODEL_VERSION) -> str:
    """``sum by (by, le)`` of the histogram's bucket rates over ``window``, requests that name a
    model only: the one expression over every pod's bucket series, for a recording rule."""
    return f"sum by ({by}, le) (rate({histogram}_bucket{{{_HAS_MODEL}}}[{window}]))"


def quantile_of_record(q: float, record: str, by: str = MODEL_VERSION) -> str:
    """Quantile ``q`` from a recorded bucket rate, only where there was traffic (so never NaN).
    The ``+Inf`` bucket is the histogram's count, so the guard needs no other series."""
    return f"histogram_quantile({q:g}, {record})\nand on ({by})\n({record}{{{INF_BUCKET}}} > 0)"


# ---------------------------------------------------------------------------------------
# SLO burn rates: one builder for every objective (availability in groups/slo.py, time to
# first token in groups/llm_slo.py)
# ---------------------------------------------------------------------------------------
# Windows at least this long for a 30-day period (scaled with the period, like the windows)
# read sums over time of the recorded base-window rates instead of the raw counters: a 30-day
# window over the raw counters reads every sample of every pod's series for 30 days, every
# evaluation (deploy/SCALING.md has the cost and why a ratio of sums).
LONG_WINDOW_REFERENCE_S = 86400


class SloTargetLike(Protocol):
    model: str
    objective: float
    period: str
    period_s: float

    def window(self, reference_seconds: int) -> str: ...


@dataclass(frozen=True)
class BurnRateSlo:
    """One kind of objective, as the burn-rate builder needs it.

    ``numerator`` and ``denominator`` build the per-model rate expressions over a window for
    the objectives of one period (``objective`` selects them; ``zero`` is 0 for each model
    with traffic, for a numerator that is 0 rather than absent without events). With ``good``
    the numerator counts good events and the bad share is 1 - numerator / denominator, else
    numerator / denominator.
    """

    objective_record: str
    ratio_record: str
    budget_record: str
    numerator_record: str
    denominator_record: str
    pairs: tuple[tuple[str, float, int, int], ...]
    good: bool
    numerator: Callable[[Sequence[SloTargetLike], str, str, str], str]  # (targets, window, objective, zero)
    denominator: Callable[[Sequence[SloTargetLike], str, str], str]  # (targets, window, objective)

    def objective(self, period: str) -> str:
        return f'{self.objective_record}{{{c.L_SLO_PERIOD}="{period}"}}'

    def burn(self, window: str, period: str) -> str:
        """The burn rate over ``window`` of the models with this period: bad share / budget."""
        ratio = f'max without ({c.L_WINDOW}) ({self.ratio_record}{{{c.L_WINDOW}="{window}"}})'
        return f"{ratio}\n/ on ({c.L_MODEL})\n(1 - {self.objective(period)})"

    def references(self) -> list[int]:
        """Every window recorded, for a 30-day period: the pairs' and the period."""
        ref = sorted({s for _, _, long, short in self.pairs for s in (long, short)})
        return ref if SLO_REFERENCE_PERIOD in ref else [*ref, SLO_REFERENCE_PERIOD]

    def windows(self, slo: SloTargetLike) -> list[str]:
        """Every window recorded for an objective, scaled to its period."""
        return [slo.window(s) for s in self.references()]

    def pairs_for(self, severity: str, slo: SloTargetLike) -> list[tuple[float, str, str]]:
        """(factor, long window, short window) of the pairs of ``severity``, scaled."""
        return [(f, slo.window(lw), slo.window(sw)) for sev, f, lw, sw in self.pairs if sev == severity]

    def alert_expr(self, severity: str, period: str, slo: SloTargetLike) -> str:
        parts = [
            f"(\n  (\n{indent(self.burn(lw, period), 4)}\n  ) > {f:g}\n"
            f"  and on ({c.L_MODEL})\n"
            f"  (\n{indent(self.burn(sw, period), 4)}\n  ) > {f:g}\n)"
            for f, lw, sw in self.pairs_for(severity, slo)
        ]
        return f"\nor on ({c.L_MODEL})\n".join(parts)

    def _share(self, numerator: str, denominator: str) -> str:
        share = f"{numerator}\n/\n({denominator} > 0)"
        return f"1 - (\n{indent(share)}\n)" if self.good else share

    def recording_rules(self, targets: Sequence[SloTargetLike]) -> list[dict]:
        """For the objectives of one period: each objective; the numerator's and the
        denominator's rates over every window under a day, each read from the raw counters
        once; the bad share over every window (under a day: those rates' ratio; a day or more:
        sums over time of the shortest window's rates); the budget left."""
        model, window = c.L_MODEL, c.L_WINDOW
        example = targets[0]
        period = example.period
        objective = self.objective(period)
        rules: list[dict] = [
            {
                "record": self.objective_record,
                "expr": f"vector({t.objective:g})",
                "labels": {model: t.model, c.L_SLO_PERIOD: period},
            }
            for t in targets
        ]

        def rates(w: str) -> tuple[str, str]:
            return (
                f'{self.numerator_record}{{{window}="{w}"}}',
                f'{self.denominator_record}{{{window}="{w}"}}',
            )

        def ratio(expr: str, w: str) -> dict:
            return {
                "record": self.ratio_record,
                "expr": f"(\n{indent(expr)}\n)\nand on ({model})\n{objective}",
                "labels": {window: w},
            }

        references = self.references()
        # The base window: the shortest (5m for 30 days); the long windows sum its rates.
        base = example.window(references[0])
        for ref in references:
            w = example.window(ref)
            num, den = rates(w)
            if ref < LONG_WINDOW_REFERENCE_S:
                zero = f"0 * max without ({window}) ({den})"
                rules += [
                    {"record": self.denominator_record, "expr": self.denominator(targets, w, objective),
                     "labels": {window: w}},
                    {"record": self.numerator_record, "expr": self.numerator(targets, w, objective, zero),
                     "labels": {window: w}},
                    ratio(self._share(num, den), w),
                ]  # fmt: skip
                continue
            # A ratio of sums: each base-window sample weighs by its own traffic. The range is
            # the window less one base window: the samples' own windows reach that far back.
            rng = fmt_duration(duration_seconds(w) - duration_seconds(base))
            num, den = (f"sum_over_time({r}[{rng}])" for r in rates(base))
            rules.append(ratio(self._share(num, den), w))
        rules.append(
            {
                "record": self.budget_record,
                "expr": f"1 - (\n{indent(self.burn(fmt_duration(example.period_s), period))}\n)",
                "labels": {c.L_SLO_PERIOD: period},
            }
        )
        return rules


T = TypeVar("T", bound=SloTargetLike)


def by_period(targets: Iterable[T]) -> dict[str, list[T]]:
    """Objectives grouped by their period, shortest first."""
    out: dict[str, list[T]] = defaultdict(list)
    for t in targets:
        out[t.period].append(t)
    return dict(sorted(out.items(), key=lambda kv: duration_seconds(kv[0])))
