"""Prometheus text format 0.0.4, written exactly as dcgm-exporter writes it.

prometheus_client's ``generate_latest`` appends ``_total`` to every counter's TYPE line, which
would rename dcgm-exporter's counters (total energy, PCIe replays, ...) into other
names. This renderer writes each family under its own name and each sample under the sample's
name, so the registry's collectors (ours and prometheus_client's process collector) render
unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_ESCAPE = str.maketrans({"\\": r"\\", "\n": r"\n", '"': r"\""})
_HELP_ESCAPE = str.maketrans({"\\": r"\\", "\n": r"\n"})


def _value(v: float) -> str:
    return str(v) if type(v) is int else floatToGoString(v)


def render(families: Iterable[Metric]) -> bytes:
    # Materialized so every label dict stays alive while its id() keys the cache below.
    families = list(families)
    out: list[str] = []
    append = out.append
    # Collectors reuse one label dict per GPU across families; render each dict once.
    label_cache: dict[int, str] = {}
    for fam in families:
        name = fam.name
        if fam.type == "counter" and fam.samples and fam.samples[0].name == name + "_total":
            name += "_total"  # a prometheus_client-style counter (family name without _total)
        mtype = "untyped" if fam.type == "unknown" else fam.type
        append(f"# HELP {name} {fam.documentation.translate(_HELP_ESCAPE)}\n# TYPE {name} {mtype}\n")
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            labels = s.labels
            if labels:
                key = id(labels)
                rendered = label_cache.get(key)
                if rendered is None:
                    rendered = (
                        "{" + ",".join(f'{k}="{str(v).translate(_ESCAPE)}"' for k, v in labels.items()) + "}"
                    )
                    label_cache[key] = rendered
                append(f"{s.name}{rendered} {_value(s.value)}\n")
            else:
                append(f"{s.name} {_value(s.value)}\n")
    return "".join(out).encode()
