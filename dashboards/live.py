"""Run dashboard JSON against a live Prometheus the way Grafana would, without Grafana.

Resolves the dashboard's variables from the Prometheus API (``label_values``), expands
``$var``, ``${var}`` and Grafana's interval variables in every query, expands repeated
panels into one instance per value, and queries Prometheus. The snapshot renderer and
the integration tests both use it, so what they check is the committed JSON itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from dashboards.panels import BUILTIN_VARS, DS_VAR

ALL_TOKEN = "$__all"
LABEL_VALUES_RE = re.compile(
    r"^\s*label_values\(\s*(?:(?P<match>.+?)\s*,\s*)?(?P<label>[A-Za-z_]\w*)\s*\)\s*$"
)
# $name, ${name}, ${name:format}, [[name]]
VAR_RE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
LEGEND_RE = re.compile(r"\{\{\s*(\w+)\s*\}\}")
_REGEX_META = re.compile(r"([\\^$.|?*+()\[\]{}])")


class LiveError(Exception):
    """Prometheus could not be reached or refused a query; ``str()`` is one line."""


class QueryError(LiveError):
    """Prometheus answered, and refused the query (a parse error, a timeout, ...)."""


class Prometheus:
    """A small client for Prometheus's HTTP API v1 (query, query_range, label values)."""

    def __init__(self, base_url: str, timeout: float = 15.0) -> None:
        if not re.match(r"^https?://", base_url):
            raise LiveError(f"{base_url!r} is not a Prometheus URL (use http://HOST:PORT)")
        self.base_url = base_url.rstrip("/")
        self._client = httpx.Client(base_url=self.base_url, timeout=timeout)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _get(self, path: str, params: Mapping[str, Any]) -> Any:
        try:
            resp = self._client.get(path, params=params)
        except httpx.HTTPError as exc:
            raise LiveError(f"cannot reach Prometheus at {self.base_url}: {exc}") from None
        try:
            body = resp.json()
        except ValueError:
            raise LiveError(
                f"{self.base_url}{path}: HTTP {resp.status_code}, not a Prometheus API answer"
            ) from None
        if body.get("status") != "success":
            raise QueryError(f"{body.get('errorType', 'error')}: {body.get('error', resp.text[:200])}")
        return body["data"]

    def query(self, expr: str, time: float | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"query": expr}
        if time is not None:
            params["time"] = time
        return self._get("/api/v1/query", params)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        params = {"query": expr, "start": start, "end": end, "step": step}
        return self._get("/api/v1/query_range", params)["result"]

    def label_values(self, label: str, match: str | None, start: float, end: float) -> list[str]:
        params: dict[str, Any] = {"start": start, "end": end}
        if match:
            params["match[]"] = match
        return sorted(self._get(f"/api/v1/label/{label}/values", params))


@dataclass
class Variable:
    name: str
    options: list[str]
    selected: list[str]  # [ALL_TOKEN] for "All"
    all_value: str | None = None
    multi: bool = False

    def value(self) -> str:
        """The text Grafana puts in a query for ``$name``."""
        if self.selected == [ALL_TOKEN]:
            if self.all_value is not None:
                return self.all_value
            return _regex_alternation(self.options)
        if len(self.selected) == 1 and not self.multi:
            return self.selected[0]
        return _regex_alternation(self.selected)

    def values(self) -> list[str]:
        """The concrete values a repeated panel repeats over."""
        return list(self.options) if self.selected == [ALL_TOKEN] else list(self.selected)


def _regex_alternation(values: list[str]) -> str:
    # Grafana escapes regex metacharacters of multi-value variables, doubling the
    # backslash for PromQL's string literal.
    escaped = [_REGEX_META.sub(r"\\\\\1", v) for v in values]
    if not escaped:
        return ""
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


@dataclass
class Context:
    """Everything needed to expand a query: variables and Grafana's interval variables."""

    variables: dict[str, Variable]
    start: float
    end: float
    step: float
    scrape_interval: float
    overrides: dict[str, str] = field(default_factory=dict)  # per repeated panel instance

    def builtin(self, name: str) -> str:
        if name == "__rate_interval":
            return f"{int(max(self.step + self.scrape_interval, 4 * self.scrape_interval))}s"
        if name == "__interval":
            return f"{max(int(self.step), 1)}s"
        if name == "__range":
            return f"{int(self.end - self.start)}s"
        raise KeyError(name)

    def expand(self, text: str) -> str:
        def sub(m: re.Match[str]) -> str:
            name = m.group(1) or m.group(2) or m.group(3)
            if name in self.overrides:
                return self.overrides[name]
            if name in BUILTIN_VARS:
                return self.builtin(name)
            if name in self.variables:
                return self.variables[name].value()
            return m.group(0)  # not ours (e.g. ${__field.labels.x} in links): leave as is

        return VAR_RE.sub(sub, text)

    def with_overrides(self, overrides: dict[str, str]) -> Context:
        return Context(self.variables, self.start, self.end, self.step, self.scrape_interval, overrides)


def resolve_variables(
    dash: dict[str, Any],
    prom: Prometheus,
    start: float,
    end: float,
    pins: Mapping[str, str] | None = None,
) -> dict[str, Variable]:
    """Each variable's options from Prometheus, in order (later variables see earlier ones)."""
    pins = dict(pins or {})
    out: dict[str, Variable] = {}
    ctx = Context(out, start, end, 60, 15)
    for var in dash.get("templating", {}).get("list", []):
        name = var["name"]
        if name == DS_VAR or var.get("type") == "datasource":
            continue
        query = var.get("query")
        if isinstance(query, dict):
            query = query.get("query", "")
        options: list[str] = []
        if var.get("type") == "query":
            m = LABEL_VALUES_RE.match(query or "")
            if not m:
                raise LiveError(f"variable {name}: unsupported query {query!r}")
            match = ctx.expand(m.group("match")) if m.group("match") else None
            options = prom.label_values(m.group("label"), match, start, end)
        elif var.get("type") == "custom":
            options = [o["value"] for o in var.get("options", [])]
        multi = bool(var.get("multi"))
        if name in pins:
            selected = [pins[name]]
        elif var.get("includeAll"):
            selected = [ALL_TOKEN]
        else:
            selected = options[:1] or [""]
        out[name] = Variable(name, options, selected, var.get("allValue"), multi)
    return out


@dataclass
class Query:
    ref: str
    expr: str  # expanded
    legend: str
    instant: bool
    fmt: str
    raw: str  # as written in the JSON


@dataclass
class PanelInstance:
    dashboard_uid: str
    dashboard_title: str
    panel: dict[str, Any]
    title: str  # expanded (repeated panels carry their value)
    queries: list[Query]


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every non-row panel, including those inside collapsed rows."""
    for panel in dash.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def panel_instances(dash: dict[str, Any], ctx: Context) -> Iterator[PanelInstance]:
    """Every panel as Grafana would show it: repeated panels once per value of their variable."""
    for panel in panels(dash):
        repeat = panel.get("repeat")
        if repeat and repeat in ctx.variables:
            values = ctx.variables[repeat].values() or [ctx.variables[repeat].value()]
            contexts = [ctx.with_overrides({repeat: v}) for v in values]
        else:
            contexts = [ctx]
        for inst in contexts:
            queries = [
                Query(
                    t.get("refId", ""),
                    inst.expand(t["expr"]),
                    t.get("legendFormat", ""),
                    bool(t.get("instant")),
                    t.get("format", "time_series"),
                    t["expr"],
                )
                for t in panel.get("targets", [])
                if not t.get("hide")
            ]
            yield PanelInstance(dash["uid"], dash["title"], panel, inst.expand(panel["title"]), queries)


def legend(fmt: str, labels: Mapping[str, str]) -> str:
    """Grafana's legend: ``{{label}}`` replaced by the series' label values."""
    if not fmt:
        return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    return LEGEND_RE.sub(lambda m: labels.get(m.group(1), ""), fmt).strip()
