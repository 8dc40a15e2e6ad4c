"""Reading Triton's own counters (its ``/metrics``), for checks and the batching benchmark."""

from __future__ import annotations

from collections import defaultdict

import httpx
from prometheus_client.parser import text_string_to_metric_families

from inferwatch import contract

Counters = dict[str, dict[tuple[str, str], float]]


def scrape(metrics_url: str, timeout: float = 10.0) -> Counters:
    """{metric name: {(model, version): value}} for Triton's per-model series, summed over
    any other label (the request-failure counter is split by ``reason``)."""
    wanted = {m.name for m in contract.TRITON_METRICS}
    out: Counters = defaultdict(lambda: defaultdict(float))
    text = httpx.get(metrics_url, timeout=timeout).text
    for fam in text_string_to_metric_families(text):
        # the parser names counter samples NAME_total; the family keeps Triton's name
        if fam.name not in wanted:
            continue
        for s in fam.samples:
            key = (s.labels.get(contract.L_MODEL, ""), s.labels.get(contract.L_VERSION, ""))
            out[fam.name][key] += s.value
    return out


def delta(before: Counters, after: Counters, name: str, model: str, version: str = "1") -> float:
    return after.get(name, {}).get((model, version), 0.0) - before.get(name, {}).get((model, version), 0.0)
