"""The gRPC server shell every service runs in: health, reflection, graceful stop.

Also the servicer decorator that turns :class:`yieldloop.errors.YieldloopError`
(raised by domain code) into a ``google.rpc.Status`` with ``ErrorInfo``.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from yieldloop._status import to_rpc_status
from yieldloop.client import MAX_MESSAGE_BYTES
from yieldloop.errors import InternalError, YieldloopError

log = logging.getLogger(__name__)


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Server options for thousands of concurrent streams.

    - gRPC core rejects new streams once 1000 calls wait for the application (hard limit 3000):
      2048 episodes opened at once would fail with INTERNAL/CANCELLED on the clients;
    - clients send keepalive pings every 30 s (``channel_options``); the default server answers
      them with GOAWAY ``too_many_pings`` on long runs.
    """
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.server.max_pending_requests", 1 << 16),
        ("grpc.server.max_pending_requests_hard_limit", 1 << 17),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def rpc(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a servicer method so yieldloop errors become typed gRPC statuses.

    Unexpected exceptions are logged with their traceback and answered as
    INTERNAL/INTERNAL: the service keeps serving either way.
    """

    async def abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
        if not isinstance(exc, YieldloopError):
            log.exception("unexpected error in %s", fn.__qualname__)
            exc = InternalError(f"{type(exc).__name__}: {exc}")
        await context.abort_with_status(to_rpc_status(exc))

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


class GrpcServer:
    """A ``grpc.aio`` server with health checking and reflection.

    Args:
        host: Interface to bind (loopback by default).
        port: Port to bind; 0 picks a free one (see :attr:`port` after start).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, max_message_bytes: int | None = None) -> None:
        self.host = host
        self.port = port
        self._server = grpc.aio.server(options=server_options(max_message_bytes or MAX_MESSAGE_BYTES))
        self._on_stop: list[Callable[[], Any]] = []
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self._service_names: list[str] = []

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
        self.port = self._server.add_insecure_port(f"{self.host}:{self.port}")
        await self._server.start()
        for name in ["", *self._service_names]:
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s on %s", ", ".join(self._service_names), self.address)
        return self.address

    async def stop(self, grace: float = 5.0) -> None:
        """Marks NOT_SERVING, lets in-flight calls finish for ``grace`` seconds, then stops."""
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace)
        for callback in self._on_stop:
            await callback()

    async def wait(self) -> None:
        await self._server.wait_for_termination()
