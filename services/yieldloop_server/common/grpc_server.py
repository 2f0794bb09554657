"""The gRPC server shell every service runs in: health, reflection, graceful stop, built from a TransportConfig.

The one place servers are built: options, and the transport's interceptors wrapped around every handler
(see :mod:`yieldloop.transport`). Also the servicer decorator that turns :class:`yieldloop.errors.YieldloopError`
(raised by domain code) into a ``google.rpc.Status`` with ``ErrorInfo``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from yieldloop._status import to_rpc_status
from yieldloop.errors import InvalidArgumentError, YieldloopError, as_yieldloop_error
from yieldloop.transport import DEFAULT_TRANSPORT, CallInfo, ServerInterceptor, TransportConfig, intercepting
from yieldloop_server.common import telemetry

log = logging.getLogger(__name__)


def rpc(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a servicer method so yieldloop errors become typed gRPC statuses.

    Unexpected exceptions are logged with their traceback and answered as
    INTERNAL/INTERNAL: the service keeps serving either way.
    """

    async def abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
        error = as_yieldloop_error(exc)
        if error.code == "INTERNAL" and not isinstance(exc, YieldloopError):
            log.exception("unexpected error in %s", fn.__qualname__)
        elif not isinstance(exc, YieldloopError):
            log.warning("%s: %s", fn.__qualname__, error)
        await _abort(context, error)

    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                async for item in fn(self, request, context):
                    yield item
            except Exception as exc:  # servicer boundary: translate, never crash the server
                await abort(context, exc)

        return stream_wrapper

    @functools.wraps(fn)
    async def unary_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(self, request, context)
        except Exception as exc:  # servicer boundary: translate, never crash the server
            await abort(context, exc)

    return unary_wrapper


class Undecodable:
    """A request message that did not parse (handed to the handler wrapper, which refuses the call)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def refusal(self) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"the request message does not parse: {self.error}", reason="INVALID_FIELD", field="request"
        )


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as err:  # answered INVALID_ARGUMENT by the wrapper, not UNKNOWN with a traceback
            return Undecodable(err)

    return parse


async def _checked(requests: Any) -> Any:
    async for request in requests:
        if isinstance(request, Undecodable):
            raise request.refusal()
        yield request


class _Interceptors(grpc.aio.ServerInterceptor):
    """Runs yieldloop :class:`ServerInterceptor` objects around every handler, whatever its kind, and answers
    a request message that does not parse as INVALID_ARGUMENT.

    grpc.aio's own interceptor pattern (wrap response streams in ``async for``) breaks handlers that
    write with ``context.write()`` and return None (StreamEpisode, Health.Watch): here a streaming
    handler is wrapped as what it is, an async generator or a coroutine.
    """

    def __init__(self, interceptors: tuple[ServerInterceptor, ...]) -> None:
        self.interceptors = interceptors

    async def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        call = CallInfo(method=details.method, metadata=tuple(details.invocation_metadata or ()), protocol="grpc")
        for kind, make in _HANDLER_KINDS.items():
            behavior = getattr(handler, kind)
            if behavior is not None:
                return make(
                    self._wrap(behavior, call, streaming_requests=kind.startswith("stream_")),
                    request_deserializer=_lenient(handler.request_deserializer),
                    response_serializer=handler.response_serializer,
                )
        return handler

    def _wrap(self, behavior: Callable[..., Any], call: CallInfo, streaming_requests: bool) -> Callable[..., Any]:
        interceptors = self.interceptors

        def checked(request: Any) -> Any:
            if streaming_requests:
                return _checked(request)
            if isinstance(request, Undecodable):
                raise request.refusal()
            return request

        # A refusal (an interceptor's on entry, an undecodable unary request) answers its typed status.
        if inspect.isasyncgenfunction(behavior):
            # A coroutine writing each response, not a generator yielding them: when the client hangs up while a
            # response is being sent, grpc cancels the call's task but never closes a handler generator suspended
            # at its yield; the event loop's finalizer closes it later, in another task and context, where the
            # interceptors' exits (the auth principal's reset, a span's detach) fail with "created in a different
            # Context" tracebacks. Here the handler is closed in the call's own task, whatever ends it.
            async def stream(request: Any, context: grpc.aio.ServicerContext) -> None:
                try:
                    async with intercepting(interceptors, call):
                        responses = behavior(checked(request), context)
                        try:
                            async for item in responses:
                                await context.write(item)
                        finally:
                            await responses.aclose()
                except YieldloopError as exc:
                    await _abort(context, exc)

            return stream

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                async with intercepting(interceptors, call):
                    return await behavior(checked(request), context)
            except YieldloopError as exc:
                await _abort(context, exc)

        return unary


_HANDLER_KINDS = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


async def _abort(context: grpc.aio.ServicerContext, error: YieldloopError) -> None:
    """Answers the call with ``error``'s status (and marks the call's span failed: grpc's AbortError says
    nothing of the code)."""
    telemetry.record_error(error.code, error.reason, error.message)
    await context.abort_with_status(to_rpc_status(error))


ADVERTISE_VARIABLE = "YIELDLOOP_ADVERTISE_HOST"
"""The name other hosts reach this one by, when its hostname is not it (a StatefulSet pod: ``pod.service``)."""


def advertised(host: str, port: int) -> str:
    """The address other hosts reach a server bound to ``host:port`` at ("" before it is bound)."""
    if not port:
        return ""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = os.environ.get(ADVERTISE_VARIABLE) or socket.gethostname()
    return f"{host}:{port}"


class GrpcServer:
    """A ``grpc.aio`` server with health checking and reflection.

    Args:
        host: Interface to bind (loopback by default).
        port: Port to bind; 0 picks a free one (see :attr:`port` after start).
        transport: Message limits and interceptors (the same config the service's own clients use).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, transport: TransportConfig = DEFAULT_TRANSPORT) -> None:
        self.host = host
        self.port = port
        self.transport = transport
        interceptors = [_Interceptors(transport.server_interceptors)]  # also turns undecodable requests away
        self._server = grpc.aio.server(options=transport.server_options(), interceptors=interceptors)
        self._on_stop: list[Callable[[], Any]] = []
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self._service_names: list[str] = []
        self._serving = True
        """Its own port is served (start); False when it only answers probes (start_probes)."""
        self._probe_server: grpc.aio.Server | None = None
        if transport.health_port:  # the same health statuses, for probes that speak no TLS
            self._probe_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self._health, self._probe_server)

    @property
    def advertised_address(self) -> str:
        """The address other hosts reach this server at ("" before it is bound)."""
        return advertised(self.host, self.port)

    def add(self, add_to_server: Callable[[Any, grpc.aio.Server], None], servicer: Any, name: str) -> None:
        """Registers a servicer under its full service name (for health and reflection)."""
        add_to_server(servicer, self._server)
        self._service_names.append(name)

    async def set_health(self, name: str, serving: bool) -> None:
        """Publishes a health status under ``name`` (a service or a component of one)."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self._health.set(name, status)

    def on_stop(self, callback: Callable[[], Any]) -> None:
        """Registers a coroutine function to await after the server stopped (release what it served)."""
        self._on_stop.append(callback)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> str:
        """Binds, starts and marks every service SERVING; returns ``host:port``."""
        reflection.enable_server_reflection(
            [*self._service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self._server
        )
        credentials = self.transport.server_credentials()
        if credentials is None:
            self.transport.check_plaintext(self.host)
            self.port = self._server.add_insecure_port(f"{self.host}:{self.port}")
        else:
            self.port = self._server.add_secure_port(f"{self.host}:{self.port}", credentials)
        await self._server.start()
        if self._probe_server is not None:
            self._probe_server.add_insecure_port(f"0.0.0.0:{self.transport.health_port}")
            await self._probe_server.start()
        for name in ["", *self._service_names]:
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s on %s", ", ".join(self._service_names), self.address)
        return self.address

    async def start_probes(self) -> None:
        """Serves the health port alone (``transport.health_port``), SERVING: a process that answers no RPC of its
        own but must pass its pod's probes (a trainer rank that follows rank 0)."""
        assert self._probe_server is not None, "start_probes needs transport.health_port"
        self._probe_server.add_insecure_port(f"0.0.0.0:{self.transport.health_port}")
        await self._probe_server.start()
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._serving = False

    async def stop(self, grace: float = 5.0) -> None:
        """Marks NOT_SERVING, lets in-flight calls finish for ``grace`` seconds, then stops."""
        await self._health.enter_graceful_shutdown()
        if not self._serving:
            await self._probe_server.stop(0)
            return
        await self._server.stop(grace)
        if self._probe_server is not None:
            await self._probe_server.stop(0)
        for callback in self._on_stop:
            await callback()

    async def wait(self) -> None:
        await self._server.wait_for_termination()
