"""The gRPC half of the sidecar: ``serve()``, the method table, and the grpc.aio engine.

``serve()`` starts the HTTP/2 frame relay (``sidecar.protocols.grpc_relay``, the default engine) or this
module's grpc.aio proxy (``config.grpc_engine == "aio"``); both follow the contract below. In
the grpc.aio engine, every method is forwarded as raw bytes (generic handlers with no
(de)serializers), so tensors are never decoded or copied into Python objects. The only
parsing is the request's model name and version (see ``grpc_wire``). Status codes, details,
trailing metadata and the client's metadata (``traceparent`` included) pass through; the
client's deadline is propagated and capped by the per-request timeout; a client that cancels
cancels the upstream call.

Counting (one observation per request, each closed by exactly one ``Telemetry.end``):
- unary methods: one observation per call, its code the call's status code;
- ``ModelStreamInfer``: one observation per request *message*, closed by the response (or the
  in-stream error) for that message, matched by the request ``id`` (first in, first out among
  equal ids, so a stream whose requests carry no id is matched in order). Messages still open
  when the stream ends are closed with the stream's final status;
- ``grpc.health.v1.Health/Check`` is proxied like a server-level method (no model); any other
  method is forwarded as a bidirectional stream (which carries every call shape) and counted
  once per call with no model. One gRPC quirk applies there: when the upstream ends such a call
  before it has read the request (an unknown method's UNIMPLEMENTED), grpc's client may report
  INTERNAL "Internal error from Core" in place of the upstream's code.

A call ``sidecar.core.admission`` refuses (past ``--max-in-flight`` requests in flight across the
sidecar's protocols, or a per-model limit; a stream counts once, admitted on its first message
under the model it names) gets one fixed, counted answer: RESOURCE_EXHAUSTED. A model with a
``tokens`` bucket charges a ``ModelInfer`` call, and a stream's first message, what
``sidecar.protocols.grpc_charge`` reads from that message.
User documentation: ``sidecar/GRPC.md``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import grpc.aio

from inferwatch.contract import MODEL_NONE, PROTOCOL_GRPC
from sidecar.apis.charge import prompt_estimate
from sidecar.config import GRPC_ENGINES, SidecarConfig
from sidecar.core.admission import Admission
from sidecar.core.health import UpstreamHealth
from sidecar.core.telemetry import UPSTREAM_GRPC
from sidecar.protocols.grpc_charge import request_tokens
from sidecar.protocols.grpc_methods import (
    EXTRA_UNARY_PATHS,
    INFER_PATH,
    STREAM_FIELDS,
    STREAM_PATH,
    UNARY_PATHS,
    span_attributes,
    stream_error_code,
    upstream_target,
)
from sidecar.protocols.grpc_streams import StreamMatcher
from sidecar.protocols.grpc_tokens import StreamTokens
from sidecar.protocols.grpc_wire import WireError, read_strings, stream_response_info

log = logging.getLogger("inferwatch.sidecar.grpc")

# Metadata that must not be copied onto the upstream call: gRPC sets these itself.
_DROP_METADATA = frozenset({"user-agent", "te", "content-type", "grpc-timeout", "grpc-encoding"})
_TRACEPARENT = "traceparent"

_OK = grpc.StatusCode.OK
_CANCELLED = grpc.StatusCode.CANCELLED
_DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED
_INTERNAL = grpc.StatusCode.INTERNAL
_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def forwarded_metadata(metadata: Any) -> tuple[tuple[str, str | bytes], ...]:
    """The client's metadata minus what gRPC manages itself (pseudo and transport headers)."""
    return tuple((k, v) for k, v in (metadata or ()) if k not in _DROP_METADATA and not k.startswith(":"))


Metadata = tuple[tuple[str, str | bytes], ...]


def traceparent_of(metadata: Metadata) -> str | None:
    for k, v in metadata:
        if k == _TRACEPARENT:
            return v if isinstance(v, str) else None
    return None


def with_traceparent(metadata: Metadata, traceparent: str | None) -> Metadata:
    """The metadata to send upstream: the sidecar's span context replaces the client's when
    tracing is on (``traceparent`` set), else the client's metadata goes unchanged."""
    if traceparent is None:
        return metadata
    return (*(kv for kv in metadata if kv[0] != _TRACEPARENT), (_TRACEPARENT, traceparent))


class GrpcProxy:
    """The proxy server and its one upstream channel.

    ``telemetry`` is the sidecar's per-request observation API (``sidecar.core.telemetry.Telemetry``).
    """

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
        self.upstream = upstream_target(config.upstream_grpc)
        self._telemetry = telemetry
        self._timeout = config.request_timeout
        # Calls past its limit get the one fixed overload answer (RESOURCE_EXHAUSTED); shared
        # with the other proxies (sidecar.main), so the limit is the process's total.
        self.admission = admission if admission is not None else Admission(config.max_in_flight)
        # The LLM telemetry (sidecar.core.streams): ModelStreamInfer's token timing; None: not recorded.
        self.streams = streams
        # The one writer of upstream_up, shared (sidecar.main runs its probe), or this proxy's own.
        self._own_health = health is None
        self.health = health or UpstreamHealth(telemetry, {}, config.connect_timeout)
        # The channel is this upstream's probe (it reconnects by itself): none from health.
        self.health.add(UPSTREAM_GRPC, config.upstream_grpc, probe=False)
        max_message_bytes, connect_timeout_s = config.max_body_bytes, config.connect_timeout
        size_options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        self._server_options = [*size_options, ("grpc.so_reuseport", 0)]
        # A short, capped reconnect backoff: gRPC's default grows to 120 s, which would keep
        # answering UNAVAILABLE for minutes after the upstream came back. No retries: a proxy
        # must not send a request twice; the client decides.
        self._channel_options = [
            *size_options,
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", max(100, int(connect_timeout_s * 1000))),
            ("grpc.enable_retries", 0),
        ]
        self._channel: grpc.aio.Channel | None = None
        self._server: grpc.aio.Server | None = None
        self._watcher: asyncio.Task | None = None
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}
        # Code name and outcome per status code, resolved once.
        self._codes: dict[grpc.StatusCode, tuple[str, str]] = {
            c: (c.name, telemetry.outcome_for_grpc(c.name)) for c in grpc.StatusCode
        }
        self.port = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0 picks a free port); return the bound port."""
        self._channel = grpc.aio.insecure_channel(self.upstream, options=self._channel_options)
        self._build_handlers(self._channel)
        self._server = grpc.aio.server(options=self._server_options)
        self._server.add_generic_rpc_handlers((_Router(self._handlers, self._passthrough),))
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = self._server.add_insecure_port(address)
        except RuntimeError as exc:  # grpc reports a busy port this way
            raise OSError(f"cannot listen for gRPC on {address}: {exc}") from None
        await self._server.start()
        self._watcher = asyncio.create_task(self._watch_upstream(), name="grpc-upstream-watch")
        if self._own_health:
            self.health.start()
        log.info(
            "grpc proxy listening",
            extra={"fields": {"grpc": f"{host}:{self.port}", "upstream_grpc": self.upstream}},
        )
        return self.port

    async def stop(self, grace: float | None = 5.0) -> None:
        """Stop accepting, let calls in flight finish for up to ``grace`` seconds, close upstream."""
        if self._server is not None:
            await self._server.stop(grace)
        if self._watcher is not None:
            self._watcher.cancel()
        if self._own_health:
            self.health.stop()
        if self._channel is not None:
            await self._channel.close()

    async def _watch_upstream(self) -> None:
        """Follow the channel's connectivity (READY: up, TRANSIENT_FAILURE: down) and tell
        ``sidecar.core.health``, which writes the gauge. Asking for the state with ``try_to_connect``
        keeps the channel reconnecting, so calls flow as soon as the upstream returns.
        """
        assert self._channel is not None
        ready, failed = grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE
        state = self._channel.get_state(try_to_connect=True)
        while True:
            if state is ready or state is failed:
                self.health.report(UPSTREAM_GRPC, state is ready, "channel in TRANSIENT_FAILURE")
            await self._channel.wait_for_state_change(state)
            state = self._channel.get_state(try_to_connect=True)

    # ------------------------------------------------------------------ handlers
    def _build_handlers(self, channel: grpc.aio.Channel) -> None:
        for path, (name_field, version_field) in UNARY_PATHS.items():
            upstream = channel.unary_unary(path)  # no serializers: bytes in, bytes out
            self._handlers[path] = grpc.unary_unary_rpc_method_handler(
                self._limited(
                    self._unary(upstream, path, name_field, version_field), path, name_field, version_field
                )
            )
        for path in EXTRA_UNARY_PATHS:
            self._handlers[path] = grpc.unary_unary_rpc_method_handler(
                self._limited(self._unary(channel.unary_unary(path), path, 0, 0), path)
            )
        path = STREAM_PATH
        self._handlers[path] = grpc.stream_stream_rpc_method_handler(
            self._limited_stream(self._stream_infer(channel.stream_stream(path), path), path)
        )

    def _passthrough(self, path: str) -> grpc.RpcMethodHandler:
        """Any other method: forwarded as a stream (which carries unary calls too), no model."""
        assert self._channel is not None
        return grpc.stream_stream_rpc_method_handler(
            self._limited(self._raw_stream(self._channel.stream_stream(path), path), path)
        )

    def _limited(self, handler: Callable, path: str, name_field: int = 0, version_field: int = 0) -> Callable:
        """``handler`` behind admission: a refused call gets the fixed overload answer, counted."""
        admission, telemetry = self.admission, self._telemetry
        # A unary call names its model in its one message: per-model limits (sidecar.core.admission)
        # apply to it, and may be turned on by a SIGHUP, so such calls always pass here.
        if not admission.limit and not name_field:
            return handler
        name, outcome = self._codes[_EXHAUSTED]
        span_name, attributes = span_attributes(path)
        charged = path == INFER_PATH  # a ModelInferRequest: what a tokens bucket charges

        async def limited(request: Any, context: grpc.aio.ServicerContext) -> Any:
            model, version = MODEL_NONE, ""  # no model named (yet), no version
            tokens = 0
            if name_field and admission.per_model and isinstance(request, bytes):
                # Partial: a message damaged after its name is limited (and charged) under
                # that model, as the relay, which reads only a message's head, does.
                model, version, _ = read_strings(request, name_field, version_field, partial=True)
                if charged and model and admission.charges_tokens(model):
                    tokens = request_tokens(request)
            refusal = await admission.admit(model, tokens) if model else admission.acquire(MODEL_NONE)
            if refusal is not None:
                if not model and name_field and isinstance(request, bytes):
                    try:
                        model, version, _ = read_strings(request, name_field, version_field)
                    except WireError:
                        pass
                tel = telemetry.begin(model, version, PROTOCOL_GRPC, None, span_name, attributes)
                telemetry.end(tel, name, outcome, len(request) if isinstance(request, bytes) else 0, 0)
                await context.abort(_EXHAUSTED, refusal.message)
            admitted = asyncio.get_running_loop().time()  # after any queue wait: what a limit steers by
            try:
                return await handler(request, context)
            finally:
                admission.release(model, asyncio.get_running_loop().time() - admitted)

        return limited

    def _limited_stream(self, handler: Callable, path: str) -> Callable:
        """``ModelStreamInfer`` behind admission. A stream counts once; with per-model limits it
        is admitted on its first message, under the model that message names (a refusal is
        counted as that message, RESOURCE_EXHAUSTED), else on arrival under the global limit."""
        admission, telemetry = self.admission, self._telemetry
        name, outcome = self._codes[_EXHAUSTED]
        span_name, attributes = span_attributes(path)

        async def limited(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
            # The call's token counts: the handler records them, a charge is refunded by them.
            tokens_seen = StreamTokens(self.streams) if self.streams is not None else None
            # Checked per stream: a SIGHUP may turn per-model limits on or off.
            if not admission.per_model and not admission.limit:
                return await handler(requests, context, tokens_seen)
            model, version = MODEL_NONE, ""
            first: bytes | None = None
            tokens = 0
            if admission.per_model:
                messages = requests.__aiter__()
                try:
                    first = await messages.__anext__()
                    model, version, _ = read_strings(first, *STREAM_FIELDS[:2], partial=True)
                except StopAsyncIteration:
                    pass  # no message: the global limit only
                requests = _prepended(first, messages)
                # The first message pays for the stream; later ones are not charged
                # (sidecar/README.md, "Overload protection").
                if first is not None and model and admission.charges_tokens(model):
                    tokens = request_tokens(first)
            refusal = await admission.admit(model, tokens) if model else admission.acquire(MODEL_NONE)
            if refusal is not None:
                tel = telemetry.begin(model, version, PROTOCOL_GRPC, None, span_name, attributes)
                telemetry.end(tel, name, outcome, len(first or b""), 0)
                await context.abort(_EXHAUSTED, refusal.message)
            try:
                return await handler(requests, context, tokens_seen)
            finally:
                if tokens and tokens_seen is not None:
                    # What it did not use back: as the relay (grpc_relay_conn, ``_release``).
                    spent = prompt_estimate(len(first or b"")) + tokens_seen.generated
                    admission.refund(model, tokens, spent)
                admission.release(model)

        return limited

    def _timeout_for(self, context: grpc.aio.ServicerContext) -> float:
        """The client's deadline, capped by the per-request timeout."""
        remaining = context.time_remaining()
        if remaining is not None and remaining < self._timeout:
            return max(remaining, 0.0)
        return self._timeout

    @staticmethod
    def _client_gone_code(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
        """Why our handler was cancelled: the client's deadline passed, or it cancelled."""
        remaining = context.time_remaining()
        return _DEADLINE if remaining is not None and remaining <= 0 else _CANCELLED

    def _unary(
        self, upstream: grpc.aio.UnaryUnaryMultiCallable, path: str, name_field: int, version_field: int
    ):
        telemetry, codes = self._telemetry, self._codes
        ok_name, ok_outcome = codes[_OK]
        span_name, attributes = span_attributes(path)

        async def handler(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            model, version = MODEL_NONE, ""
            if name_field:
                try:
                    model, version, _ = read_strings(request, name_field, version_field)
                except WireError:
                    pass  # forwarded as is: the upstream answers with its own parse error
            metadata = forwarded_metadata(context.invocation_metadata())
            tel = telemetry.begin(
                model, version, PROTOCOL_GRPC, traceparent_of(metadata), span_name, attributes
            )
            call = upstream(
                request,
                timeout=self._timeout_for(context),
                metadata=with_traceparent(metadata, tel.traceparent),
            )
            try:
                response = await call
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                name, outcome = codes[code]
                telemetry.end(tel, name, outcome, len(request), 0)
                await context.abort(code, exc.details() or "", exc.trailing_metadata() or ())
            except asyncio.CancelledError:
                call.cancel()
                name, outcome = codes[self._client_gone_code(context)]
                telemetry.end(tel, name, outcome, len(request), 0)
                raise
            except Exception:
                # The one error boundary: a sidecar fault is the server's, never a hang.
                name, outcome = codes[_INTERNAL]
                telemetry.end(tel, name, outcome, len(request), 0)
                log.exception("grpc proxy failure", extra={"fields": {"method": path}})
                await context.abort(_INTERNAL, "inferwatch sidecar: proxy failure")
            telemetry.end(tel, ok_name, ok_outcome, len(request), len(response))
            await _forward_initial_metadata(call, context)
            await _relay_status(call, context, _OK)
            return response

        return handler

    def _stream_infer(self, upstream: grpc.aio.StreamStreamMultiCallable, path: str):
        telemetry, codes = self._telemetry, self._codes
        ok_name, ok_outcome = codes[_OK]
        span_name, attributes = span_attributes(path)

        async def handler(
            requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext, tokens: StreamTokens | None
        ) -> None:
            # One upstream stream for the client's stream; its metadata (traceparent included)
            # is the client's, since it is sent before any message exists. ``tokens``: the
            # call's token timing (None: not recorded), from ``_limited_stream``.
            metadata = forwarded_metadata(context.invocation_metadata())
            traceparent = traceparent_of(metadata)
            call = upstream(timeout=self._timeout_for(context), metadata=metadata)
            streams = StreamMatcher()  # requests awaiting their response

            async def pump() -> None:
                async for msg in requests:
                    try:
                        model, version, rid = read_strings(msg, *STREAM_FIELDS)
                    except WireError:
                        model = version = rid = ""
                    streams.add(
                        rid,
                        telemetry.begin(model, version, PROTOCOL_GRPC, traceparent, span_name, attributes),
                        len(msg),
                    )
                    if call.done():
                        break
                    await call.write(msg)
                await call.done_writing()

            def close_all(code: grpc.StatusCode) -> None:
                name, outcome = codes[code]
                for tel, size in streams.drain():
                    if tokens is not None:
                        tokens.closed(tel, code is not _OK)
                    telemetry.end(tel, name, outcome, size, 0)

            pumper = asyncio.create_task(pump())
            first = True
            try:
                async for resp in call:
                    if first:
                        first = False
                        await _forward_initial_metadata(call, context)
                    try:
                        error, _model, rid, final = stream_response_info(resp)
                    except WireError:
                        error, rid, final = "", "", None
                    if tokens is not None:
                        tokens.response(streams, resp, rid, error)
                    entry = streams.take(rid, bool(error), final)
                    if entry is not None:
                        tel, size = entry
                        if tokens is not None:
                            tokens.closed(tel)
                        if error:
                            name = stream_error_code(error)
                            telemetry.end(tel, name, telemetry.outcome_for_grpc(name), size, len(resp))
                        else:
                            telemetry.end(tel, ok_name, ok_outcome, size, len(resp))
                    await context.write(resp)
                code = await call.code()
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
            except asyncio.CancelledError:
                call.cancel()
                pumper.cancel()
                close_all(self._client_gone_code(context))
                raise
            if pumper.done() and not pumper.cancelled() and pumper.exception() is not None and code is _OK:
                code = _INTERNAL
            _let_finish(pumper)
            close_all(code)
            await _relay_status(call, context, code)

        return handler

    def _raw_stream(self, upstream: grpc.aio.StreamStreamMultiCallable, path: str):
        telemetry, codes = self._telemetry, self._codes
        span_name, attributes = span_attributes(path)

        async def handler(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
            metadata = forwarded_metadata(context.invocation_metadata())
            tel = telemetry.begin(
                MODEL_NONE, "", PROTOCOL_GRPC, traceparent_of(metadata), span_name, attributes
            )
            call = upstream(
                timeout=self._timeout_for(context), metadata=with_traceparent(metadata, tel.traceparent)
            )
            sent = received = 0

            async def pump() -> None:
                nonlocal sent
                async for msg in requests:
                    sent += len(msg)
                    if call.done():
                        break
                    await call.write(msg)
                await call.done_writing()

            pumper = asyncio.create_task(pump())
            first = True
            try:
                async for resp in call:
                    if first:
                        first = False
                        await _forward_initial_metadata(call, context)
                    received += len(resp)
                    await context.write(resp)
                code = await call.code()
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
            except asyncio.CancelledError:
                call.cancel()
                pumper.cancel()
                name, outcome = codes[self._client_gone_code(context)]
                telemetry.end(tel, name, outcome, sent, received)
                raise
            _let_finish(pumper)
            name, outcome = codes[code]
            telemetry.end(tel, name, outcome, sent, received)
            await _relay_status(call, context, code)

        return handler


async def _forward_initial_metadata(call: Any, context: grpc.aio.ServicerContext) -> None:
    """The upstream's response headers, sent to the client before the first response."""
    initial = await call.initial_metadata()
    if initial:
        await context.send_initial_metadata(tuple(initial))


async def _relay_status(call: Any, context: grpc.aio.ServicerContext, code: grpc.StatusCode) -> None:
    """The upstream's ending, passed to the client: its code and details when not OK, its trailers."""
    if code is not _OK:
        context.set_code(code)
        context.set_details(await call.details() or "")
    trailing = await call.trailing_metadata()
    if trailing:
        context.set_trailing_metadata(tuple(trailing))


async def _prepended(first: bytes | None, messages: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The client's messages, the one already read for admission first."""
    if first is not None:
        yield first
    async for msg in messages:
        yield msg


def _let_finish(pump: asyncio.Task) -> None:
    """Leave a request pump to end by itself once the upstream has answered.

    Cancelling it while it waits on the client's next message can race the server call's own
    completion (the client then sees INTERNAL instead of the upstream's status); once the call
    ends, the pending read ends too. Its exception, if any, only repeats the call's status.
    """
    if pump.done():
        if not pump.cancelled():
            pump.exception()
    else:
        pump.add_done_callback(lambda t: t.cancelled() or t.exception())


class _Router(grpc.GenericRpcHandler):
    """Looks the method up in the prebuilt table; anything else becomes a passthrough stream."""

    def __init__(
        self, handlers: dict[str, grpc.RpcMethodHandler], fallback: Callable[[str], grpc.RpcMethodHandler]
    ) -> None:
        self._handlers = handlers
        self._fallback = fallback

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        handler = self._handlers.get(method)
        return handler if handler is not None else self._fallback(method)


ENGINES = GRPC_ENGINES  # named in the configuration, the one list


async def serve(
    config: SidecarConfig,
    telemetry: Any,
    admission: Admission | None = None,
    streams: Any = None,
    health: UpstreamHealth | None = None,
) -> Any:
    """Start the gRPC proxy as ``sidecar.main`` configures it; the caller awaits ``stop(grace)``.

    Engine: ``config.grpc_engine``: ``relay`` (the HTTP/2 frame relay of
    ``sidecar.protocols.grpc_relay``, several times cheaper) or ``aio``, this module's grpc.aio
    proxy. Both take every setting from ``config``. Message-size limit: ``max_body_bytes``;
    concurrent calls: ``admission`` (shared with the HTTP proxy; without one, ``max_in_flight``
    for this side alone), beyond it
    the counted RESOURCE_EXHAUSTED answer; ``streams``: the LLM telemetry (``sidecar.core.streams``) that
    ``ModelStreamInfer``'s token timing goes to (None: not recorded); per-request timeout:
    ``request_timeout``; the upstream is retried within ``connect_timeout`` of coming back;
    ``health``: the sidecar's ``UpstreamHealth`` (its probe run by the caller), else the proxy's own.
    """
    engine = config.grpc_engine
    if engine not in ENGINES:
        raise ValueError(f"grpc engine {engine!r} is not one of {', '.join(ENGINES)}")
    if engine == "relay":
        from sidecar.protocols.grpc_relay import GrpcRelay

        proxy: Any = GrpcRelay(config, telemetry, admission=admission, streams=streams, health=health)
    else:
        proxy = GrpcProxy(config, telemetry, admission=admission, streams=streams, health=health)
    await proxy.start(config.host, config.grpc_port)
    return proxy
