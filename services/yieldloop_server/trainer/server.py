"""TrainerService process wiring."""

from __future__ import annotations

import asyncio
import pathlib

from yieldloop.client import Client
from yieldloop.convert import run_from_bytes, run_to_bytes
from yieldloop.errors import invalid_field
from yieldloop.proto.trainer.v1 import trainer_service_pb2_grpc as pb_grpc
from yieldloop.transport import DEFAULT_TRANSPORT, TransportConfig
from yieldloop_server.common.auth import KeyStore
from yieldloop_server.common.grpc_server import GrpcServer
from yieldloop_server.common.service import Service
from yieldloop_server.config import ServeOptions
from yieldloop_server.store import ObjectStore
from yieldloop_server.store.traces import TraceStore
from yieldloop_server.trainer import distributed
from yieldloop_server.trainer.servicer import TrainerServicer
from yieldloop_server.trainer.session import TrainingSession, TrainingSessions
from yieldloop_server.trainer.trainer import TrainerConfig
from yieldloop_server.weights import open_source

SERVICE_NAME = "yieldloop.trainer.v1.TrainerService"


def trainer_config(options: ServeOptions) -> TrainerConfig:
    """The model-in-training settings of ``options`` (device, dtype, micro-batches, compile)."""
    own = options.trainer
    return TrainerConfig(
        device=options.device,
        dtype=own.resolved_dtype(options.device),
        micro_batch_tokens=own.micro_batch_tokens,
        packed=own.pack,
        shard=own.shard,
        shard_group=own.shard_group,
        compute_dtype=own.compute_dtype(options.device),
        activation_checkpointing=own.shard != "none"
        if own.activation_checkpointing is None
        else own.activation_checkpointing,
        compile=own.compile,
    )


async def build(
    options: ServeOptions, store: ObjectStore, transport: TransportConfig, keys: KeyStore | None = None
) -> Service:
    """TrainerService as ``yieldloop serve trainer`` runs it (its options: ``options.trainer``); as rank 0 of
    torchrun's ranks, it trains with all of them (the others follow: see :func:`follow`)."""
    own = options.trainer
    config = trainer_config(options)
    nproc = own.nproc
    if distributed.launched() is not None:
        nproc = await asyncio.to_thread(distributed.join_launched, config)
    if own.shard != "none" and nproc < 2:
        raise invalid_field(
            "trainer.shard",
            f"--trainer-shard {own.shard} shards the model over ranks: give --nproc 2 or more (or torchrun's)",
        )
    if own.shard == "hsdp" and own.shard_group and (own.shard_group < 1 or nproc % own.shard_group):
        raise invalid_field(
            "trainer.shard_group", f"--trainer-shard-group {own.shard_group} does not divide {nproc} ranks"
        )
    work_dir = options.data_dir / "work" / options.service
    server, sessions = await make_server(
        options.model,
        store,
        options.checkpoint_address,
        work_dir,
        config,
        options.host,
        options.port,
        nproc,
        transport,
        own.max_models,
        own.state_every,
    )

    async def stop(grace: float) -> None:
        await server.stop(grace)
        await sessions.close()
        await asyncio.to_thread(distributed.stop_launched)

    return Service(server.start, stop)


async def follow(options: ServeOptions, rank: int, world: int) -> None:
    """A trainer rank > 0 that torchrun started: serves nothing but its health probes, follows rank 0 (the
    TrainerService) until rank 0 stops."""
    probes = GrpcServer("0.0.0.0", transport=options.transport) if options.transport.health_port else None
    if probes is not None:  # its pod's probes: SERVING while it follows (nothing but health is served)
        await probes.start_probes()
    print(f"yieldloop trainer rank {rank} of {world} following rank 0", flush=True)
    await asyncio.to_thread(distributed.follower_main, trainer_config(options), options.data_dir / "work" / "trainer")
    if probes is not None:
        await probes.stop(0)


async def make_server(
    model: str,
    store: ObjectStore,
    checkpoint_address: str,
    work_dir: pathlib.Path,
    config: TrainerConfig = TrainerConfig(),
    host: str = "127.0.0.1",
    port: int = 0,
    nproc: int = 1,
    transport: TransportConfig = DEFAULT_TRANSPORT,
    max_sessions: int = 2,
    state_every: int = 10,
) -> tuple[GrpcServer, TrainingSessions]:
    """A TrainerService server (not started) with the default ``model``'s session loaded, and its sessions
    (close them after the server stopped). ``nproc`` > 1 trains data-parallel, one model at a time (each
    session's ranks are processes of their own). Every ``state_every``-th step saves the full training state
    (0: only on demand and when a session closes)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    # A failed commit goes back to the trainer's caller, who retries the step with its idempotency key: one
    # place retries, not two nested ones.
    checkpoints = Client(checkpoint=checkpoint_address, transport=transport, retry_within_s=0)
    traces = TraceStore(store, run_to_bytes, run_from_bytes)
    server = GrpcServer(host, port, transport)
    address = lambda: server.advertised_address  # noqa: E731
    publisher = open_source(work_dir, address, cuda=config.device.startswith("cuda"))
    server.on_stop(publisher.close)
    sessions = TrainingSessions(
        lambda slug: TrainingSession(slug, store, checkpoints, traces, work_dir, config, nproc, publisher, state_every),
        default=model,
        max_sessions=1 if nproc > 1 else max_sessions,
        checkpoints=checkpoints,
    )
    await sessions.start()
    server.add(pb_grpc.add_TrainerServiceServicer_to_server, TrainerServicer(sessions, publisher), SERVICE_NAME)
    return server, sessions
