"""Runs one service in this process until SIGTERM/SIGINT (``yieldloop serve <service>``)."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import logging
import os
import pathlib
import signal
from collections.abc import Awaitable, Callable
from typing import Any

from yieldloop.transport import TransportConfig
from yieldloop_server.common import telemetry, write_file_atomically
from yieldloop_server.common.auth import SERVICE_TEAM, Authenticator, KeyStore, split_key
from yieldloop_server.common.grpc_server import GrpcServer
from yieldloop_server.config import ServeOptions
from yieldloop_server.store import ObjectStore

log = logging.getLogger(__name__)


Starter = Callable[[], Awaitable[str]]
Stopper = Callable[[float], Awaitable[None]]


def secured_transport(opts: ServeOptions, store: ObjectStore) -> tuple[TransportConfig, KeyStore | None]:
    """The service's transport with auth, and the key store it checks keys against: its servers check every
    call's key (:class:`Authenticator`), and its clients call the other services with the service key.
    Unchanged (and no key store) with ``--no-auth``, which is said loudly."""
    if not opts.auth:
        log.warning(
            "%s: AUTH IS OFF (--no-auth): anyone who reaches %s:%s may call every RPC, train and move the "
            "head of any model and read every run",
            opts.service,
            opts.host,
            opts.port or "its port",
        )
        return opts.transport, None
    keys = KeyStore(store)
    # A deployment hands its keys in from Secrets (made with `yieldloop keys mint`): registered here when new.
    admin_key = os.environ.get("YIELDLOOP_ADMIN_KEY", "")
    if admin_key and keys.check(admin_key) is None:
        keys.adopt(admin_key, SERVICE_TEAM, "admin", name="the deployment's admin key (YIELDLOOP_ADMIN_KEY)")
    service_key = opts.service_key or os.environ.get("YIELDLOOP_SERVICE_KEY", "")
    if service_key and keys.check(service_key) is None and split_key(service_key) is not None:
        keys.adopt(service_key, SERVICE_TEAM, "service", name="the deployment's service key (YIELDLOOP_SERVICE_KEY)")
    if not service_key or keys.check(service_key) is None:
        _, service_key = keys.create(SERVICE_TEAM, "service", name=f"{opts.service} service (made at its start)")
    return dataclasses.replace(
        opts.transport,
        api_key=service_key,
        server_interceptors=(Authenticator(keys), *opts.transport.server_interceptors),
    ), keys


def traced_transport(service: str, transport: TransportConfig, record_spans_url: str = "") -> TransportConfig:
    """The transport with OpenTelemetry when the environment asks for it (OTEL_EXPORTER_OTLP_ENDPOINT, ...):
    a span around every call served, outermost (refusals are traced too), and traceparent on every call made."""
    if record_spans_url:  # read by configure, here and in the env's worker processes
        os.environ[telemetry.RECORD_SPANS_VARIABLE] = record_spans_url
    if not telemetry.configure(service):
        return transport
    return dataclasses.replace(
        transport,
        server_interceptors=(telemetry.Tracing(), *transport.server_interceptors),
        client_interceptors=(*telemetry.client_interceptors(), *transport.client_interceptors),
        trace_context=telemetry.inject,
    )


def _use_torch_threads(opts: ServeOptions) -> None:
    if opts.torch_threads:
        import torch

        torch.set_num_threads(opts.torch_threads)


def _trainer_config(opts: ServeOptions) -> Any:
    from yieldloop_server.trainer.trainer import TrainerConfig

    return TrainerConfig(
        device=opts.device, dtype=opts.trainer.resolved_dtype(opts.device), compile=opts.trainer.compile
    )


async def build_service(opts: ServeOptions, published: dict[str, Any] | None = None) -> tuple[Starter, Stopper]:
    """Builds one service; returns its start (-> address) and stop(grace) coroutine functions. ``published``
    receives the other ports the started service serves (the rollout's OpenAI endpoint: ``http_port``), which
    its ready file records so a supervised restart binds them again."""
    from yieldloop_server.store import open_store

    _use_torch_threads(opts)
    store = open_store(opts.store_url)
    work_dir = opts.data_dir / "work" / opts.service
    transport, keys = await asyncio.to_thread(secured_transport, opts, store)
    opts = dataclasses.replace(
        opts, transport=traced_transport(opts.service, transport, opts.store_url if opts.record_spans else "")
    )
    telemetry.configure_metrics(opts.service, opts.host, opts.metrics_port)
    if opts.service == "checkpoint":
        from yieldloop_server.checkpoint.importer import ImportPolicy
        from yieldloop_server.checkpoint.server import build

        forbidden = (opts.data_dir, *((store.root,) if hasattr(store, "root") else ()))
        imports = ImportPolicy(tuple(pathlib.Path(root) for root in opts.checkpoint.import_roots), forbidden)
        server = build(
            store,
            opts.host,
            opts.port,
            opts.checkpoint.keep_last,
            opts.transport,
            keys,
            imports,
            int(opts.checkpoint.max_upload_gb * 10**9),
        )
        return server.start, server.stop
    if opts.service == "env":
        from yieldloop_server.env.hosts import HostConfig, create_host
        from yieldloop_server.env.server import build

        workers = opts.env.workers
        config = HostConfig(type="workers", num_workers=workers) if workers else HostConfig("inprocess")
        starts_others = opts.env.processes > 1 and not opts.env.share_port
        shared = opts.env.share_port or starts_others
        transport = dataclasses.replace(opts.transport, share_port=True) if shared else opts.transport
        server = await build(create_host(opts.env.specs, config), opts.host, opts.port, transport)
        return _with_replicas(opts, server.start, server.stop) if starts_others else (server.start, server.stop)
    if opts.service == "trainer":
        from yieldloop_server.trainer import distributed
        from yieldloop_server.trainer.server import build

        config = _trainer_config(opts)
        nproc = opts.trainer.nproc
        if distributed.launched() is not None:  # rank 0 of torchrun's ranks (the others follow: see serve())
            nproc = await asyncio.to_thread(distributed.join_launched, config)
        server, sessions = await build(
            opts.model,
            store,
            opts.checkpoint_address,
            work_dir,
            config,
            opts.host,
            opts.port,
            nproc,
            opts.transport,
            opts.trainer.max_models,
            opts.trainer.state_every,
        )

        async def stop(grace: float) -> None:
            await server.stop(grace)
            await sessions.close()
            await asyncio.to_thread(distributed.stop_launched)

        return server.start, stop
    if opts.service == "rollout":
        from yieldloop_server.rollout.rollouts import RolloutLimits
        from yieldloop_server.rollout.server import RolloutServer

        server = RolloutServer(
            opts.model,
            store,
            opts.checkpoint_address,
            opts.env_address,
            work_dir,
            opts.rollout.engine,
            opts.host,
            opts.port,
            None if opts.rollout.http_port < 0 else opts.rollout.http_port,
            transport=opts.transport,
            max_models=opts.rollout.max_models,
            memory_budget_bytes=opts.rollout.memory_budget_mb * 1_000_000,
            lora_engine="" if opts.rollout.lora_engine == "same" else opts.rollout.lora_engine,
            device=opts.device,
            process=opts.rollout.engine_process is not False,
            max_batch_size=max(0, opts.rollout.max_batch),
            limits=RolloutLimits(max_runs=opts.rollout.max_runs, max_episodes=opts.rollout.max_episodes),
            stream_interval_s=max(0.0, opts.rollout.stream_interval_ms) / 1000,
            weights_from=opts.rollout.weights_from,
        )

        async def start_rollout() -> str:
            address = await server.start()
            if published is not None and server.http is not None:
                published["http_port"] = server.http.port
            return address

        return start_rollout, server.stop
    if opts.service == "hud":
        from yieldloop.client import Client
        from yieldloop_server.hud.front import HudFront

        client = Client(
            checkpoint=opts.checkpoint_address,
            trainer=opts.trainer_address,
            rollout=opts.rollout_address,
            transport=opts.transport,
        )
        front = HudFront(client, store, opts.host, opts.port, opts.transport, auth=opts.auth)

        async def stop_front(grace: float) -> None:
            await front.stop()
            await client.close()

        return front.start, stop_front
    raise ValueError(f"unknown service {opts.service!r}")


def _with_replicas(opts: ServeOptions, start: Starter, stop: Stopper) -> tuple[Starter, Stopper]:
    """An EnvService served by ``opts.env.processes`` processes on one port: this one (``start``, ``stop``) and the
    others, started once this one is bound, on its port, each supervised (started again when it dies, on the same
    port) and ended with this process (SIGTERM when it stops; the kernel's parent-death signal when it is killed).
    The service key goes to them in their environment, as ``yieldloop up`` hands it to its services."""
    from yieldloop_server.supervisor import ServiceProcess

    replicas: list[ServiceProcess] = []

    async def start_all() -> str:
        address = await start()
        port = int(address.rsplit(":", 1)[1])
        work_dir = opts.data_dir / "work" / "env"
        work_dir.mkdir(parents=True, exist_ok=True)
        for index in range(1, opts.env.processes):
            replica = dataclasses.replace(  # this process answers the probes; each has metrics of its own
                opts,
                port=port,
                ready_file=work_dir / f"process-{index}.json",
                metrics_port=0,
                env=dataclasses.replace(opts.env, processes=1, share_port=True),
                transport=dataclasses.replace(opts.transport, health_port=0),
            )
            replicas.append(
                ServiceProcess(
                    replica,
                    opts.data_dir / "logs",
                    name=f"env-{index}",
                    service_key=opts.transport.api_key,
                    exit_with_parent=True,
                )
            )
        try:
            await asyncio.gather(*(replica.start() for replica in replicas))
        except BaseException:
            await stop_all(0)
            raise
        log.info("EnvService serves %s from %d processes", address, opts.env.processes)
        return address

    async def stop_all(grace: float) -> None:
        await asyncio.gather(stop(grace), *(replica.stop(grace + 10) for replica in replicas))

    return start_all, stop_all


def settle_heap() -> None:
    """The garbage collector's policy of a started service's process. Thousands of live streams make the
    collector's default pace (a gen-0 pass every 700 allocations, full passes over every live object) a measurable
    share of each message, and a full pass over a process that imported torch and transformers (vLLM: ~1M objects)
    stops it for 0.3-0.6 s: what start-up made (modules, the loaded model) is frozen out of the collector's passes,
    and it collects less often."""
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)


async def serve(opts: ServeOptions) -> None:
    """Starts the service, writes the ready file, and stops gracefully on SIGTERM/SIGINT. A trainer rank > 0 that
    torchrun started serves nothing: it follows rank 0 (the TrainerService) until rank 0 stops."""
    if opts.service == "trainer":
        from yieldloop_server.trainer import distributed

        placed = distributed.launched()
        if placed is not None and placed[0] > 0:
            _use_torch_threads(opts)
            config = _trainer_config(opts)
            probes = GrpcServer("0.0.0.0", transport=opts.transport) if opts.transport.health_port else None
            if probes is not None:  # its pod's probes: SERVING while it follows (nothing but health is served)
                await probes.start_probes()
            print(f"yieldloop trainer rank {placed[0]} of {placed[1]} following rank 0", flush=True)
            await asyncio.to_thread(distributed.follower_main, config, opts.data_dir / "work" / "trainer")
            if probes is not None:
                await probes.stop(0)
            return
    published: dict[str, Any] = {}
    start, stop = await build_service(opts, published)
    address = await start()
    settle_heap()
    if opts.ready_file is not None:
        write_ready_file(
            opts.ready_file, address, tls=bool(opts.transport.tls_cert), metrics=telemetry.metrics_address, **published
        )
    print(f"yieldloop {opts.service} serving on {address}", flush=True)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    log.info("stopping %s", opts.service)
    await stop(opts.grace_s)
    await asyncio.to_thread(telemetry.shutdown)  # the spans still queued are sent


def write_ready_file(path: pathlib.Path, address: str, tls: bool = False, metrics: str = "", **ports: int) -> None:
    """Atomically records a started service's address (whether it speaks TLS, where it serves metrics, the other
    ports it serves)."""
    write_file_atomically(
        path, json.dumps({"address": address, "pid": os.getpid(), "tls": tls, "metrics": metrics, **ports})
    )
