"""The trainer's side of weights in flight: the sampler weights of its recent checkpoints, served to the fleet.

An optimizer step writes its checkpoint folder under ``published/<model>/<checkpoint_id>/`` and commits the
checkpoint *pending* with this trainer's address as its weights source; rollout services pull the sampler
weights from here (:meth:`WeightPublisher.pull`: the folder itself on the same host, a chunked stream otherwise;
or, members of the model's weight group, receive them by broadcast: :mod:`.group`) while the objects are written
to the store in the background. Folders stay while their checkpoint is pending and for the last few after it
became durable (followers still pulling), then go.
"""

from __future__ import annotations

import asyncio
import pathlib
import shutil
from collections.abc import AsyncIterator, Callable

from yieldloop.errors import NotFoundError, UnavailableError, invalid_field
from yieldloop.types import Manifest, WeightEvent, WeightPiece
from yieldloop_server.store.base import check_name
from yieldloop_server.weights.collective import BACKENDS
from yieldloop_server.weights.files import host_id
from yieldloop_server.weights.group import WeightGroups

PULL_CHUNK_BYTES = 1 << 20
"""Bytes per piece of a streamed pull."""

KEEP_DURABLE = 2
"""Folders kept after their checkpoint became durable (pulls in progress finish from here)."""


class WeightPublisher:
    """The published checkpoint folders of every session of one TrainerService (a :class:`WeightSource`).

    Args:
        root: Where the folders live (the trainer's work directory).
        address: This TrainerService's address as rollout services reach it ("" until the server is bound:
            checkpoints are then written to the store before they are committed).
        groups: Broadcasts every published checkpoint to the model's subscribed rollout services (None: pulls
            only).
    """

    def __init__(
        self, root: pathlib.Path, address: Callable[[], str] = lambda: "", groups: WeightGroups | None = None
    ) -> None:
        self.root = root / "published"
        # Folders a previous process of this trainer left (killed before it released them): nobody serves them.
        shutil.rmtree(self.root, ignore_errors=True)
        self._address = address
        self.groups = groups
        self._manifests: dict[tuple[str, str], Manifest] = {}
        self._durable: dict[str, list[str]] = {}
        """Per model: published checkpoints already durable, oldest first."""

    @property
    def address(self) -> str:
        return self._address()

    def folder(self, model: str, checkpoint_id: str) -> pathlib.Path:
        return self.root / model / checkpoint_id

    def publish(self, manifest: Manifest) -> None:
        """Serves the sampler weights of ``manifest`` (written into :meth:`folder`) until :meth:`release`, and
        broadcasts them to the model's weight group (members are told before the checkpoint is committed)."""
        self._manifests[manifest.model, manifest.checkpoint_id] = manifest
        if self.groups is not None:
            self.groups.announce(manifest, self.folder(manifest.model, manifest.checkpoint_id))

    def find(self, model: str, checkpoint_id: str) -> tuple[Manifest, pathlib.Path] | None:
        """The manifest and folder of a checkpoint this trainer still serves, or None."""
        manifest = self._manifests.get((model, checkpoint_id))
        return None if manifest is None else (manifest, self.folder(model, checkpoint_id))

    async def pull(
        self, model: str, checkpoint_id: str, host: str = "", probe: bool = False
    ) -> AsyncIterator[WeightPiece]:
        """The sampler weights of a checkpoint this trainer holds: the folder in place for a caller on this host
        (``host`` is its :func:`host_id`), else every object in pieces; ``probe``: one empty piece.

        Raises:
            NotFoundError: CHECKPOINT_NOT_FOUND when it holds none (released: read it from the store).
        """
        held = self.find(model, checkpoint_id)
        if held is None:
            raise NotFoundError(
                f"this trainer does not hold checkpoint {model}/{checkpoint_id}: read it from the store",
                reason="CHECKPOINT_NOT_FOUND",
            )
        manifest, folder = held
        if probe:
            yield WeightPiece()
            return
        if host and host == host_id():
            yield WeightPiece(local_folder=str(folder))
            return
        for obj in manifest.sampler_objects:
            with open(folder / obj.name, "rb") as file:
                while chunk := await asyncio.to_thread(file.read, PULL_CHUNK_BYTES):
                    yield WeightPiece(name=obj.name, data=chunk)

    def members(self, model: str) -> int:
        """Rollout services in the model's weight group now."""
        return self.groups.members(model) if self.groups is not None else 0

    def subscribe(self, model: str, backend: str) -> AsyncIterator[WeightEvent]:
        """One rollout service's membership in the model's weight group (see :meth:`WeightGroups.subscribe`).

        Raises:
            UnavailableError: WEIGHT_GROUP_UNAVAILABLE when this trainer broadcasts nothing (pull instead).
        """
        check_name(model, "model")
        if backend not in BACKENDS:
            raise invalid_field("backend", f"backend {backend!r:.40} must be one of {', '.join(BACKENDS)}")
        if self.groups is None:
            raise UnavailableError("this trainer broadcasts no weights: pull them", reason="WEIGHT_GROUP_UNAVAILABLE")
        return self.groups.subscribe(model, backend)

    async def close(self) -> None:
        if self.groups is not None:
            await self.groups.close()

    def durable(self, model: str, checkpoint_id: str) -> None:
        """The checkpoint reached the store: its folder goes once :data:`KEEP_DURABLE` newer ones are durable."""
        done = self._durable.setdefault(model, [])
        done.append(checkpoint_id)
        while len(done) > KEEP_DURABLE:
            self.release(model, done.pop(0))

    def release(self, model: str, checkpoint_id: str) -> None:
        """Stops serving a checkpoint and removes its folder."""
        self._manifests.pop((model, checkpoint_id), None)
        shutil.rmtree(self.folder(model, checkpoint_id), ignore_errors=True)

    def release_model(self, model: str) -> None:
        """Stops serving every checkpoint of ``model`` (its session closed, everything durable)."""
        for slug, checkpoint_id in list(self._manifests):
            if slug == model:
                self.release(slug, checkpoint_id)
        self._durable.pop(model, None)
        shutil.rmtree(self.root / model, ignore_errors=True)
