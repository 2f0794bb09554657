"""RolloutService process wiring: engine, head follower, servicer."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib

from yieldloop.client import Client
from yieldloop.convert import run_from_bytes, run_to_bytes
from yieldloop.proto.rollout.v1 import rollout_service_pb2_grpc as pb_grpc
from yieldloop.transport import DEFAULT_TRANSPORT, TransportConfig
from yieldloop_server.common.grpc_server import GrpcServer
from yieldloop_server.rollout.engines import create_engine
from yieldloop_server.rollout.openai_http import OpenAIEndpoint
from yieldloop_server.rollout.servicer import RolloutServicer
from yieldloop_server.rollout.weights import PinnedEngines, WeightFollower
from yieldloop_server.store import ObjectStore
from yieldloop_server.store.traces import TraceStore

SERVICE_NAME = "yieldloop.rollout.v1.RolloutService"
WEIGHTS_HEALTH = SERVICE_NAME + "/weights"
"""Health name that turns NOT_SERVING while the model's head could not be loaded (old weights keep serving)."""


class RolloutServer:
    """A RolloutService with its engine and the task that follows the head.

    Args:
        model: Model slug served.
        store: Object store with the checkpoints.
        checkpoint_address: CheckpointService address (head watching).
        env_address: EnvService address (rollouts).
        cache_dir: Local folder for verified checkpoints.
        engine: Engine kind ("torch" or "vllm").
        http_port: Port of the OpenAI-compatible HTTP endpoint (0: a free one; None: off).
        transport: Limits and interceptors of the gRPC server, the HTTP endpoint and the internal clients.
    """

    def __init__(
        self,
        model: str,
        store: ObjectStore,
        checkpoint_address: str,
        env_address: str,
        cache_dir: pathlib.Path,
        engine: str = "torch",
        host: str = "127.0.0.1",
        port: int = 0,
        http_port: int | None = 0,
        transport: TransportConfig = DEFAULT_TRANSPORT,
        **engine_options: object,
    ) -> None:
        self.engine = create_engine(engine, **engine_options)
        self.http = None if http_port is None else OpenAIEndpoint(model, self.engine, host, http_port, transport)
        self.clients = Client(env=env_address, checkpoint=checkpoint_address, transport=transport)
        self.follower = WeightFollower(self.engine, model, store, self.clients, cache_dir)
        # Candidates are evaluated on the light torch engine, beside whatever engine serves the head.
        device = str(engine_options.get("device", "cpu"))
        self.pinned = PinnedEngines(self.follower, lambda: create_engine("torch", device=device))
        self.grpc = GrpcServer(host, port, transport)
        self.servicer = RolloutServicer(model, self.engine, self.follower, self.clients, TraceStore(store, run_to_bytes, run_from_bytes), self.pinned)
        self.grpc.add(pb_grpc.add_RolloutServiceServicer_to_server, self.servicer, SERVICE_NAME)
        self._follow_task: asyncio.Task | None = None

        async def report(ok: bool) -> None:
            await self.grpc.set_health(WEIGHTS_HEALTH, ok)

        self.follower.on_reload = report

    async def start(self, wait_for_weights: bool = True) -> str:
        """Starts following the head (waiting for the first load by default), then serves."""
        self._follow_task = asyncio.create_task(self.follower.run())
        if wait_for_weights:
            loaded = asyncio.create_task(self.follower.wait_loaded())
            await asyncio.wait({loaded, self._follow_task}, return_when=asyncio.FIRST_COMPLETED)
            if self._follow_task.done():  # e.g. the model does not exist: fail now, do not hang
                loaded.cancel()
                await self.clients.close()
                await self.engine.close()
                self._follow_task.result()
        if self.http is not None:
            self.servicer.openai_base_url = await self.http.start()
        return await self.grpc.start()

    async def stop(self, grace: float = 5.0) -> None:
        if self.http is not None:
            await self.http.stop()
        await self.grpc.stop(grace)
        if self._follow_task is not None:
            self._follow_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follow_task
        await self.pinned.close()
        await self.clients.close()
        await self.engine.close()


class _NoFollower:
    head_sequence = 0
    last_error = ""

    async def wait_for(self, checkpoint_id: str) -> None:
        return None


async def serve_engine(model: str, engine, host: str = "127.0.0.1", port: int = 0) -> GrpcServer:
    """Serves an already-loaded engine's ``Generate`` over gRPC, with no head to follow and no EnvService.

    For benchmarks and tests that compare the engine in process with the same engine behind gRPC.
    """
    server = GrpcServer(host, port)
    server.add(
        pb_grpc.add_RolloutServiceServicer_to_server,
        RolloutServicer(model, engine, _NoFollower(), Client(), traces=None),
        SERVICE_NAME,
    )
    await server.start()
    return server
