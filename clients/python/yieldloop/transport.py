"""The one transport seam: every gRPC channel and server, and the HTTP endpoint, are built from a TransportConfig.

- Clients (the client library, service-to-service clients, the load tests) get channels from
  :func:`open_channel`.
- Servers are built by ``yieldloop_server.common.grpc_server.GrpcServer`` from the same config, and the
  RolloutService's HTTP endpoint runs the same :class:`ServerInterceptor` objects as middleware.

So authentication, TLS and tracing are each one addition here: a field of :class:`TransportConfig` and
the code that reads it. A :class:`ServerInterceptor` sees every call of every kind (unary, server
streaming, client streaming, bidi, including handlers written with ``context.read()/write()`` such as
StreamEpisode and Health.Watch) and every HTTP request, through one small protocol::

    class CountCalls:
        def __init__(self): self.methods = []

        @contextlib.asynccontextmanager
        async def intercept(self, call: CallInfo):
            self.methods.append(call.method)  # raise a YieldloopError here to refuse the call
            yield

    TransportConfig(server_interceptors=(CountCalls(),))

Imports grpc only: the client distribution owns this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class CallInfo:
    """What an interceptor knows of one incoming call."""

    method: str
    """gRPC: the full method (``/yieldloop.env.v1.EnvService/StreamEpisode``); HTTP: ``POST /v1/completions``."""
    metadata: tuple[tuple[str, str], ...]
    """Invocation metadata (gRPC) or request headers (HTTP), keys lower-case."""
    protocol: Literal["grpc", "http"]
    """Which transport the call came in on."""

    def header(self, key: str) -> str:
        """The first value of a metadata key or header ("" when absent)."""
        return next((value for name, value in self.metadata if name == key), "")


class ServerInterceptor(Protocol):
    """Wraps every incoming call: entered before the handler runs, exited after it finished or failed.

    Raising a :class:`yieldloop.errors.YieldloopError` on entry refuses the call with that status (gRPC
    status + reason; the matching HTTP status on the HTTP endpoint). An exception leaving the handler
    passes through the context manager's exit (a tracer records it) before it is answered.
    """

    def intercept(self, call: CallInfo) -> contextlib.AbstractAsyncContextManager[None]: ...


@dataclasses.dataclass(frozen=True)
class TransportConfig:
    """How channels and servers are built: one config for every service, client and load test."""

    max_message_bytes: int = MAX_MESSAGE_BYTES
    """Largest gRPC message sent or accepted (a batch of runs streams as many messages)."""
    server_interceptors: tuple[ServerInterceptor, ...] = dataclasses.field(default=(), metadata={"cli": False})
    """Wrap every call a server built from this config receives, gRPC and HTTP alike."""
    client_interceptors: tuple[grpc.aio.ClientInterceptor, ...] = dataclasses.field(default=(), metadata={"cli": False})
    """grpc.aio client interceptors on every channel built from this config."""
    trace_context: Callable[[], dict[str, str]] | None = dataclasses.field(default=None, metadata={"cli": False})
    """The caller's current trace context as W3C headers, for what travels inside a shared stream (a multiplexed
    episode): set by services that trace (with the client interceptors that put it on each call)."""
    http_idle_timeout_s: float = 30.0
    """An HTTP connection that sends no complete request header for this long is closed (a header that never
    ends holds nothing), also between requests of a kept-alive connection."""
    http_body_timeout_s: float = 60.0
    """An HTTP request whose body has not fully arrived this long after its header is answered 408."""
    api_key: str = dataclasses.field(default="", metadata={"cli": False}, repr=False)
    """Sent as ``authorization: Bearer <key>`` with every call a :class:`yieldloop.client.Client` built from this
    config makes (as call metadata)."""
    tls_cert: str = ""
    """Servers: a PEM certificate (chain) file; with ``tls_key`` every server (gRPC and HTTP) speaks TLS only."""
    tls_key: str = ""
    """Servers: the certificate's PEM private key file."""
    tls_ca: str = ""
    """Clients: a PEM file of the certificate authorities to trust; set, channels are TLS (verifying the server's
    certificate against them), else plaintext. Clients of a stack read it from $YIELDLOOP_TLS_CA."""
    allow_plaintext: bool = False
    """Servers: serve plaintext on an interface other than loopback (refused without it: give --tls-cert and
    --tls-key, or run behind a TLS-terminating proxy and say so with this flag)."""
    health_port: int = 0
    """Servers: also answer grpc.health.v1 alone, in plaintext, on this port of every interface (Kubernetes' gRPC
    probes speak no TLS); 0: no such port. Nothing else is served there."""
    share_port: bool = dataclasses.field(default=False, metadata={"cli": False})
    """Servers: bind with SO_REUSEPORT, so that other processes serving the same service bind the same port and
    the kernel spreads connections over them (``yieldloop serve env --env-processes N``). Off, binding a port
    that another server holds fails (gRPC's own default would share it silently, with a stale process too)."""
    env_connections: int = 1
    """Clients: connections to each EnvService address; episodes take them in turn. Behind one address served by
    several processes (--env-processes N) each connection is served by one of them: give N or more."""

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials of a server built from this config (None: plaintext)."""
        if not (self.tls_cert or self.tls_key):
            return None
        if not (self.tls_cert and self.tls_key):
            raise ValueError("TLS needs both a certificate (--tls-cert) and its key (--tls-key)")
        with open(self.tls_key, "rb") as key, open(self.tls_cert, "rb") as cert:
            return grpc.ssl_server_credentials([(key.read(), cert.read())])

    def check_plaintext(self, host: str) -> None:
        """Refuses to serve plaintext on an interface other than loopback (unless ``allow_plaintext``)."""
        import ipaddress

        if self.tls_cert or self.allow_plaintext or host == "localhost":
            return
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(
                f"refusing to serve plaintext on {host!r} (not loopback): give --tls-cert and --tls-key "
                f"(`yieldloop up --tls` makes them), or --allow-plaintext behind a TLS proxy"
            )

    def channel_options(self) -> list[tuple[str, Any]]:
        """Channel options: large messages, keepalive, round-robin over DNS, a connection per channel."""
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", 30_000),
            # A restarted service is back within seconds: reconnect at that pace, not grpc's (up to 120 s).
            ("grpc.initial_reconnect_backoff_ms", 250),
            ("grpc.min_reconnect_backoff_ms", 250),
            ("grpc.max_reconnect_backoff_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.lb_policy_name", "round_robin"),
            # Each channel gets its own connections: channels to one address otherwise share one TCP
            # connection, and thousands of streams on one HTTP/2 connection fail under load.
            ("grpc.use_local_subchannel_pool", 1),
        ]

    def server_options(self) -> list[tuple[str, Any]]:
        """Server options for thousands of concurrent streams.

        - gRPC core rejects new streams once 1000 calls wait for the application (hard limit 3000):
          2048 episodes opened at once would fail with INTERNAL/CANCELLED on the clients;
        - clients send keepalive pings every 30 s (:meth:`channel_options`); the default server answers
          them with GOAWAY ``too_many_pings`` on long runs.
        """
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.server.max_pending_requests", 1 << 16),
            ("grpc.server.max_pending_requests_hard_limit", 1 << 17),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.max_ping_strikes", 0),
            ("grpc.so_reuseport", int(self.share_port)),
        ]


DEFAULT_TRANSPORT = TransportConfig()


def open_channel(address: str, config: TransportConfig = DEFAULT_TRANSPORT) -> grpc.aio.Channel:
    """A channel to ``address`` (``host:port`` or ``dns:///host:port``) built from ``config``."""
    interceptors = list(config.client_interceptors) or None
    if config.tls_ca:
        with open(config.tls_ca, "rb") as ca:
            credentials = grpc.ssl_channel_credentials(root_certificates=ca.read())
        return grpc.aio.secure_channel(
            address, credentials, options=config.channel_options(), interceptors=interceptors
        )
    return grpc.aio.insecure_channel(address, options=config.channel_options(), interceptors=interceptors)


def intercepting(
    interceptors: Sequence[ServerInterceptor], call: CallInfo
) -> contextlib.AbstractAsyncContextManager[Any]:
    """Enters every interceptor for ``call`` (first outermost); gRPC servers and the HTTP endpoint share it. With
    none, a do-nothing context (it wraps every call a server answers)."""
    if not interceptors:
        return contextlib.nullcontext()
    return _intercepting(interceptors, call)


@contextlib.asynccontextmanager
async def _intercepting(interceptors: Sequence[ServerInterceptor], call: CallInfo) -> Any:
    async with contextlib.AsyncExitStack() as stack:
        for interceptor in interceptors:
            await stack.enter_async_context(interceptor.intercept(call))
        yield
