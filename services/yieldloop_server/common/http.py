"""The services' HTTP servers (aiohttp, in the service's event loop): one way to bind, secure, authenticate and
answer errors, shared by RolloutService's OpenAI-compatible endpoint and the HUD front.

Errors use OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``; FastAPI's ``"detail"`` string too)
with the HTTP status of the error's gRPC code (:attr:`yieldloop.errors.YieldloopError.http_status`: 400 bad request,
401, 403, 404, 409, 429, 503, ...). The transport's interceptors (auth, tracing) run around every request, as they
do around every gRPC call; the method they see is the route's pattern (``POST
/v1/models/{model}/train/optim-step``), so one table of roles (:data:`yieldloop_server.common.auth.METHOD_ROLES`)
covers gRPC and HTTP.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from yieldloop.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    RequestTooLargeError,
    YieldloopError,
    invalid_field,
    parse_json,
)
from yieldloop.transport import DEFAULT_TRANSPORT, CallInfo, TransportConfig, intercepting

log = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def error_response(err: YieldloopError, status: int = 0) -> Any:
    """The OpenAI-shaped answer for a typed error (its HTTP status unless ``status``, reason as ``code``)."""
    from aiohttp import web

    status = status or err.http_status
    kind = _ERROR_TYPES.get(status, "server_error")
    body = {"error": {"message": err.message, "type": kind, "param": err.field or None, "code": err.reason.lower()}}
    # FastAPI's "detail" too (the HUD SDK shows it as the error's one line): the reason and the message.
    body["detail"] = f"{err.reason}: {err.message}" + (f" (field {err.field})" if err.field else "")
    return web.json_response(body, status=status)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict_json(text: str) -> Any:
    """JSON without NaN/Infinity literals (Python's json accepts them; no OpenAI client sends them), nested at most
    :data:`~yieldloop.errors.MAX_JSON_DEPTH` deep."""
    return parse_json(text, "body", "INVALID_JSON", parse_constant=_reject_constant)


class BodyTimeout(Exception):
    """The request body did not arrive in time (answered 408, and the connection closed)."""


async def read_json(request: Any, timeout_s: float) -> Any:
    """The request's JSON body: INVALID_ARGUMENT (INVALID_JSON) when it is not JSON, RESOURCE_EXHAUSTED
    (REQUEST_TOO_LARGE, HTTP 413, naming the limit) past the transport's message limit; :class:`BodyTimeout` when it
    does not arrive within ``timeout_s``."""
    from aiohttp import web

    try:
        async with asyncio.timeout(timeout_s):
            return await request.json(loads=strict_json)
    except web.HTTPRequestEntityTooLarge as err:
        raise RequestTooLargeError(
            f"the request body is larger than this server accepts ({err.text})",
            reason="REQUEST_TOO_LARGE",
            field="body",
        ) from None
    except TimeoutError:
        raise BodyTimeout(f"the request body did not arrive within {timeout_s:g} s") from None
    except InvalidArgumentError:
        raise
    except (ValueError, UnicodeDecodeError):
        raise InvalidArgumentError("the request body is not JSON", reason="INVALID_JSON") from None


def timeout_response(err: BodyTimeout) -> Any:
    response = error_response(DeadlineExceededError(str(err), reason="REQUEST_TIMEOUT"), 408)
    response.force_close()  # the connection closes after this answer: the rest of the body is not awaited
    return response


def json_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid_field("body", "the request body must be a JSON object")
    return body


class HttpServer:
    """One aiohttp server of a service: TLS from the transport (plaintext only on loopback unless allowed), the
    transport's interceptors around each request, typed refusals. Subclasses list their routes."""

    path_prefix = ""
    """Appended to ``http(s)://host:port`` in :attr:`base_url`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, transport: TransportConfig = DEFAULT_TRANSPORT) -> None:
        self.host, self.port, self.transport = host, port, transport
        self._runner: Any = None
        self.base_url = ""

    def routes(self) -> list[Any]:
        raise NotImplementedError

    async def start(self) -> str:
        """Binds and serves; returns :attr:`base_url`."""
        from aiohttp import web

        middlewares = []
        if self.transport.server_interceptors:  # aiohttp takes a decorated function, not a bound method
            middlewares.append(web.middleware(functools.partial(HttpServer._intercept, self)))
        app = web.Application(client_max_size=self.transport.max_message_bytes, middlewares=middlewares)
        app.add_routes(self.routes())
        # aiohttp closes a connection idle for keepalive_timeout, counting from its start and from each answer;
        # a header still incomplete counts as idle, so this is also the header timeout.
        self._runner = web.AppRunner(app, access_log=None, keepalive_timeout=self.transport.http_idle_timeout_s)
        await self._runner.setup()
        ssl_context = None
        if self.transport.tls_cert:
            import ssl

            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_context.load_cert_chain(self.transport.tls_cert, self.transport.tls_key)
        else:
            self.transport.check_plaintext(self.host)
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=ssl_context)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.base_url = f"{'https' if ssl_context else 'http'}://{self.host}:{self.port}{self.path_prefix}"
        log.info("%s on %s", type(self).__name__, self.base_url)
        return self.base_url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _intercept(self, request: Any, handler: Any) -> Any:
        """aiohttp middleware: the transport's interceptors around each request, refusals answered typed."""
        resource = request.match_info.route.resource
        path = resource.canonical if resource is not None else request.path
        call = CallInfo(
            method=f"{request.method} {path}",
            metadata=tuple((k.lower(), v) for k, v in request.headers.items()),
            protocol="http",
        )
        try:
            async with intercepting(self.transport.server_interceptors, call):
                return await handler(request)
        except YieldloopError as err:
            return error_response(err)
