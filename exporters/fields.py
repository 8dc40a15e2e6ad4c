"""The list of dcgm-exporter fields to collect: a data file (field, type, help), as dcgm-exporter keeps it.

The parser names the file and line of any bad row, and refuses a field that is not in the
inferwatch contract or whose type differs from it, so the file cannot invent or retype a name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from inferwatch import contract

DEFAULT_FIELDS = Path(__file__).with_name("fields.csv")
_TYPES = ("gauge", "counter")


class FieldsError(ValueError):
    """A malformed fields file; the message is one line: ``file:line: reason``."""


@dataclass(frozen=True, slots=True)
class Field:
    metric: contract.Metric
    help: str
    line: int


def parse_fields(text: str, source: str = "<fields>") -> tuple[Field, ...]:
    known = {m.name: m for m in contract.DCGM_METRICS}
    fields: list[Field] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(",", 2)]
        if len(parts) != 3:
            raise FieldsError(f"{source}:{lineno}: expected 'field, type, help', got {raw.strip()!r}")
        name, type_, help_ = parts
        if not name:
            raise FieldsError(f"{source}:{lineno}: empty field name")
        if name == contract.L_DRIVER_VERSION:
            # dcgm-exporter's default-counters.csv lists it as a label; the exporter always
            # writes it on the dcgm series (when the driver tells it), so the row is accepted
            if type_ != "label":
                raise FieldsError(f"{source}:{lineno}: {name}: a label field, type must be 'label'")
            continue
        if type_ == "label":
            raise FieldsError(
                f"{source}:{lineno}: {name}: label fields are not supported "
                f"(only {contract.L_DRIVER_VERSION}, which is always written)"
            )
        if type_ not in _TYPES:
            raise FieldsError(f"{source}:{lineno}: {name}: type must be gauge or counter, got {type_!r}")
        if not help_:
            raise FieldsError(f"{source}:{lineno}: {name}: empty help message")
        metric = known.get(name)
        if metric is None:
            raise FieldsError(
                f"{source}:{lineno}: {name}: not a field this exporter collects "
                f"(known: {', '.join(sorted(known))})"
            )
        if metric.type != type_:
            raise FieldsError(
                f"{source}:{lineno}: {name}: type {type_!r} differs from dcgm-exporter's {metric.type!r}"
            )
        if name in seen:
            raise FieldsError(f"{source}:{lineno}: {name}: already listed on line {seen[name]}")
        seen[name] = lineno
        fields.append(Field(metric, help_, lineno))
    if not fields:
        raise FieldsError(f"{source}: no fields listed")
    return tuple(fields)


def load_fields(path: str | Path = DEFAULT_FIELDS) -> tuple[Field, ...]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise FieldsError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return parse_fields(text, str(path))
