"""CheckpointService process wiring."""

from __future__ import annotations

from yieldloop.proto.checkpoint.v1 import checkpoint_service_pb2_grpc as pb_grpc
from yieldloop_server.checkpoint.registry import CheckpointRegistry
from yieldloop_server.checkpoint.servicer import CheckpointServicer
from yieldloop_server.common.auth import KeyStore
from yieldloop_server.common.grpc_server import GrpcServer
from yieldloop_server.store import ObjectStore
from yieldloop.transport import DEFAULT_TRANSPORT, TransportConfig

SERVICE_NAME = "yieldloop.checkpoint.v1.CheckpointService"


def build(
    store: ObjectStore, host: str = "127.0.0.1", port: int = 0, keep_last: int = 0,
    transport: TransportConfig = DEFAULT_TRANSPORT, keys: KeyStore | None = None,
) -> GrpcServer:
    """A CheckpointService server over ``store`` (not started); ``keep_last`` > 0 applies retention on commit."""
    server = GrpcServer(host, port, transport)
    registry = CheckpointRegistry(store, keep_last=keep_last)
    server.add(pb_grpc.add_CheckpointServiceServicer_to_server, CheckpointServicer(registry, keys), SERVICE_NAME)
    return server
