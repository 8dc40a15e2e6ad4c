"""The gRPC proxy as an HTTP/2 frame relay: the lean engine of the sidecar's gRPC side.

``GrpcRelay`` listens, holds what all connections share (admission, upstream health, the
refused calls awaiting their retry) and drains on stop. What happens on each
connection (frames, header blocks, counting) is ``sidecar.protocols.grpc_relay_conn``; user
documentation is ``sidecar/GRPC.md``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any

from sidecar.config import SidecarConfig
from sidecar.core.admission import Admission
from sidecar.core.health import UpstreamHealth
from sidecar.core.telemetry import GRPC_CODES, UPSTREAM_GRPC
from sidecar.protocols.grpc_calls import RefusedCalls
from sidecar.protocols.grpc_methods import upstream_target
from sidecar.protocols.grpc_relay_conn import ClientSide

log = logging.getLogger("inferwatch.sidecar.grpc")

# Seconds the observation of a call refused by the upstream (REFUSED_STREAM) waits for the
# client's retry (a retry policy's first backoff is typically well under it); then it is
# counted UNAVAILABLE.
RETRY_WAIT_S = 2.0


class GrpcRelay:
    """Listens for gRPC clients and relays each connection to the upstream (see module docstring)."""

    def __init__(
        self,
        config: SidecarConfig,
        telemetry: Any,
        *,
        admission: Admission | None = None,
        streams: Any = None,
        health: UpstreamHealth | None = None,
    ) -> None:
        # Every setting comes from the sidecar's configuration, the one home of their defaults.
        self.upstream = config.upstream_grpc
        self.telemetry = telemetry
        self.timeout = config.request_timeout
        self.max_message = config.max_body_bytes
        # Shared with the other proxies (sidecar.main): the limit is the process's total.
        self.admission = admission if admission is not None else Admission(config.max_in_flight)
        self.connect_timeout = config.connect_timeout
        # The LLM telemetry (sidecar.core.streams): ModelStreamInfer's token timing; None: not recorded.
        self.streams = streams
        self.conns: set[Any] = set()  # grpc_relay_conn._Conn
        self.retries = RefusedCalls(RETRY_WAIT_S)  # calls the upstream refused, awaiting their retry
        self._outcomes = {name: telemetry.outcome_for_grpc(name) for name in GRPC_CODES}
        self._server: asyncio.AbstractServer | None = None
        # The one writer of upstream_up, shared (sidecar.main runs its probe), or this relay's own.
        self._own_health = health is None
        self.health = health or UpstreamHealth(telemetry, {}, config.connect_timeout)
        self.health.add(UPSTREAM_GRPC, self.upstream)
        self.port = 0

    def outcome(self, code: str) -> str:
        return self._outcomes.get(code) or self.telemetry.outcome_for_grpc(code)

    @staticmethod
    def nodelay(sock: Any) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass

    # ---------------------------------------------------------------- lifecycle
    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: ClientSide(self), host, port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        if self._own_health:
            self.health.start()
        log.info(
            "grpc relay listening",
            extra={
                "fields": {"grpc": f"{host}:{self.port}", "upstream_grpc": upstream_target(self.upstream)}
            },
        )
        return self.port

    async def stop(self, grace: float | None = 5.0) -> None:
        """Stop accepting, send GOAWAY, let calls in flight finish for up to ``grace`` seconds."""
        if self._server is not None:
            self._server.close()
        deadline = time.monotonic() + (grace or 0)
        for conn in list(self.conns):
            conn.goaway(final=False)
        # One round trip for calls already on their way, then the real last stream.
        await asyncio.sleep(min(0.2, grace or 0))
        for conn in list(self.conns):
            conn.goaway(final=True)
        while any(c.streams for c in self.conns) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(self.conns):
            conn.client.close()
            if conn.up is not None:
                conn.closing = True
                conn.up.close()
        self.retries.expire_all()  # refused and not retried before the end: counted as the client saw it
        if self._own_health:
            self.health.stop()

    def upstream_state(self, up: bool, exc: BaseException | None) -> None:
        """What a connection saw of the upstream (sidecar.core.health writes the gauge on change)."""
        self.health.report(UPSTREAM_GRPC, up, str(exc) if exc else "")
