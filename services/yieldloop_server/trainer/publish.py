"""Weights in flight: the sampler weights of the trainer's recent checkpoints, served to the fleet directly.

An optimizer step writes its checkpoint folder under ``published/<model>/<checkpoint_id>/`` and commits the
checkpoint *pending* with this trainer's address as its weights source; rollout services pull the sampler
weights from here (PullWeights: the folder itself on the same host, a chunked stream otherwise; or, members of
the model's weight group, receive them by broadcast: :mod:`.broadcast`) while the objects are written to the
store in the background. Folders stay while their checkpoint is pending and for
the last few after it became durable (followers still pulling), then go.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
from collections.abc import Callable

from yieldloop.types import Manifest
from yieldloop_server.trainer.broadcast import WeightGroups

KEEP_DURABLE = 2
"""Folders kept after their checkpoint became durable (pulls in progress finish from here)."""


ADVERTISE_VARIABLE = "YIELDLOOP_ADVERTISE_HOST"
"""The name other hosts reach this one by, when its hostname is not it (a StatefulSet pod: ``pod.service``)."""


def advertised(host: str, port: int) -> str:
    """The address other hosts reach a server bound to ``host:port`` at ("" before it is bound)."""
    if not port:
        return ""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = os.environ.get(ADVERTISE_VARIABLE) or socket.gethostname()
    return f"{host}:{port}"


class WeightPublisher:
    """The published checkpoint folders of every session of one TrainerService.

    Args:
        root: Where the folders live (the trainer's work directory).
        address: This TrainerService's address as rollout services reach it ("" until the server is bound:
            checkpoints are then written to the store before they are committed).
    """

    def __init__(
        self, root: pathlib.Path, address: Callable[[], str] = lambda: "", groups: WeightGroups | None = None
    ) -> None:
        self.root = root / "published"
        # Folders a previous process of this trainer left (killed before it released them): nobody serves them.
        shutil.rmtree(self.root, ignore_errors=True)
        self._address = address
        self.groups = groups
        """Broadcasts every published checkpoint to the model's subscribed rollout services (None: pulls only)."""
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
