"""Overload protection's glue around ``sidecar.core.admission``: the HTTP answer to a shed request
and the SIGHUP re-read of the fleet spec's limits.

A shed HTTP request gets 429 with ``Retry-After``, built once per refusal (refusals are prebuilt
per model, so the cache is bounded by the models); the connection closes after it, so its body
is never read and the server never sees it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from inferwatch.spec import FleetSpec, Limits, SpecError, load_spec_for_cli
from sidecar.core.admission import Admission, Refusal

log = logging.getLogger("inferwatch.sidecar")

# Prebuilt 429 answers kept at most; each reload mints new refusals, so the cache is cleared past it.
MAX_CACHED_ANSWERS = 4096
_ANSWERS: dict[Refusal, bytes] = {}


def http_answer(refusal: Refusal) -> bytes:
    answer = _ANSWERS.get(refusal)
    if answer is None:
        body = json.dumps({"error": refusal.message, "reason": refusal.reason}).encode()
        answer = (
            b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nretry-after: %d\r\nconnection: close\r\nvia: 1.1 inferwatch\r\n\r\n%b"
            % (len(body), refusal.retry_after, body)
        )
        if len(_ANSWERS) >= MAX_CACHED_ANSWERS:
            _ANSWERS.clear()
        _ANSWERS[refusal] = answer
    return answer


def limits_of(spec: FleetSpec) -> Callable[[str], Limits | None] | None:
    """What ``Admission`` takes: None when the spec sets no limits (the hot path skips them)."""
    return spec.limits_for if spec.has_limits() else None


def reload_limits(admission: Admission, path: str | None) -> bool:
    """SIGHUP: re-read the spec at ``path`` and swap its limits in; a bad spec is refused
    with its one-line error and the old limits stay. Connections are not touched."""
    if not path:
        log.warning("SIGHUP ignored: the sidecar was started without --spec")
        return False
    try:
        spec = load_spec_for_cli(path)  # the reader and error line --spec had at startup
    except SpecError as exc:
        log.error("spec reload refused, the old limits stay: %s", exc)
        return False
    admission.reload(limits_of(spec))
    log.info("spec reloaded: limits %s", "on" if spec.has_limits() else "off")
    return True
