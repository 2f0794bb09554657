"""How the Client makes calls: unary and streaming calls with typed errors, and stubs that carry the API key.

The Client (:mod:`yieldloop.client`) speaks domain types; this is the plumbing under it.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc

from yieldloop._status import error_from_rpc
from yieldloop.errors import YieldloopError

_CORE_INTERNAL = "Internal error from Core"  # grpcio's status for a write that failed in core
_SERVER_STATUS_WITHIN_S = 5.0
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


class CallStatus:
    """A streaming call's status as the server sent it, for its typed error.

    grpc/grpc#36066: when the server ends a client-streaming or bidi call while the client is still
    sending (an interceptor refusing it, a validation error), the write that fails sets the call's status
    to INTERNAL "Internal error from Core" and raises it (or a later write raises
    asyncio.InvalidStateError). That status may replace the server's, already received, or be replaced by
    it a moment later. A done callback runs at every status the call is given: this keeps the first that
    is not core's (grpcio keeps the current one in the call's ``_status``; without it, the call's status
    is used as before) and, for a failure that reads as core's, waits a moment for the server's.
    """

    def __init__(self, call: Any) -> None:
        self.call = call
        self._server: Any = None
        """The first status the server sent (grpcio's own status object: its AioRpcError is built only when
        ':meth:`error` asks, not for the calls that end well)."""
        self._arrived = asyncio.Event()
        call.add_done_callback(self._on_status)

    def _on_status(self, call: Any) -> None:
        status = getattr(getattr(call, "_cython_call", None), "_status", None)
        if self._server is not None or status is None or status.details() == _CORE_INTERNAL:
            return
        self._server = status
        self._arrived.set()

    async def error(self, err: grpc.aio.AioRpcError | None = None) -> YieldloopError:
        """The typed error of the failed call, from the server's status where it sent one."""
        call = self.call
        if self._server is None and await call.details() == _CORE_INTERNAL:
            try:
                await asyncio.wait_for(self._arrived.wait(), _SERVER_STATUS_WITHIN_S)
            except TimeoutError:  # no status from the server (the connection broke): core's stands
                pass
        if self._server is not None:
            status = self._server
            err = grpc.aio.AioRpcError(
                _STATUS_CODES.get(status.code(), grpc.StatusCode.UNKNOWN),
                grpc.aio.Metadata(),
                grpc.aio.Metadata(*(status.trailing_metadata() or ())),
                status.details(),
            )
        elif err is None:
            err = grpc.aio.AioRpcError(
                await call.code(), grpc.aio.Metadata(), await call.trailing_metadata(), await call.details()
            )
        return error_from_rpc(err)


async def unary(method: Any, request: Any, timeout: float | None = None) -> Any:
    """Calls a unary-response RPC (``request`` may be an iterator for client streams).

    An exception raised while producing a client stream's messages is raised as itself: grpc would cancel
    the call and report only CANCELLED.
    """
    failure: list[Exception] = []
    streaming = hasattr(request, "__iter__")  # a client stream (protobuf messages are not iterable)
    if streaming:
        request = _recording(request, failure)
    call = method(request, timeout=timeout)
    status = CallStatus(call) if streaming else None
    try:
        return await call
    except asyncio.CancelledError:
        if failure:
            raise failure[0] from None
        raise
    except grpc.aio.AioRpcError as err:
        if failure:
            raise failure[0] from None
        raise (await status.error(err) if status else error_from_rpc(err)) from None


def _recording(requests: Iterable[Any], failure: list[Exception]) -> Iterable[Any]:
    try:
        yield from requests
    except Exception as exc:  # kept for _unary, which raises it instead of grpc's CANCELLED
        failure.append(exc)
        raise


async def stream(call: Any) -> AsyncIterator[Any]:
    try:
        async for item in call:
            yield item
    except grpc.aio.AioRpcError as err:
        raise error_from_rpc(err) from None  # a unary request: sent whole, before any status (no #36066)
    finally:
        call.cancel()


class Keyed:
    """A stub whose methods add call metadata (the API key) to every call."""

    def __init__(self, stub: Any, metadata: tuple[tuple[str, str], ...]) -> None:
        self._stub, self._metadata = stub, metadata

    def __getattr__(self, name: str) -> Any:
        return functools.partial(getattr(self._stub, name), metadata=self._metadata)
