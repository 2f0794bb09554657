"""Follows a model's head: download, verify, hot-reload into the engine.

A checkpoint that fails verification is refused: the previous weights keep
serving and the error is kept for GetServingInfo and the logs.
"""

from __future__ import annotations

import asyncio
import logging
import pathlib
from typing import Any

from yieldloop.checkpoint.v1 import checkpoint_service_pb2 as ckpt_pb
from yieldloop.client import Client
from yieldloop.errors import FailedPreconditionError, UnavailableError, YieldloopError
from yieldloop.services.checkpoint.files import download_verified
from yieldloop.services.checkpoint.servicer import manifest_from_pb
from yieldloop.services.rollout.engines import Engine
from yieldloop.services.store import ObjectStore

log = logging.getLogger(__name__)


class WeightFollower:
    """Keeps ``engine`` on the head of ``model``.

    Args:
        engine: The engine to load weights into.
        model: The model slug whose head is followed.
        store: Object store holding the checkpoint objects.
        checkpoints: Client connected to CheckpointService.
        cache_dir: Local folder for verified checkpoint copies.
    """

    def __init__(
        self, engine: Engine, model: str, store: ObjectStore, checkpoints: Client, cache_dir: pathlib.Path
    ) -> None:
        self.engine = engine
        self.model = model
        self.store = store
        self.checkpoints = checkpoints
        self.cache_dir = cache_dir
        self.head_sequence = 0
        self.last_error = ""
        self.refused: dict[str, str] = {}
        """Checkpoint id -> why it was refused."""
        self.on_reload: Any = None
        """Optional ``async (ok: bool) -> None`` called after each head was handled (health reporting)."""
        self._changed = asyncio.Condition()

    async def run(self, retry_s: float = 1.0) -> None:
        """Watches the head forever, reconnecting when CheckpointService is unavailable."""
        while True:
            try:
                async for head in self.checkpoints.watch_head(self.model, self.head_sequence):
                    await self.load(head)
            except UnavailableError as err:
                log.warning("checkpoint service unavailable (%s); retrying", err)
            await asyncio.sleep(retry_s)

    async def load(self, head: ckpt_pb.Head) -> None:
        """Loads one head (or records why it was refused)."""
        try:
            manifest = manifest_from_pb(await self.checkpoints.get_checkpoint(self.model, head.checkpoint_id))
            folder = await asyncio.to_thread(
                download_verified, self.store, manifest, self.cache_dir / self.model / manifest.checkpoint_id
            )
            await self.engine.load_weights(folder, manifest.checkpoint_id)
            self.last_error = ""
        except Exception as err:  # deliberate degrade: refuse this head, keep serving the old weights
            log.error("refused checkpoint %s: %s", head.checkpoint_id, err, exc_info=not isinstance(err, YieldloopError))
            self.last_error = self.refused[head.checkpoint_id] = str(err)
        self.head_sequence = head.sequence
        if self.on_reload is not None:
            await self.on_reload(not self.last_error)
        async with self._changed:
            self._changed.notify_all()

    async def wait_loaded(self) -> None:
        """Returns once a first head was handled (loaded or refused)."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.head_sequence > 0)

    async def wait_for(self, checkpoint_id: str) -> None:
        """Returns once the engine serves ``checkpoint_id``.

        Raises:
            FailedPreconditionError: CHECKPOINT_CORRUPT when that checkpoint was refused.
        """
        async with self._changed:
            await self._changed.wait_for(
                lambda: self.engine.weight_version == checkpoint_id or checkpoint_id in self.refused
            )
        if self.engine.weight_version != checkpoint_id:
            raise FailedPreconditionError(
                f"checkpoint {checkpoint_id} was refused: {self.refused[checkpoint_id]}", reason="CHECKPOINT_CORRUPT"
            )
