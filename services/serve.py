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

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ServeOptions:
    service: str
    """One of checkpoint, env, trainer, rollout."""
    data_dir: pathlib.Path
    host: str = "127.0.0.1"
    port: int = 0
    """0 picks a free port (see ready_file)."""
    store: str = ""
    """Object store URL (default: <data_dir>/store)."""
    model: str = "tiny"
    checkpoint_address: str = ""
    env_address: str = ""
    env_specs: tuple[str, ...] = ("yieldloop.envs.letters:env",)
    env_workers: int = 2
    """EnvService worker processes running environment code (0: in the service's own process)."""
    max_message_bytes: int = 0
    """Largest gRPC message accepted (0: the client library's default, 64 MiB)."""
    engine: str = "torch"
    http_port: int = 0
    """RolloutService's OpenAI-compatible HTTP endpoint port (0: a free one; -1: off)."""
    device: str = "cpu"
    trainer_dtype: str = "auto"
    """Trainer weights dtype; "auto" is bfloat16 on CUDA and float32 elsewhere."""
    nproc: int = 1
    """Trainer ranks (data parallel: gloo on CPU, NCCL on CUDA, one GPU per rank)."""
    keep_last: int = 0
    """CheckpointService retention: keep the last K checkpoints of a model plus every one that was ever
    head (0: keep everything)."""
    ready_file: pathlib.Path | None = None
    """Where to write the bound address once serving."""
    grace_s: float = 5.0

    def to_args(self) -> list[str]:
        """The ``yieldloop serve`` arguments that give these options."""
        args = [
            "serve", self.service, "--host", self.host, "--port", str(self.port), "--data-dir", str(self.data_dir),
            "--model", self.model, "--engine", self.engine, "--http-port", str(self.http_port), "--device", self.device,
            "--trainer-dtype", self.trainer_dtype, "--nproc", str(self.nproc), "--keep-last", str(self.keep_last),
        ]
        args += ["--env-workers", str(self.env_workers), "--max-message-bytes", str(self.max_message_bytes)]
        for flag, value in (("--store", self.store), ("--checkpoint-address", self.checkpoint_address),
                            ("--env-address", self.env_address), ("--ready-file", self.ready_file)):
            if value:
                args += [flag, str(value)]
        for spec in self.env_specs:
            args += ["--env-spec", spec]
        return args


Starter = Callable[[], Awaitable[str]]
Stopper = Callable[[float], Awaitable[None]]


async def build_service(opts: ServeOptions) -> tuple[Starter, Stopper]:
    """Builds one service; returns its start (-> address) and stop(grace) coroutine functions."""
    from yieldloop.services.store import open_store

    store = open_store(opts.store or str(opts.data_dir / "store"))
    work_dir = opts.data_dir / "work" / opts.service
    if opts.service == "checkpoint":
        from yieldloop.services.checkpoint.server import build

        server = build(store, opts.host, opts.port, opts.keep_last)
        return server.start, server.stop
    if opts.service == "env":
        from yieldloop.services.env.host import HostConfig, create_host
        from yieldloop.services.env.server import build

        config = HostConfig(type="workers", num_workers=opts.env_workers) if opts.env_workers else HostConfig("inprocess")
        server = await build(
            create_host(opts.env_specs, config), opts.host, opts.port, opts.max_message_bytes or None
        )
        return server.start, server.stop
    if opts.service == "trainer":
        from yieldloop.services.trainer.server import build
        from yieldloop.services.trainer.trainer import TrainerConfig

        dtype = opts.trainer_dtype
        if dtype == "auto":
            dtype = "bfloat16" if opts.device.startswith("cuda") else "float32"
        server, servicer = await build(
            opts.model, store, opts.checkpoint_address, work_dir, TrainerConfig(device=opts.device, dtype=dtype),
            opts.host, opts.port, opts.nproc,
        )

        async def stop(grace: float) -> None:
            await server.stop(grace)
            await servicer.close()

        return server.start, stop
    if opts.service == "rollout":
        from yieldloop.services.rollout.server import RolloutServer

        server = RolloutServer(
            opts.model, store, opts.checkpoint_address, opts.env_address, work_dir, opts.engine,
            opts.host, opts.port, None if opts.http_port < 0 else opts.http_port, device=opts.device,
        )
        return server.start, server.stop
    raise ValueError(f"unknown service {opts.service!r}")


async def serve(opts: ServeOptions) -> None:
    """Starts the service, writes the ready file, and stops gracefully on SIGTERM/SIGINT."""
    start, stop = await build_service(opts)
    address = await start()
    # Thousands of live streams make the collector's default pace (a gen-0 pass every 700
    # allocations, full passes over every live object) a measurable share of each message:
    # freeze what start-up made and collect less often.
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)
    if opts.ready_file is not None:
        write_ready_file(opts.ready_file, address)
    print(f"yieldloop {opts.service} serving on {address}", flush=True)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    log.info("stopping %s", opts.service)
    await stop(opts.grace_s)


def write_ready_file(path: pathlib.Path, address: str) -> None:
    """Atomically records a started service's address."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"address": address, "pid": os.getpid()}))
    tmp.replace(path)
