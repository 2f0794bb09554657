"""EnvService process wiring."""

from __future__ import annotations

from yieldloop.env.v1 import env_service_pb2_grpc as pb_grpc
from yieldloop.environment import Environment
from yieldloop.services.common.grpc_server import GrpcServer
from yieldloop.services.env.loader import EnvironmentSet
from yieldloop.services.env.servicer import EnvServicer

SERVICE_NAME = "yieldloop.env.v1.EnvService"


def build(envs: list[Environment], host: str = "127.0.0.1", port: int = 0) -> GrpcServer:
    """An EnvService server for ``envs`` (not started)."""
    server = GrpcServer(host, port)
    server.add(pb_grpc.add_EnvServiceServicer_to_server, EnvServicer(EnvironmentSet(envs)), SERVICE_NAME)
    return server
