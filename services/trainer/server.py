"""TrainerService process wiring."""

from __future__ import annotations

import pathlib

from yieldloop.client import Client
from yieldloop.convert import run_from_bytes, run_to_bytes
from yieldloop.proto.trainer.v1 import trainer_service_pb2_grpc as pb_grpc
from yieldloop.transport import DEFAULT_TRANSPORT, TransportConfig
from yieldloop_server.common.grpc_server import GrpcServer
from yieldloop_server.store import ObjectStore
from yieldloop_server.store.traces import TraceStore
from yieldloop_server.trainer.servicer import TrainerServicer
from yieldloop_server.trainer.session import TrainingSession
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
) -> tuple[GrpcServer, TrainingSession]:
    """A TrainerService server with the model's head loaded (not started), and its session (close it after the
    server stopped); ``nproc`` > 1 trains data-parallel."""
    work_dir.mkdir(parents=True, exist_ok=True)
    checkpoints = Client(checkpoint=checkpoint_address, transport=transport)
    traces = TraceStore(store, run_to_bytes, run_from_bytes)
    session = TrainingSession(model, store, checkpoints, traces, work_dir, config, nproc)
    await session.load_head()
    server = GrpcServer(host, port, transport)
    server.add(pb_grpc.add_TrainerServiceServicer_to_server, TrainerServicer(session), SERVICE_NAME)
    return server, session
