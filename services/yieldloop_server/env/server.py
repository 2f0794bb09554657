"""EnvService process wiring."""

from __future__ import annotations

from yieldloop.proto.env.v1 import env_service_pb2_grpc as pb_grpc
from yieldloop.transport import DEFAULT_TRANSPORT, TransportConfig
from yieldloop_server.common.grpc_server import GrpcServer
from yieldloop_server.env.host import EpisodeHost
from yieldloop_server.env.servicer import EnvServicer

SERVICE_NAME = "yieldloop.env.v1.EnvService"


async def build(
    host: EpisodeHost, address_host: str = "127.0.0.1", port: int = 0, transport: TransportConfig = DEFAULT_TRANSPORT
) -> GrpcServer:
    """An EnvService server over a started ``host`` (the server itself is not started)."""
    await host.start()
    server = GrpcServer(address_host, port, transport)
    servicer = EnvServicer(host)
    server.add(pb_grpc.add_EnvServiceServicer_to_server, servicer, SERVICE_NAME)
    server.on_stop(servicer.deadlines.close)
    server.on_stop(host.stop)
    return server
