"""RolloutService process wiring: engine, head follower, servicer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pathlib
from typing import Any

from yieldloop.client import Client
from yieldloop.convert import run_from_bytes, run_to_bytes
from yieldloop.errors import UnavailableError
from yieldloop.proto.rollout.v1 import rollout_service_pb2_grpc as pb_grpc
from yieldloop.transport import DEFAULT_TRANSPORT, TransportConfig
from yieldloop_server.common.auth import KeyStore
from yieldloop_server.common.grpc_server import GrpcServer
from yieldloop_server.common.service import Service
from yieldloop_server.config import RolloutOptions, ServeOptions
from yieldloop_server.rollout.engines import create_engine
from yieldloop_server.rollout.models import ServedModels
from yieldloop_server.rollout.openai_http import OpenAIEndpoint
from yieldloop_server.rollout.rollouts import RolloutLimits
from yieldloop_server.rollout.servicer import RolloutServicer
from yieldloop_server.store import ObjectStore
from yieldloop_server.store.traces import TraceStore

SERVICE_NAME = "yieldloop.rollout.v1.RolloutService"
WEIGHTS_HEALTH = SERVICE_NAME + "/weights"
"""Health name that turns NOT_SERVING while the model's head could not be loaded (old weights keep serving)."""
ENGINE_HEALTH = SERVICE_NAME + "/engine"
"""Health name that turns NOT_SERVING, with the server's overall status (its pod's probes then restart it), while an
engine whose process died cannot be started again."""
ENGINE_WATCH_S = 2.0
"""How often the server looks for engines whose process died (to start them again with no call waiting)."""

log = logging.getLogger(__name__)


async def watch_engines(models: ServedModels, grpc: GrpcServer, every_s: float = ENGINE_WATCH_S) -> None:
    """Starts again, with no call waiting, any served engine whose process died, and keeps ``grpc``'s health to
    what it can serve (:data:`ENGINE_HEALTH`); stops with the server."""

    async def watch() -> None:
        serving = True
        while True:
            await asyncio.sleep(every_s)
            ok = True
            for served in models.loaded:
                if served.engine.is_down():
                    try:
                        await served.engine.revive()
                    except UnavailableError:
                        ok = False
            if ok != serving:
                serving = ok
                log.log(logging.INFO if ok else logging.ERROR, "engine %s", "serving again" if ok else "down")
                for name in ("", ENGINE_HEALTH):
                    await grpc.set_health(name, ok)

    await grpc.set_health(ENGINE_HEALTH, True)
    task = asyncio.get_running_loop().create_task(watch(), name="engine-watch")

    async def stop() -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    grpc.on_stop(stop)


async def build(
    options: ServeOptions, store: ObjectStore, transport: TransportConfig, keys: KeyStore | None = None
) -> Service:
    """RolloutService as ``yieldloop serve rollout`` runs it (its options: ``options.rollout``)."""
    server = RolloutServer(
        options.model,
        store,
        options.checkpoint_address,
        options.env_address,
        options.data_dir / "work" / options.service,
        options.rollout,
        options.host,
        options.port,
        transport,
        options.device,
    )
    ports: dict[str, int] = {}

    async def start() -> str:
        address = await server.start()
        if server.http is not None:
            ports["http_port"] = server.http.port
        return address

    return Service(start, server.stop, ports)


class RolloutServer:
    """A RolloutService: engines for every model slug (the default one loaded at start), each following its
    slug's head, the OpenAI-compatible endpoint, and the servicer.

    Args:
        model: The default model slug (requests naming none get it).
        store: Object store with the checkpoints.
        checkpoint_address: CheckpointService address (head watching).
        env_address: EnvService address (rollouts).
        cache_dir: Local folder for verified checkpoints.
        options: The service's own options (engine, OpenAI endpoint port, models loaded at once, memory budget,
            LoRA engine, limits on StreamRollouts, streaming interval, how weights come): see
            :class:`~yieldloop_server.config.RolloutOptions`.
        transport: Limits and interceptors of the gRPC server, the HTTP endpoint and the internal clients.
        device: The engines' device.
    """

    def __init__(
        self,
        model: str,
        store: ObjectStore,
        checkpoint_address: str,
        env_address: str,
        cache_dir: pathlib.Path,
        options: RolloutOptions = RolloutOptions(),
        host: str = "127.0.0.1",
        port: int = 0,
        transport: TransportConfig = DEFAULT_TRANSPORT,
        device: str = "cpu",
    ) -> None:
        # A batch opens its episodes together: they share one StreamEpisodes stream per EnvService replica.
        self.clients = Client(
            env=env_address, checkpoint=checkpoint_address, transport=transport, multiplex_episodes=True
        )
        options.validate()
        engine_options: dict[str, Any] = {
            "device": device,
            "process": options.engine_process is not False,
            "max_batch_size": max(0, options.max_batch),
        }
        lora_engine = options.engine if options.lora_engine == "same" else options.lora_engine
        vllm_options = {
            "tensor_parallel_size": options.tensor_parallel,
            "memory_utilization": options.gpu_memory_utilization or None,
            "max_model_len": options.max_model_len or None,
        }
        stream_interval_s = max(0.0, options.stream_interval_ms) / 1000

        def serving_engine(lora: bool) -> Any:
            kind = lora_engine if lora else options.engine
            return create_engine(kind, lora=lora, **engine_options, **(vllm_options if kind == "vllm" else {}))

        async def report(ok: bool) -> None:
            await self.grpc.set_health(WEIGHTS_HEALTH, ok)

        # Candidates are evaluated on the light torch engine, beside whatever engine serves the head (in a thread:
        # a child process would cost its start, seconds, at the first candidate).
        self.models = ServedModels(
            model,
            serving_engine,
            lambda: create_engine("torch", device=device, max_batch_size=engine_options["max_batch_size"]),
            store,
            self.clients,
            cache_dir,
            max_models=options.max_models,
            on_default_reload=report,
            memory_budget_bytes=options.memory_budget_mb * 1_000_000,
            weights_from=options.weights_from,
            device=device,
            candidates_like_head=options.engine == "torch" and not engine_options["process"],
        )
        self.grpc = GrpcServer(host, port, transport)
        limits = RolloutLimits(max_runs=options.max_runs, max_episodes=options.max_episodes)
        traces = TraceStore(store, run_to_bytes, run_from_bytes)
        self.servicer = RolloutServicer(self.models, self.clients, traces, limits, stream_interval_s)
        self.grpc.add(pb_grpc.add_RolloutServiceServicer_to_server, self.servicer, SERVICE_NAME)
        self.http = (
            None
            if options.http_port < 0
            else OpenAIEndpoint(
                self.models, host, options.http_port, transport, stream_interval_s, access=self.servicer.access
            )
        )

    async def start(self) -> str:
        """Loads the default model (its first head), then serves."""
        from yieldloop_server.common import telemetry

        telemetry.observe(
            "yieldloop.engine.queue_depth",
            lambda: sum(served.engine.num_unfinished() for served in self.models.loaded),
            description="requests waiting or decoding in the engines",
        )
        try:
            await self.models.start()
        except BaseException:
            await self.models.close()
            await self.clients.close()
            raise
        if self.http is not None:
            self.servicer.openai_base_url = await self.http.start()
        address = await self.grpc.start()
        await watch_engines(self.models, self.grpc)
        return address

    async def stop(self, grace: float = 5.0) -> None:
        if self.http is not None:
            await self.http.stop()
        await self.grpc.stop(grace)
        await self.models.close()
        await self.clients.close()


class _NoFollower:
    head_sequence = 0
    last_error = ""
    following = True
    follow_error = ""

    async def wait_for(self, checkpoint_id: str) -> None:
        return None


async def serve_engine(
    model: str,
    engine,
    host: str = "127.0.0.1",
    port: int = 0,
    stream_interval_s: float = 0.0,
    transport: TransportConfig = DEFAULT_TRANSPORT,
    watch_s: float = ENGINE_WATCH_S,
) -> GrpcServer:
    """Serves an already-loaded engine's ``Generate`` over gRPC, with no head to follow and no EnvService.

    For benchmarks and tests that compare the engine in process with the same engine behind gRPC.
    """
    server = GrpcServer(host, port, transport)
    models = ServedModels.fixed(model, engine, _NoFollower())
    server.add(
        pb_grpc.add_RolloutServiceServicer_to_server,
        RolloutServicer(models, Client(), traces=None, stream_interval_s=stream_interval_s),
        SERVICE_NAME,
    )
    await server.start()
    await watch_engines(models, server, watch_s)
    return server
