"""Starting the four services together: in one process (tests) or one process each (``yieldloop up``).

Data directory layout::

    <data>/store/            filesystem object store (models, checkpoints, HEAD)
    <data>/work/<service>/   scratch and verified-checkpoint caches
    <data>/run/<service>.json  address of each running service (written when ready)
    <data>/logs/<service>.log  output of each service process
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import pathlib
import signal
import sys
import tempfile
import time

from yieldloop.services.checkpoint.files import upload_folder
from yieldloop.services.checkpoint.registry import CheckpointRegistry, Manifest, ModelInfo
from yieldloop.services.serve import ServeOptions, Stopper, build_service
from yieldloop.services.store import ObjectStore

log = logging.getLogger(__name__)

SERVICES = ("checkpoint", "env", "trainer", "rollout")
BASE_CHECKPOINT = "base"
DEFAULT_MODEL = "tiny"


@dataclasses.dataclass
class StackConfig:
    """What a local stack serves."""

    data_dir: pathlib.Path
    """Root of the store, scratch space, address files and logs."""
    store: str = ""
    """Object store URL (``s3://bucket/prefix``, a path); default: the filesystem store in data_dir."""
    model: str = DEFAULT_MODEL
    """Model slug served and trained (created offline when absent)."""
    env_specs: tuple[str, ...] = ("yieldloop.envs.letters:env",)
    """Environments EnvService loads (``module:attr`` or ``file.py:attr``)."""
    env_workers: int = 2
    """EnvService worker processes (0: environment code in the service's process)."""
    engine: str = "torch"
    http_port: int = 0
    """RolloutService's OpenAI-compatible HTTP endpoint port (0: a free one; -1: off)."""
    device: str = "cpu"
    trainer_dtype: str = "auto"
    """"auto": bfloat16 on CUDA, float32 elsewhere."""
    nproc: int = 1
    """Trainer ranks (data parallel)."""
    keep_last: int = 0
    """Checkpoint retention: the last K plus every checkpoint that was ever head (0: all)."""
    host: str = "127.0.0.1"

    @property
    def store_url(self) -> str:
        return self.store or str(self.data_dir / "store")


def ensure_base_model(store: ObjectStore, slug: str = DEFAULT_MODEL) -> bool:
    """Creates the tiny model offline and commits it as ``slug``'s head when the slug is absent.

    Returns True when a model was created.
    """
    from yieldloop.errors import NotFoundError
    from yieldloop.services.common.tiny_model import create_tiny_model

    registry = CheckpointRegistry(store)
    try:
        registry.get_model(slug)
        return False
    except NotFoundError:
        pass
    with tempfile.TemporaryDirectory() as tmp:
        folder = create_tiny_model(pathlib.Path(tmp) / "model")
        objects = upload_folder(store, slug, BASE_CHECKPOINT, folder)
    registry.create_model(ModelInfo(slug=slug, base=slug, owner="yieldloop", trainable=True))
    registry.commit(Manifest(model=slug, checkpoint_id=BASE_CHECKPOINT, objects=objects), set_head=True)
    return True


def service_options(config: StackConfig, service: str, addresses: dict[str, str]) -> ServeOptions:
    """How ``service`` is started in a stack whose earlier services listen at ``addresses``."""
    return ServeOptions(
        service=service,
        data_dir=config.data_dir,
        store=config.store,
        host=config.host,
        model=config.model,
        checkpoint_address=addresses.get("checkpoint", ""),
        env_address=addresses.get("env", ""),
        env_specs=config.env_specs,
        env_workers=config.env_workers,
        engine=config.engine,
        http_port=config.http_port,
        device=config.device,
        trainer_dtype=config.trainer_dtype,
        nproc=config.nproc,
        keep_last=config.keep_last,
    )


class InProcessStack:
    """All four services in the current event loop, on free ports (for tests and embedding)."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.addresses: dict[str, str] = {}
        self._stoppers: list[Stopper] = []

    async def start(self) -> dict[str, str]:
        from yieldloop.services.store import open_store

        await asyncio.to_thread(ensure_base_model, open_store(self.config.store_url), self.config.model)
        for service in SERVICES:  # in dependency order
            start, stop = await build_service(service_options(self.config, service, self.addresses))
            self.addresses[service] = await start()
            self._stoppers.append(stop)
        return self.addresses

    async def stop(self, grace: float = 5.0) -> None:
        for stop in reversed(self._stoppers):
            await stop(grace)
        self._stoppers.clear()


class ProcessStack:
    """Each service in its own process (``yieldloop serve <service>``), as ``yieldloop up`` runs them."""

    def __init__(self, config: StackConfig, ready_timeout_s: float = 300.0) -> None:
        self.config = config
        self.ready_timeout_s = ready_timeout_s
        self.addresses: dict[str, str] = {}
        self.processes: dict[str, asyncio.subprocess.Process] = {}

    async def _spawn(self, service: str) -> None:
        run_dir = self.config.data_dir / "run"
        logs_dir = self.config.data_dir / "logs"
        run_dir.mkdir(parents=True, exist_ok=True)
        logs_dir.mkdir(parents=True, exist_ok=True)
        options = service_options(self.config, service, self.addresses)
        options.ready_file = run_dir / f"{service}.json"
        options.ready_file.unlink(missing_ok=True)
        with open(logs_dir / f"{service}.log", "ab") as log_file:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "yieldloop.cli", *options.to_args(),
                stdout=log_file, stderr=log_file, stdin=asyncio.subprocess.DEVNULL,
            )
        self.processes[service] = process
        deadline = time.monotonic() + self.ready_timeout_s
        while not options.ready_file.exists():
            if process.returncode is not None:
                raise RuntimeError(f"{service} exited with {process.returncode}; see {logs_dir / (service + '.log')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{service} not ready after {self.ready_timeout_s}s")
            await asyncio.sleep(0.1)
        self.addresses[service] = json.loads(options.ready_file.read_text())["address"]

    async def start(self) -> dict[str, str]:
        from yieldloop.services.store import open_store

        await asyncio.to_thread(ensure_base_model, open_store(self.config.store_url), self.config.model)
        try:
            await asyncio.gather(self._spawn("checkpoint"), self._spawn("env"))
            await asyncio.gather(self._spawn("trainer"), self._spawn("rollout"))
        except BaseException:
            await self.stop()
            raise
        return self.addresses

    async def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM (graceful stop), then SIGKILL for any process still alive after ``timeout_s``."""
        for process in self.processes.values():
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                await asyncio.wait_for(process.wait(), timeout_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        self.processes.clear()
