"""EnvService process wiring."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from yieldloop.proto.env.v1 import env_service_pb2_grpc as pb_grpc
from yieldloop.transport import DEFAULT_TRANSPORT, TransportConfig
from yieldloop_server.common.auth import KeyStore
from yieldloop_server.common.grpc_server import GrpcServer
from yieldloop_server.common.service import Service
from yieldloop_server.config import ServeOptions
from yieldloop_server.env.host import EpisodeHost
from yieldloop_server.env.hosts import HostConfig, create_host
from yieldloop_server.env.servicer import EnvServicer
from yieldloop_server.store import ObjectStore

SERVICE_NAME = "yieldloop.env.v1.EnvService"

log = logging.getLogger(__name__)


async def build(
    options: ServeOptions, store: ObjectStore, transport: TransportConfig, keys: KeyStore | None = None
) -> Service:
    """EnvService as ``yieldloop serve env`` runs it (its options: ``options.env``): environment code in this
    process or in worker processes; with ``processes`` > 1, more processes serving the same port (this one starts
    them once bound, and supervises them)."""
    own = options.env
    config = HostConfig(type="workers", num_workers=own.workers) if own.workers else HostConfig("inprocess")
    starts_others = own.processes > 1 and not own.share_port
    if own.share_port or starts_others:
        transport = dataclasses.replace(transport, share_port=True)
    server = await make_server(create_host(own.specs, config), options.host, options.port, transport)
    service = Service(server.start, server.stop)
    return with_replicas(options, service) if starts_others else service


def with_replicas(options: ServeOptions, this: Service) -> Service:
    """An EnvService served by ``options.env.processes`` processes on one port: this one and the others, started
    once this one is bound, on its port, each supervised (started again when it dies, on the same port) and ended
    with this process (SIGTERM when it stops; the kernel's parent-death signal when it is killed). The service key
    goes to them in their environment, as ``yieldloop up`` hands it to its services."""
    from yieldloop_server.supervisor import ServiceProcess

    replicas: list[ServiceProcess] = []

    async def start_all() -> str:
        address = await this.start()
        port = int(address.rsplit(":", 1)[1])
        work_dir = options.data_dir / "work" / "env"
        work_dir.mkdir(parents=True, exist_ok=True)
        for index in range(1, options.env.processes):
            replica = dataclasses.replace(  # this process answers the probes; each has metrics of its own
                options,
                port=port,
                ready_file=work_dir / f"process-{index}.json",
                metrics_port=0,
                env=dataclasses.replace(options.env, processes=1, share_port=True),
                transport=dataclasses.replace(options.transport, health_port=0),
            )
            replicas.append(
                ServiceProcess(
                    replica,
                    options.data_dir / "logs",
                    name=f"env-{index}",
                    service_key=options.transport.api_key,
                    exit_with_parent=True,
                )
            )
        try:
            await asyncio.gather(*(replica.start() for replica in replicas))
        except BaseException:
            await stop_all(0)
            raise
        log.info("EnvService serves %s from %d processes", address, options.env.processes)
        return address

    async def stop_all(grace: float) -> None:
        await asyncio.gather(this.stop(grace), *(replica.stop(grace + 10) for replica in replicas))

    return Service(start_all, stop_all)


async def make_server(
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
