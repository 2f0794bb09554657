"""TrainerService process wiring."""

from __future__ import annotations

import pathlib

from yieldloop.client import Client
from yieldloop.services.common.grpc_server import GrpcServer
from yieldloop.services.store import ObjectStore
from yieldloop.services.trainer.servicer import TrainerServicer
from yieldloop.services.trainer.trainer import TrainerConfig
from yieldloop.trainer.v1 import trainer_service_pb2_grpc as pb_grpc

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
) -> tuple[GrpcServer, TrainerServicer]:
    """A TrainerService server with the model's head loaded (not started); ``nproc`` > 1 trains data-parallel."""
    work_dir.mkdir(parents=True, exist_ok=True)
    servicer = TrainerServicer(model, store, Client(checkpoint=checkpoint_address), work_dir, config, nproc)
    await servicer.load_head()
    server = GrpcServer(host, port)
    server.add(pb_grpc.add_TrainerServiceServicer_to_server, servicer, SERVICE_NAME)
    return server, servicer
