"""Alertmanager's webhook payload (version 4), and turning a request body into one.

Every way a body can be wrong ends in ``BadPayload`` with a 4xx status and one line: a 500
would make Alertmanager retry the same bad body forever.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictStr, ValidationError

# RFC 3339 as Alertmanager (Go's time.RFC3339Nano) writes it: any fraction, Z or an offset.
_RFC3339 = re.compile(
    r"^(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?([Zz]|[+-]\d{2}:\d{2})$"
)
# Go's zero time: what Alertmanager sends as a firing alert's endsAt.
ZERO_TIME = "0001-01-01T00:00:00.000000000Z"


def normalize_time(text: str) -> str:
    """``text`` (RFC 3339) as UTC with nine fraction digits, so that equal instants are
    equal strings and string order is time order; ValueError when it is not RFC 3339."""
    m = _RFC3339.match(text)
    if not m:
        raise ValueError(f"{text[:40]!r} is not an RFC 3339 time such as 2026-11-30T09:00:00Z")
    frac = (m.group(7) or "").ljust(9, "0")
    offset = m.group(8).upper().replace("Z", "+00:00")
    try:
        when = datetime.fromisoformat(f"{text[:19]}{offset}".replace("t", "T")).astimezone(UTC)
    except (ValueError, OverflowError):
        raise ValueError(f"{text[:40]!r} is not a valid date and time") from None
    return f"{when.replace(tzinfo=None).isoformat(timespec='seconds')}.{frac}Z"


def parse_time(normalized: str) -> datetime:
    """A time from ``normalize_time`` as an aware datetime (to the microsecond)."""
    return datetime.fromisoformat(normalized[:26] + "+00:00")


Time = Annotated[StrictStr, AfterValidator(normalize_time)]


class WebhookAlert(BaseModel):
    model_config = ConfigDict(extra="ignore")
    status: Literal["firing", "resolved"]
    labels: dict[StrictStr, StrictStr]
    annotations: dict[StrictStr, StrictStr] = {}
    startsAt: Time
    endsAt: Time = ZERO_TIME
    generatorURL: StrictStr = ""
    fingerprint: StrictStr = Field(min_length=1, max_length=64)


class WebhookPayload(BaseModel):
    model_config = ConfigDict(extra="ignore")
    version: Literal["4"]
    groupKey: StrictStr
    truncatedAlerts: int = 0
    status: Literal["firing", "resolved"]
    receiver: StrictStr
    groupLabels: dict[StrictStr, StrictStr] = {}
    commonLabels: dict[StrictStr, StrictStr] = {}
    commonAnnotations: dict[StrictStr, StrictStr] = {}
    externalURL: StrictStr = ""
    alerts: list[WebhookAlert] = Field(min_length=1)


class BadPayload(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


def parse_body(raw: bytes) -> WebhookPayload:
    """The payload in ``raw``, or BadPayload (400: not UTF-8 JSON, 422: not a v4 payload)."""
    # json.loads would accept UTF-16 and UTF-32 too; Alertmanager sends UTF-8 only.
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadPayload(400, f"body is not UTF-8: byte {exc.start} is invalid") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadPayload(400, f"body is not JSON: {exc}") from None
    except RecursionError:
        raise BadPayload(400, "body is not a webhook payload: JSON nested too deeply") from None
    try:
        payload = WebhookPayload.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        msg = str(err["msg"]).removeprefix("Value error, ")
        raise BadPayload(422, f"not an Alertmanager v4 payload: {where}: {msg}") from None
    except RecursionError:
        raise BadPayload(400, "body is not a webhook payload: JSON nested too deeply") from None
    # A lone surrogate (\\ud800) is valid JSON but not text: SQLite cannot store it.
    try:
        payload.model_dump_json()
    except ValueError:
        raise BadPayload(422, "not an Alertmanager v4 payload: a string holds a lone surrogate") from None
    return payload
