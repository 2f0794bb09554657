"""The two interfaces of weights in flight: a source on the trainer's side, a sink on the rollout's.

A checkpoint's sampler weights leave the trainer through its :class:`WeightSource` (before the store has them:
the checkpoint is committed *pending* naming the trainer as its weights source) and reach an engine through a
:class:`WeightSink`, which returns a local folder verified against the sha256 of every object. Which transport
a sink uses (the store, a stream, in place on the same host, a broadcast group) is chosen once by
:func:`yieldloop_server.weights.open_sink`; a sharded trainer plugs in as another source.
"""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator
from typing import Protocol

from yieldloop.types import Manifest, WeightEvent, WeightPiece


class WeightSource(Protocol):
    """The trainer's side: the folders of the checkpoints it publishes, served until released."""

    @property
    def address(self) -> str:
        """This trainer's address as the fleet reaches it ("" while it serves nothing: write to the store
        first)."""
        ...

    def folder(self, model: str, checkpoint_id: str) -> pathlib.Path:
        """Where a step writes the checkpoint's files before it publishes them."""
        ...

    def publish(self, manifest: Manifest) -> None:
        """Serves the checkpoint's sampler weights and announces them to the model's subscribers (before the
        commit that moves the head to it)."""
        ...

    def find(self, model: str, checkpoint_id: str) -> tuple[Manifest, pathlib.Path] | None:
        """The manifest and folder of a checkpoint served now, or None."""
        ...

    def pull(self, model: str, checkpoint_id: str, host: str = "", probe: bool = False) -> AsyncIterator[WeightPiece]:
        """A served checkpoint's sampler weights (PullWeights)."""
        ...

    def subscribe(self, model: str, backend: str) -> AsyncIterator[WeightEvent]:
        """A rollout service's membership in the model's weight group (SubscribeWeights)."""
        ...

    def members(self, model: str) -> int:
        """Rollout services subscribed for ``model`` now."""
        ...

    def durable(self, model: str, checkpoint_id: str) -> None:
        """The checkpoint reached the store (its folder may go once pulls in progress are done)."""
        ...

    def release(self, model: str, checkpoint_id: str) -> None:
        """Stops serving a checkpoint (its step failed, or it is long durable)."""
        ...

    def release_model(self, model: str) -> None:
        """Stops serving every checkpoint of ``model``."""
        ...

    async def close(self) -> None: ...


class WeightSink(Protocol):
    """The rollout's side: a verified local folder of a checkpoint's sampler weights, however they travel."""

    checkpoints: object
    """The CheckpointService client (manifests and heads)."""

    async def fetch(self, model: str, checkpoint_id: str, while_head: bool = False) -> pathlib.Path:
        """The folder of one checkpoint's sampler weights (``while_head``: give a pending checkpoint up once the
        head left it)."""
        ...

    async def close(self) -> None: ...
