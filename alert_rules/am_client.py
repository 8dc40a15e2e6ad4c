"""A small typed client for the Alertmanager API v2: list alerts, list, create and expire
silences. Used by ``inferwatch alerts`` and ``inferwatch silence``.

Errors from the API or the network raise ``AlertmanagerError`` with one readable line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import httpx

from inferwatch.contract import PORTS

DEFAULT_URL = f"http://127.0.0.1:{PORTS['alertmanager']}"
URL_ENV = "INFERWATCH_ALERTMANAGER_URL"


class AlertmanagerError(Exception):
    """The API answered with an error, or could not be reached."""


_MATCHER_RE = re.compile(r"^\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*(.*?)\s*$")


@dataclass(frozen=True, slots=True)
class Matcher:
    name: str
    value: str
    is_regex: bool = False
    is_equal: bool = True

    @classmethod
    def parse(cls, text: str) -> Matcher:
        """``name=value``, ``name!=value``, ``name=~regex``, ``name!~regex`` (value may be quoted)."""
        m = _MATCHER_RE.match(text)
        if not m:
            raise ValueError(f"{text!r} is not a matcher (use name=value, name!=value, name=~re or name!~re)")
        name, op, value = m.groups()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1]
        return cls(name, value, is_regex=op in ("=~", "!~"), is_equal=op in ("=", "=~"))

    def __str__(self) -> str:
        op = {(False, True): "=", (False, False): "!=", (True, True): "=~", (True, False): "!~"}
        return f'{self.name}{op[(self.is_regex, self.is_equal)]}"{self.value}"'

    def to_api(self) -> dict:
        return {"name": self.name, "value": self.value, "isRegex": self.is_regex, "isEqual": self.is_equal}

    @classmethod
    def from_api(cls, data: dict) -> Matcher:
        return cls(data["name"], data["value"], bool(data.get("isRegex")), bool(data.get("isEqual", True)))


def _time(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


@dataclass(frozen=True, slots=True)
class Alert:
    fingerprint: str
    labels: dict[str, str]
    annotations: dict[str, str]
    state: str  # "active", "suppressed" or "unprocessed"
    starts_at: datetime | None
    ends_at: datetime | None
    silenced_by: list[str] = field(default_factory=list)
    inhibited_by: list[str] = field(default_factory=list)
    receivers: list[str] = field(default_factory=list)

    @classmethod
    def from_api(cls, data: dict) -> Alert:
        status = data.get("status", {})
        return cls(
            fingerprint=data["fingerprint"],
            labels=dict(data.get("labels", {})),
            annotations=dict(data.get("annotations", {})),
            state=status.get("state", ""),
            starts_at=_time(data.get("startsAt")),
            ends_at=_time(data.get("endsAt")),
            silenced_by=list(status.get("silencedBy") or []),
            inhibited_by=list(status.get("inhibitedBy") or []),
            receivers=[r["name"] for r in data.get("receivers", [])],
        )

    @property
    def name(self) -> str:
        return self.labels.get("alertname", "")


@dataclass(frozen=True, slots=True)
class Silence:
    id: str
    matchers: list[Matcher]
    starts_at: datetime | None
    ends_at: datetime | None
    created_by: str
    comment: str
    state: str  # "active", "pending" or "expired"

    @classmethod
    def from_api(cls, data: dict) -> Silence:
        return cls(
            id=data["id"],
            matchers=[Matcher.from_api(m) for m in data.get("matchers", [])],
            starts_at=_time(data.get("startsAt")),
            ends_at=_time(data.get("endsAt")),
            created_by=data.get("createdBy", ""),
            comment=data.get("comment", ""),
            state=data.get("status", {}).get("state", ""),
        )


class AlertmanagerClient:
    """``url`` is Alertmanager's base URL (``http://host:9093``); ``client`` may be shared."""

    def __init__(self, url: str = DEFAULT_URL, timeout: float = 10.0, client: httpx.Client | None = None):
        self.url = url.rstrip("/")
        self._client = client or httpx.Client(timeout=timeout)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> AlertmanagerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            resp = self._client.request(method, f"{self.url}/api/v2{path}", **kw)
        except httpx.HTTPError as exc:
            raise AlertmanagerError(f"cannot reach Alertmanager at {self.url}: {exc}") from None
        if resp.status_code >= 400:
            detail = resp.text.strip().replace("\n", " ")[:300]
            raise AlertmanagerError(f"Alertmanager answered {resp.status_code} to {method} {path}: {detail}")
        return resp

    def ready(self) -> bool:
        try:
            return self._client.get(f"{self.url}/-/ready").status_code == 200
        except httpx.HTTPError:
            return False

    def alerts(
        self,
        matchers: list[Matcher] | None = None,
        active: bool = True,
        silenced: bool = True,
        inhibited: bool = True,
        receiver: str | None = None,
    ) -> list[Alert]:
        params: list[tuple[str, str]] = [("filter", str(m)) for m in matchers or []]
        params += [
            ("active", str(active).lower()),
            ("silenced", str(silenced).lower()),
            ("inhibited", str(inhibited).lower()),
        ]
        if receiver:
            params.append(("receiver", receiver))
        data = self._request("GET", "/alerts", params=params).json()
        return sorted((Alert.from_api(a) for a in data), key=lambda a: (a.name, sorted(a.labels.items())))

    def silences(self) -> list[Silence]:
        data = self._request("GET", "/silences").json()
        return sorted((Silence.from_api(s) for s in data), key=lambda s: (s.state, s.ends_at or datetime.max))

    def create_silence(
        self,
        matchers: list[Matcher],
        duration: timedelta,
        created_by: str,
        comment: str,
        starts_at: datetime | None = None,
    ) -> str:
        """Creates a silence from now (or ``starts_at``) for ``duration``; returns its id."""
        if not matchers:
            raise ValueError("a silence needs at least one matcher")
        if duration <= timedelta(0):
            raise ValueError("a silence needs a positive duration")
        start = starts_at or datetime.now(UTC)
        body = {
            "matchers": [m.to_api() for m in matchers],
            "startsAt": start.isoformat(),
            "endsAt": (start + duration).isoformat(),
            "createdBy": created_by,
            "comment": comment,
        }
        return self._request("POST", "/silences", json=body).json()["silenceID"]

    def expire_silence(self, silence_id: str) -> None:
        self._request("DELETE", f"/silence/{silence_id}")
