"""A small typed client for the Alertmanager API v2: list alerts, list, create and expire
silences. Used by ``inferwatch alerts`` and ``inferwatch silence``.

Errors from the API or the network raise ``AlertmanagerError`` with one readable line.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import httpx

from inferwatch.contract import PORTS

DEFAULT_URL = f"http://127.0.0.1:{PORTS['alertmanager']}"
URL_ENV = "INFERWATCH_ALERTMANAGER_URL"


class AlertmanagerError(Exception):
    """The API answered with an error, or could not be reached."""


_MATCHER_RE = re.compile(r"^\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*(.*?)\s*$")
_OPS = {(False, True): "=", (False, False): "!=", (True, True): "=~", (True, False): "!~"}


def _unquote(value: str, text: str) -> str:
    """A double-quoted value unescaped as Alertmanager's matcher parser does (``\\"``,
    ``\\\\``, ``\\n``; another backslash stays itself), or the value as it is when unquoted."""
    if not value.startswith('"'):
        return value
    out, escaped = [], False
    for i, ch in enumerate(value[1:], start=1):
        if escaped:
            out.append({"n": "\n", '"': '"', "\\": "\\"}.get(ch, "\\" + ch))
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            if i != len(value) - 1:
                break
            return "".join(out)
        else:
            out.append(ch)
    raise ValueError(f'{text!r}: a quoted value must end with its quote; write \\" for a quote inside')


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


@dataclass(frozen=True, slots=True)
class Matcher:
    name: str
    value: str
    is_regex: bool = False
    is_equal: bool = True

    @classmethod
    def parse(cls, text: str) -> Matcher:
        """``name=value``, ``name!=value``, ``name=~regex``, ``name!~regex``; the value may be
        double-quoted, with ``\\"`` for a quote and ``\\\\`` for a backslash inside."""
        m = _MATCHER_RE.match(text)
        if not m:
            raise ValueError(f"{text!r} is not a matcher (use name=value, name!=value, name=~re or name!~re)")
        name, op, value = m.groups()
        is_regex = op in ("=~", "!~")
        value = _unquote(value, text)
        if is_regex:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"{text!r}: not a regular expression: {exc}") from None
        return cls(name, value, is_regex=is_regex, is_equal=op in ("=", "=~"))

    def __str__(self) -> str:
        """As Alertmanager's API and amtool read it: the value quoted, ``"`` and ``\\`` escaped."""
        return f"{self.name}{_OPS[(self.is_regex, self.is_equal)]}{_quote(self.value)}"

    @property
    def negative(self) -> bool:
        """Matches every alert whose label differs, including alerts without the label."""
        return not self.is_equal

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
        """KeyError, TypeError or ValueError when ``data`` is not an alert of the API."""
        status = data["status"]
        if not isinstance(data["fingerprint"], str) or not isinstance(status["state"], str):
            raise TypeError("not an alert")
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
        """KeyError, TypeError or ValueError when ``data`` is not a silence of the API."""
        if not isinstance(data["id"], str) or not isinstance(data["status"]["state"], str):
            raise TypeError("not a silence")
        return cls(
            id=data["id"],
            matchers=[Matcher.from_api(m) for m in data.get("matchers", [])],
            starts_at=_time(data.get("startsAt")),
            ends_at=_time(data.get("endsAt")),
            created_by=data.get("createdBy", ""),
            comment=data.get("comment", ""),
            state=data.get("status", {}).get("state", ""),
        )


def check_url(url: str) -> str:
    """``url`` without a trailing slash; ValueError unless it is an http(s) URL with a host."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise ValueError(f"{url!r} is not a URL: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"{url!r} is not an http:// or https:// URL with a host")
    return url.rstrip("/")


def check_silence_id(silence_id: str) -> str:
    """Silence ids are UUIDs; anything else would also change the request's path."""
    try:
        return str(uuid.UUID(silence_id))
    except ValueError:
        raise ValueError(f"{silence_id!r} is not a silence id (a UUID, as 'silence list' shows)") from None


class AlertmanagerClient:
    """``url`` is Alertmanager's base URL (``http://host:9093``); ``client`` may be shared.
    A URL that is not one raises ValueError."""

    def __init__(self, url: str = DEFAULT_URL, timeout: float = 10.0, client: httpx.Client | None = None):
        self.url = check_url(url)
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

    def _parsed(self, method: str, path: str, convert, **kw):
        """``convert(json)`` of the answer; an answer that is not the API's (an HTML login page
        of a proxy, a JSON of another shape) is an AlertmanagerError, not a traceback."""
        resp = self._request(method, path, **kw)
        try:
            return convert(resp.json())
        except (ValueError, KeyError, TypeError, AttributeError):
            kind = resp.headers.get("content-type", "no content type").split(";")[0]
            raise AlertmanagerError(
                f"{self.url} answered {method} /api/v2{path} with something that is not Alertmanager's "
                f"API v2 ({kind}: {resp.text.strip()[:80]!r}); is the URL right?"
            ) from None

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
        alerts = self._parsed("GET", "/alerts", lambda data: [Alert.from_api(a) for a in data], params=params)
        return sorted(alerts, key=lambda a: (a.name, sorted(a.labels.items())))

    def silences(self) -> list[Silence]:
        silences = self._parsed("GET", "/silences", lambda data: [Silence.from_api(s) for s in data])
        far = datetime.max.replace(tzinfo=UTC)
        return sorted(silences, key=lambda s: (s.state, s.ends_at or far))

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
        try:
            end = start + duration
        except OverflowError:
            raise ValueError("the silence would end after the year 9999") from None
        body = {
            "matchers": [m.to_api() for m in matchers],
            "startsAt": start.isoformat(),
            "endsAt": end.isoformat(),
            "createdBy": created_by,
            "comment": comment,
        }
        return self._parsed("POST", "/silences", lambda data: str(data["silenceID"]), json=body)

    def expire_silence(self, silence_id: str) -> None:
        self._request("DELETE", f"/silence/{check_silence_id(silence_id)}")
