"""The rollout side of weights in flight: local, verified copies of checkpoints' sampler weights.

One class per transport, chosen once by the factory (:func:`yieldloop_server.weights.open_sink`):

- :class:`StoreSink`: durable checkpoints from the object store; a pending one (not in the store yet) is
  CHECKPOINT_PENDING.
- :class:`PullSink` (``stream``, ``auto``): a pending checkpoint straight from the trainer that committed it
  (PullWeights: a chunked stream; with ``auto`` its files in place when the trainer is on this host).
- :class:`GroupSink` (``group``): a member of the trainer's weight group, which broadcasts each checkpoint (see
  :class:`~yieldloop_server.weights.group.WeightSubscription`); a checkpoint not broadcast to it is pulled.

Every object is checked against the sha256 its producer computed, whichever way it came.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import pathlib
import shutil
from collections.abc import Callable, Collection

from yieldloop.client import RETRY, Client
from yieldloop.errors import DeadlineExceededError, FailedPreconditionError, NotFoundError, UnavailableError
from yieldloop.types import Manifest
from yieldloop_server.store import ObjectStore
from yieldloop_server.weights.files import download_verified, host_id, link_objects, staged, verify_folder
from yieldloop_server.weights.group import WeightSubscription

KEEP_CACHED = 4
"""Checkpoint folders kept per model in a rollout service's cache besides those engines serve: the most recently
used; older ones go, or a long run would fill the disk with a copy of every step's weights."""

PULL_ATTEMPTS = 8
"""Tries to pull a pending checkpoint's weights from its trainer (about 20 s with the client's backoff) before the
checkpoint is refused as unreachable (its trainer died: a rollback head follows)."""


def prune_cache(model_dir: pathlib.Path, in_use: Collection[str] = (), keep: int = KEEP_CACHED) -> None:
    """Removes the checkpoint folders of ``model_dir`` but the ``keep`` most recently used and those named in
    ``in_use`` (an engine serves them: a revived engine loads them again); staging folders of fetches in progress
    stay."""
    try:
        folders = [p for p in model_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]
    except OSError:
        return
    folders.sort(key=lambda p: p.stat().st_mtime_ns, reverse=True)
    for old in folders[keep:]:
        if old.name not in in_use:
            shutil.rmtree(old, ignore_errors=True)


class StoreSink:
    """Sampler weights (never the training state) of durable checkpoints, from the object store (a
    :class:`~yieldloop_server.weights.base.WeightSink`).

    Args:
        store: Object store holding the durable checkpoints.
        checkpoints: Client connected to CheckpointService.
        cache_dir: Local folder for verified copies (per model, the :data:`KEEP_CACHED` most recently used and
            those engines serve).
        in_use: (model, checkpoint id) of what engines serve now (their folders are never pruned).
    """

    def __init__(
        self,
        store: ObjectStore,
        checkpoints: Client,
        cache_dir: pathlib.Path,
        in_use: Callable[[], Collection[tuple[str, str]]] = tuple,
    ) -> None:
        self.store = store
        self.checkpoints = checkpoints
        self.cache_dir = cache_dir
        self.in_use = in_use
        self._pruning: asyncio.Task | None = None

    async def fetch(self, model: str, checkpoint_id: str, while_head: bool = False) -> pathlib.Path:
        """The local folder of one checkpoint's sampler weights. With ``while_head``, a pending checkpoint
        that stopped being the head (rolled back from) is given up at once.

        Raises:
            NotFoundError: CHECKPOINT_NOT_FOUND.
            FailedPreconditionError: CHECKPOINT_CORRUPT or NON_FINITE when an object fails verification;
                CHECKPOINT_PENDING when a pending checkpoint cannot be had (not in the store yet, and its trainer
                cannot be reached).
        """
        for attempt in itertools.count():
            manifest = await self.checkpoints.get_checkpoint(model, checkpoint_id)  # names checked there
            folder = self.cache_dir / model / manifest.checkpoint_id
            if folder.is_dir():
                return await self._used(folder)
            if not manifest.pending:
                await asyncio.to_thread(
                    download_verified, self.store, manifest, folder, manifest.sampler_objects, read_only=True
                )
                return await self._used(folder)
            try:
                return await self._used(await self._pending(manifest, folder))
            except (UnavailableError, NotFoundError, DeadlineExceededError) as err:
                # NOT_FOUND: the trainer released it, durable by now; UNAVAILABLE: the trainer is away.
                if attempt + 1 >= PULL_ATTEMPTS or (
                    while_head and (await self.checkpoints.get_head(model)).checkpoint_id != checkpoint_id
                ):
                    raise FailedPreconditionError(
                        f"checkpoint {model}/{checkpoint_id} is not in the store yet and its trainer "
                        f"({manifest.weights_source}) does not serve it: {err}",
                        reason="CHECKPOINT_PENDING",
                    ) from None
                await asyncio.sleep(RETRY.delay(attempt))
        raise AssertionError("unreachable")

    async def _pending(self, manifest: Manifest, folder: pathlib.Path) -> pathlib.Path:
        """A pending checkpoint's weights into ``folder`` (raises UNAVAILABLE to wait for it to become durable)."""
        raise UnavailableError(
            f"checkpoint {manifest.model}/{manifest.checkpoint_id} is not in the store yet", reason="CHECKPOINT_PENDING"
        )

    async def _used(self, folder: pathlib.Path) -> pathlib.Path:
        """Marks ``folder`` used now (the last of its model's to go); the model's older ones are pruned behind
        (not on the way to the engine)."""
        with contextlib.suppress(OSError):
            os.utime(folder)
        if self._pruning is None or self._pruning.done():
            model = folder.parent.name
            keep = {folder.name, *(cid for slug, cid in self.in_use() if slug == model)}
            self._pruning = asyncio.get_running_loop().create_task(asyncio.to_thread(prune_cache, folder.parent, keep))
        return folder

    async def close(self) -> None:
        if self._pruning is not None:
            await self._pruning


class PullSink(StoreSink):
    """A :class:`StoreSink` that pulls pending checkpoints from their trainer (PullWeights).

    Args:
        in_place: Ask for the trainer's files in place when it runs on this host (else always a stream).
    """

    def __init__(self, *args, in_place: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.in_place = in_place
        self._trainers: dict[str, Client] = {}

    def _trainer(self, address: str) -> Client:
        trainer = self._trainers.get(address)
        if trainer is None:
            trainer = self._trainers[address] = Client(
                trainer=address, transport=self.checkpoints.transport, retry_within_s=0
            )
        return trainer

    async def _pending(self, manifest: Manifest, folder: pathlib.Path) -> pathlib.Path:
        trainer = self._trainer(manifest.weights_source)
        what = f"checkpoint {manifest.model}/{manifest.checkpoint_id}"
        objects = {obj.name: obj for obj in manifest.sampler_objects}
        here = host_id() if self.in_place else ""
        with staged(folder) as staging:
            file = None
            try:
                async for piece in trainer.pull_weights(manifest.model, manifest.checkpoint_id, here):
                    if piece.local_folder:  # the same host: its files, in place
                        await asyncio.to_thread(
                            link_objects, pathlib.Path(piece.local_folder), staging, list(objects.values())
                        )
                        break
                    if file is None or file.name != str(staging / piece.name):
                        if piece.name not in objects or (staging / piece.name).exists():
                            raise FailedPreconditionError(
                                f"{what}: the trainer sent an unexpected object {piece.name[:80]!r}",
                                reason="CHECKPOINT_CORRUPT",
                            )
                        if file is not None:
                            file.close()
                        file = open(staging / piece.name, "wb")
                    file.write(piece.data)
            finally:
                if file is not None:
                    file.close()
            await asyncio.to_thread(verify_folder, staging, list(objects.values()), what)
        return folder

    async def close(self) -> None:
        await super().close()
        for client in self._trainers.values():
            await client.close()
        self._trainers.clear()


class GroupSink(PullSink):
    """A :class:`PullSink` that is a member of each trainer's weight group of the models it fetches: checkpoints
    come by broadcast; one that was not broadcast to it (the first, or after a failed broadcast) is pulled.

    Args:
        backend: What this service asks its weight groups for: "nccl" when its engine is on CUDA, else "gloo".
    """

    def __init__(self, *args, backend: str = "gloo", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.backend = backend
        self._subscriptions: dict[tuple[str, str], WeightSubscription] = {}

    async def _pending(self, manifest: Manifest, folder: pathlib.Path) -> pathlib.Path:
        key = (manifest.weights_source, manifest.model)
        subscription = self._subscriptions.get(key)
        if subscription is None:  # a member from now on: later checkpoints come by broadcast, this one is pulled
            for other in [k for k in self._subscriptions if k[1] == manifest.model]:  # its trainer moved
                await self._subscriptions.pop(other).close()
            self._subscriptions[key] = WeightSubscription(
                self._trainer(manifest.weights_source), manifest.model, self.cache_dir / manifest.model, self.backend
            )
        elif (arrived := await subscription.arrival(manifest.checkpoint_id)) is not None:
            return arrived
        return await super()._pending(manifest, folder)

    async def close(self) -> None:
        for subscription in self._subscriptions.values():
            await subscription.close()
        self._subscriptions.clear()
        await super().close()
