"""Upstream health (sidecar/core/health.py): the one writer of ``inferwatch_upstream_up`` and its one
probe, against real sockets on loopback."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from inferwatch import contract
from sidecar.config import SidecarConfig
from sidecar.core import health as health_mod
from sidecar.core.health import UpstreamHealth
from sidecar.core.telemetry import UPSTREAM_GRPC, UPSTREAM_HTTP, Telemetry
from tests.fixtures.net import free_port

UP = contract.UPSTREAM_UP.name
SIDECAR = Path(__file__).resolve().parent.parent / "sidecar"


def telemetry() -> tuple[Telemetry, CollectorRegistry]:
    registry = CollectorRegistry()
    return Telemetry(registry, SidecarConfig()), registry


def gauge(registry: CollectorRegistry, upstream: str) -> float | None:
    return registry.get_sample_value(UP, {"upstream": upstream})


def test_report_writes_and_logs_only_changes(caplog: pytest.LogCaptureFixture) -> None:
    tel, registry = telemetry()
    h = UpstreamHealth(tel, {UPSTREAM_HTTP: ("127.0.0.1", 8000)})
    assert h.is_up(UPSTREAM_HTTP) is None and gauge(registry, UPSTREAM_HTTP) is None
    with caplog.at_level(logging.INFO, logger="inferwatch.sidecar.core.health"):
        for up in (True, True, False, False, False, True):
            h.report(UPSTREAM_HTTP, up, "" if up else "connection refused")
            assert gauge(registry, UPSTREAM_HTTP) == (1.0 if up else 0.0)
    said = [(r.getMessage(), r.fields.get("error")) for r in caplog.records]  # type: ignore[attr-defined]
    assert said == [
        ("upstream reachable", None),
        ("upstream unreachable", "connection refused"),
        ("upstream reachable", None),
    ]
    assert caplog.records[0].fields["address"] == "127.0.0.1:8000"  # type: ignore[attr-defined]


def test_the_probe_follows_each_upstream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two upstreams, one listening and one not; the second starts listening and the probe
    (faster while it is down) turns its gauge to 1 without any traffic."""
    monkeypatch.setattr(health_mod, "DOWN_PROBE_S", 0.05)
    tel, registry = telemetry()
    listening = socket.create_server(("127.0.0.1", 0))
    later_port = free_port()

    async def scenario() -> None:
        h = UpstreamHealth(
            tel,
            {UPSTREAM_HTTP: ("127.0.0.1", listening.getsockname()[1])},
            connect_timeout=1.0,
        )
        h.add(UPSTREAM_GRPC, ("127.0.0.1", later_port))
        h.start()
        try:
            for _ in range(200):
                if h.is_up(UPSTREAM_GRPC) is False and h.is_up(UPSTREAM_HTTP):
                    break
                await asyncio.sleep(0.01)
            assert gauge(registry, UPSTREAM_HTTP) == 1.0 and gauge(registry, UPSTREAM_GRPC) == 0.0
            late = socket.create_server(("127.0.0.1", later_port))
            try:
                for _ in range(300):
                    if h.is_up(UPSTREAM_GRPC):
                        break
                    await asyncio.sleep(0.01)
                assert gauge(registry, UPSTREAM_GRPC) == 1.0
            finally:
                late.close()
        finally:
            h.stop()

    try:
        asyncio.run(scenario())
    finally:
        listening.close()


def test_health_is_the_only_writer_of_upstream_up() -> None:
    writers = sorted(
        p.name
        for p in SIDECAR.rglob("*.py")
        if re.search(r"\.set_upstream_up\(", p.read_text()) and p.name != "telemetry.py"
    )
    assert writers == ["health.py"]


def test_an_upstream_with_a_probe_of_its_own_is_not_probed() -> None:
    """The grpc.aio engine's channel is its upstream's probe: health only records what it says."""
    tel, registry = telemetry()

    async def scenario() -> None:
        h = UpstreamHealth(tel, {}, connect_timeout=0.2)
        h.add(UPSTREAM_GRPC, ("127.0.0.1", free_port()), probe=False)  # nothing listens there
        h.start()
        try:
            await asyncio.sleep(0.3)
            assert h.is_up(UPSTREAM_GRPC) is None and gauge(registry, UPSTREAM_GRPC) is None
            h.report(UPSTREAM_GRPC, True)  # what the channel said
            await asyncio.sleep(0.3)
            assert gauge(registry, UPSTREAM_GRPC) == 1.0
        finally:
            h.stop()

    asyncio.run(scenario())
