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
import os
import pathlib
import signal
import sys
import tempfile
import time

from yieldloop.services.checkpoint.files import upload_folder
from yieldloop.services.checkpoint.registry import CheckpointRegistry, Manifest, ModelInfo
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
    model: str = DEFAULT_MODEL
    """Model slug served and trained (created offline when absent)."""
    env_specs: tuple[str, ...] = ("yieldloop.envs.letters:env",)
    """Environments EnvService loads (``module:attr`` or ``file.py:attr``)."""
    engine: str = "torch"
    device: str = "cpu"
    host: str = "127.0.0.1"

    @property
    def store_dir(self) -> pathlib.Path:
        return self.data_dir / "store"


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


class InProcessStack:
    """All four services in the current event loop, on free ports (for tests and embedding)."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.addresses: dict[str, str] = {}
        self._stoppers: list = []

    async def start(self) -> dict[str, str]:
        from yieldloop.services.checkpoint import server as checkpoint_server
        from yieldloop.services.env import server as env_server
        from yieldloop.services.env.loader import load_environment
        from yieldloop.services.rollout.server import RolloutServer
        from yieldloop.services.store import open_store
        from yieldloop.services.trainer import server as trainer_server
        from yieldloop.services.trainer.trainer import TrainerConfig

        cfg = self.config
        store = open_store(str(cfg.store_dir))
        await asyncio.to_thread(ensure_base_model, store, cfg.model)
        checkpoint = checkpoint_server.build(store, cfg.host)
        self.addresses["checkpoint"] = await checkpoint.start()
        self._stoppers.append(checkpoint.stop)
        env = env_server.build([load_environment(s) for s in cfg.env_specs], cfg.host)
        self.addresses["env"] = await env.start()
        self._stoppers.append(env.stop)
        trainer, servicer = await trainer_server.build(
            cfg.model, store, self.addresses["checkpoint"], cfg.data_dir / "work" / "trainer",
            TrainerConfig(device=cfg.device), cfg.host,
        )
        self.addresses["trainer"] = await trainer.start()
        self._stoppers += [trainer.stop, servicer.close]
        rollout = RolloutServer(
            cfg.model, store, self.addresses["checkpoint"], self.addresses["env"],
            cfg.data_dir / "work" / "rollout", cfg.engine, cfg.host, device=cfg.device,
        )
        self.addresses["rollout"] = await rollout.start()
        self._stoppers.append(rollout.stop)
        return self.addresses

    async def stop(self) -> None:
        for stop in reversed(self._stoppers):
            await stop()
        self._stoppers.clear()


class ProcessStack:
    """Each service in its own process (``yieldloop serve <service>``), as ``yieldloop up`` runs them."""

    def __init__(self, config: StackConfig, ready_timeout_s: float = 300.0) -> None:
        self.config = config
        self.ready_timeout_s = ready_timeout_s
        self.addresses: dict[str, str] = {}
        self.processes: dict[str, asyncio.subprocess.Process] = {}

    def _command(self, service: str, ready_file: pathlib.Path) -> list[str]:
        cfg = self.config
        cmd = [
            sys.executable, "-m", "yieldloop.cli", "serve", service,
            "--host", cfg.host, "--port", "0", "--data-dir", str(cfg.data_dir),
            "--model", cfg.model, "--ready-file", str(ready_file), "--device", cfg.device,
        ]
        if service in ("trainer", "rollout"):
            cmd += ["--checkpoint-address", self.addresses["checkpoint"]]
        if service == "rollout":
            cmd += ["--env-address", self.addresses["env"], "--engine", cfg.engine]
        if service == "env":
            for spec in cfg.env_specs:
                cmd += ["--env-spec", spec]
        return cmd

    async def _spawn(self, service: str) -> None:
        run_dir = self.config.data_dir / "run"
        logs_dir = self.config.data_dir / "logs"
        run_dir.mkdir(parents=True, exist_ok=True)
        logs_dir.mkdir(parents=True, exist_ok=True)
        ready_file = run_dir / f"{service}.json"
        ready_file.unlink(missing_ok=True)
        with open(logs_dir / f"{service}.log", "ab") as log_file:
            process = await asyncio.create_subprocess_exec(
                *self._command(service, ready_file), stdout=log_file, stderr=log_file, stdin=asyncio.subprocess.DEVNULL
            )
        self.processes[service] = process
        deadline = time.monotonic() + self.ready_timeout_s
        while not ready_file.exists():
            if process.returncode is not None:
                raise RuntimeError(f"{service} exited with {process.returncode}; see {logs_dir / (service + '.log')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{service} not ready after {self.ready_timeout_s}s")
            await asyncio.sleep(0.1)
        self.addresses[service] = json.loads(ready_file.read_text())["address"]

    async def start(self) -> dict[str, str]:
        from yieldloop.services.store import open_store

        await asyncio.to_thread(ensure_base_model, open_store(str(self.config.store_dir)), self.config.model)
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


def write_ready_file(path: pathlib.Path, address: str) -> None:
    """Atomically records a started service's address."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"address": address, "pid": os.getpid()}))
    tmp.replace(path)
