"""What the demo observes of the stack: the pages the pager stored and the alerts and traffic
Prometheus sees, polled once a second in a thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from inferwatch import contract, logs
from inferwatch.spec import FleetSpec, duration_seconds
from inferwatch.stack.core import StackInfo

log = logs.get("inferwatch.demo")


@dataclass
class Page:
    """One alert occurrence as the pager stores it: firing until its resolved
    notification arrives (the pager keys it by receiver, fingerprint and start)."""

    key: str
    alertname: str
    severity: str
    labels: dict[str, str]
    annotations: dict[str, str]
    status: str  # firing | resolved
    received_at: float  # when its first (firing) notification arrived, epoch seconds
    last_received_at: float  # the latest notification (the resolved one, once resolved)
    notifications: int = 1
    receiver: str = ""

    @property
    def resolved_at(self) -> float | None:
        return self.last_received_at if self.status == "resolved" else None

    def ident(self) -> str:
        keys = [k for k in (*contract.MODEL_ALERT_LABELS, contract.L_GPU) if k in self.labels]
        return ", ".join(f"{k}={self.labels[k]}" for k in keys)

    def describe(self) -> str:
        return f"{self.alertname} [{self.severity}] {self.ident()}".strip()


def _epoch(value: object) -> float | None:
    """Epoch seconds from a number or an ISO 8601 string."""
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and value:
        from datetime import datetime

        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


def parse_pages(data: object, now: float) -> list[Page]:
    """The pager's ``GET /pages`` answer (``{"pages": [...]}``) as Page records."""
    items = data.get("pages", []) if isinstance(data, dict) else []
    out = []
    for item in items:
        if not isinstance(item, dict):
            continue
        labels = {str(k): str(v) for k, v in (item.get("labels") or {}).items()}
        first = _epoch(item.get("first_received_at")) or now
        out.append(
            Page(
                # The pager's id names one occurrence: a page that fires again after it resolved
                # has the same receiver, fingerprint and startsAt but a new id.
                key=str(
                    item.get("id")
                    or f"{item.get('receiver', '')}|{item.get('fingerprint', '')}|{item.get('starts_at', '')}"
                ),
                alertname=str(item.get("alertname") or labels.get("alertname", "")),
                severity=str(item.get("severity") or labels.get("severity", "")),
                labels=labels,
                annotations={str(k): str(v) for k, v in (item.get("annotations") or {}).items()},
                status=str(item.get("status", "")),
                received_at=first,
                last_received_at=_epoch(item.get("last_received_at")) or first,
                notifications=int(item.get("notifications", 1)),
                receiver=str(item.get("receiver", "")),
            )
        )
    return out


@dataclass
class AlertState:
    alertname: str
    labels: dict[str, str]
    state: str  # pending | firing
    active_at: float | None

    def ident(self) -> str:
        keys = [k for k in (*contract.MODEL_ALERT_LABELS, contract.L_GPU) if k in self.labels]
        return ",".join(f"{k}={self.labels[k]}" for k in keys)


class Observer:
    """Polls Prometheus (alerts, traffic) and the pager (pages) once a second in a thread,
    and hands changes to callbacks."""

    def __init__(
        self,
        info: StackInfo,
        spec: FleetSpec,
        on_page: Callable[[Page, str], None],
        on_alert: Callable[[AlertState, str], None],
        interval: float = 1.0,
    ) -> None:
        self.info = info
        self.interval = interval
        self.on_page = on_page
        self.on_alert = on_alert
        self.alerts: dict[tuple, AlertState] = {}
        self.rates: dict[tuple[str, str], tuple[float, float]] = {}
        self.seen_pages: dict[str, str] = {}  # key -> status already reported
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="demo-observer", daemon=True)
        self._lock = threading.Lock()
        token = info.token_file.read_text().strip() if info.token_file.exists() else ""
        self._client = httpx.Client(
            timeout=3.0, trust_env=False, headers={"Authorization": f"Bearer {token}"} if token else {}
        )
        rate_window = f"{max(4 * duration_seconds(spec.prometheus.scrape_interval), 10):g}s"
        req = contract.REQUESTS_TOTAL.name
        by = f"{contract.L_MODEL}, {contract.L_VERSION}"
        err = f'{contract.L_OUTCOME}="{contract.OUTCOME_SERVER_ERROR}"'
        self._rate_query = f"sum by ({by}) (rate({req}[{rate_window}]))"
        self._error_query = f"sum by ({by}) (rate({req}{{{err}}}[{rate_window}]))"

    def baseline(self) -> None:
        """Remember the pages already stored (from an earlier run), so only new ones count."""
        for page in self._fetch_pages():
            self.seen_pages[page.key] = "resolved"  # an old occurrence never counts again

    def start(self) -> None:
        self.baseline()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._client.close()

    def poll_once(self) -> None:
        for page in self._fetch_pages():
            seen = self.seen_pages.get(page.key)
            if seen is None:
                self.seen_pages[page.key] = "firing"
                self.on_page(page, "firing")
                seen = "firing"
            if page.status == "resolved" and seen != "resolved":
                self.seen_pages[page.key] = "resolved"
                self.on_page(page, "resolved")
        self._poll_alerts()
        self._poll_rates()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except httpx.HTTPError as exc:
                self.errors += 1
                log.warning("demo poll failed", error=type(exc).__name__)
            self._stop.wait(self.interval)

    def _fetch_pages(self) -> list[Page]:
        resp = self._client.get(self.info.url("pager", "/pages"), params={"limit": "5000"})
        resp.raise_for_status()
        return sorted(parse_pages(resp.json(), time.time()), key=lambda p: (p.received_at, p.key))

    def _poll_alerts(self) -> None:
        resp = self._client.get(self.info.url("prometheus", "/api/v1/alerts"))
        resp.raise_for_status()
        current: dict[tuple, AlertState] = {}
        for a in resp.json().get("data", {}).get("alerts", []):
            labels = a.get("labels", {})
            key = tuple(sorted(labels.items()))
            current[key] = AlertState(
                labels.get("alertname", ""), labels, a.get("state", ""), _epoch(a.get("activeAt"))
            )
        with self._lock:
            previous = self.alerts
            self.alerts = current
        for key, alert in current.items():
            old = previous.get(key)
            if old is None or old.state != alert.state:
                self.on_alert(alert, old.state if old else "inactive")
        for key, alert in previous.items():
            if key not in current:
                self.on_alert(AlertState(alert.alertname, alert.labels, "inactive", None), alert.state)

    def _query(self, query: str) -> dict[tuple[str, str], float]:
        resp = self._client.get(self.info.url("prometheus", "/api/v1/query"), params={"query": query})
        resp.raise_for_status()
        out = {}
        for r in resp.json().get("data", {}).get("result", []):
            m = r.get("metric", {})
            out[(m.get(contract.L_MODEL, ""), m.get(contract.L_VERSION, ""))] = float(r["value"][1])
        return out

    def _poll_rates(self) -> None:
        total = self._query(self._rate_query)
        errors = self._query(self._error_query)
        with self._lock:
            self.rates = {k: (v, errors.get(k, 0.0)) for k, v in sorted(total.items())}

    def snapshot(self) -> tuple[dict[tuple, AlertState], dict[tuple[str, str], tuple[float, float]]]:
        with self._lock:
            return dict(self.alerts), dict(self.rates)
