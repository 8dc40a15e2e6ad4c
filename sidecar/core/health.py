"""Upstream health: the only writer of the upstream_up gauge, and its one probe.

Two kinds of evidence reach it, for each upstream (``UPSTREAM_HTTP``, ``UPSTREAM_GRPC``):

- traffic: a proxy's connect that succeeded or failed, the index read that answered or not
  (``report(upstream, up, error)``), so the gauge moves with the first failed request;
- the probe: one task (``run``) that opens a TCP connection to every upstream, every
  ``UP_PROBE_S`` while it is up and every ``DOWN_PROBE_S`` (or ``connect_timeout`` if shorter)
  while it is down, so the gauge follows an idle upstream too. An upstream added with
  ``probe=False`` has a probe of its own (the grpc.aio engine's channel reconnects by itself and
  reports its connectivity): a second one would only make the gauge flap between the two.

The gauge is written and a log line (``upstream reachable`` / ``upstream unreachable``, with the
upstream's name and address) is emitted only when an upstream's state changes, whoever saw it.
``is_up(upstream)`` is the current state (None before any evidence) for whoever needs it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("inferwatch.sidecar.core.health")

# Seconds between TCP probes of an upstream while it is up / down.
UP_PROBE_S, DOWN_PROBE_S = 5.0, 0.5


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class UpstreamHealth:
    """Each upstream's state; ``telemetry.set_upstream_up`` is called from here only."""

    def __init__(
        self, telemetry: Any, upstreams: Mapping[str, tuple[str, int]], connect_timeout: float = 2.0
    ) -> None:
        self.telemetry = telemetry
        self.upstreams = dict(upstreams)  # name -> (host, port)
        self.connect_timeout = connect_timeout
        self.state: dict[str, bool | None] = dict.fromkeys(self.upstreams)
        self.probed = set(self.upstreams)
        self._task: asyncio.Task | None = None

    def add(self, upstream: str, address: tuple[str, int], probe: bool = True) -> None:
        """Watch one more upstream (a proxy started after the others)."""
        self.upstreams[upstream] = address
        self.state.setdefault(upstream, None)
        if probe:
            self.probed.add(upstream)
        else:
            self.probed.discard(upstream)

    def is_up(self, upstream: str) -> bool | None:
        return self.state.get(upstream)

    def report(self, upstream: str, up: bool, error: str = "") -> None:
        """What traffic or the probe saw; the gauge and the log follow changes only."""
        if self.state.get(upstream) is up:
            return
        self.state[upstream] = up
        self.telemetry.set_upstream_up(upstream, up)
        host, port = self.upstreams.get(upstream, ("", 0))
        fields = {"upstream": upstream, "address": _address(host, port)}
        if up:
            log.info("upstream reachable", extra={"fields": fields})
        else:
            log.warning("upstream unreachable", extra={"fields": {**fields, "error": error or "closed"}})

    async def probe(self, upstream: str) -> bool:
        """One TCP connect to ``upstream``, reported."""
        host, port = self.upstreams[upstream]
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), self.connect_timeout)
        except (OSError, TimeoutError) as exc:
            self.report(upstream, False, str(exc) or type(exc).__name__)
            return False
        writer.close()
        self.report(upstream, True)
        return True

    async def run(self) -> None:
        """The probe, forever: each upstream on its own cadence (faster while it is down)."""
        due: dict[str, float] = {}
        loop = asyncio.get_running_loop()
        down_s = min(DOWN_PROBE_S, self.connect_timeout)
        while True:
            now = loop.time()
            names = [u for u in list(self.probed) if due.get(u, 0.0) <= now]
            results = await asyncio.gather(*(self.probe(u) for u in names))  # a slow one delays none
            for upstream, up in zip(names, results, strict=True):
                due[upstream] = loop.time() + (UP_PROBE_S if up else down_s)
            wait = min((due[u] for u in self.probed if u in due), default=now + UP_PROBE_S) - loop.time()
            await asyncio.sleep(max(wait, 0.01))

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="upstream-health")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
