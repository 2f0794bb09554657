"""TrainerService process wiring."""

from __future__ import annotations

import pathlib

from yieldloop.client import Client
from yieldloop.proto.trainer.v1 import trainer_service_pb2_grpc as pb_grpc
from yieldloop.transport import DEFAULT_TRANSPORT, TransportConfig
from yieldloop_server.common.grpc_server import GrpcServer
from yieldloop_server.store import ObjectStore
from yieldloop_server.trainer.servicer import TrainerServicer
from yieldloop_server.trainer.trainer import TrainerConfig

SERVICE_NAME = "yieldloop.trainer.v1.TrainerService"


async def build(
    model: str,
    store: ObjectStore,
    checkpoint_address: str,
    work_dir: pathlib.Path,
    config: TrainerConfig = TrainerConfig(),
    host: str = "127.0.0.1",
    port: int = 0,
    nproc: int = 1,
    transport: TransportConfig = DEFAULT_TRANSPORT,
) -> tuple[GrpcServer, TrainerServicer]:
    """A TrainerService server with the model's head loaded (not started); ``nproc`` > 1 trains data-parallel."""
    work_dir.mkdir(parents=True, exist_ok=True)
    servicer = TrainerServicer(model, store, Client(checkpoint=checkpoint_address, transport=transport), work_dir, config, nproc)
    await servicer.load_head()
    server = GrpcServer(host, port, transport)
    server.add(pb_grpc.add_TrainerServiceServicer_to_server, servicer, SERVICE_NAME)
    return server, servicer
