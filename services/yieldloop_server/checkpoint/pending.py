"""Heads that name pending checkpoints: answered only while the trainer that committed them still serves them.

A trainer commits a step *pending* (HEAD moves at once, the fleet pulls the weights from the trainer) and writes
its objects to the store meanwhile. When that trainer dies first, the head names weights nobody can load. Every
GetHead that finds a pending head asks the trainer (PullWeights with ``probe``) whether it still holds the
checkpoint; when it does not, the registry settles the head itself (:meth:`CheckpointRegistry.settle_pending`:
sealed when every object reached the store, abandoned otherwise), without waiting for the trainer to come back.

Plain Python: the probe is handed in.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable

from yieldloop.types import Head, Manifest
from yieldloop_server.checkpoint.registry import CheckpointRegistry

KNOWN_DURABLE = 4096
"""(model, checkpoint id) of heads seen durable, remembered (a durable checkpoint never becomes pending)."""


class PendingHeads:
    """Settles pending heads whose trainer is gone, once per head at a time.

    Args:
        registry: The registry the heads live in.
        holds: Whether the checkpoint's trainer (``manifest.weights_source``) is alive and still serves it.
    """

    def __init__(self, registry: CheckpointRegistry, holds: Callable[[Manifest], Awaitable[bool]]) -> None:
        self.registry = registry
        self.holds = holds
        self._durable: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._locks: dict[str, asyncio.Lock] = {}

    async def settled(self, head: Head) -> Head:
        """``head`` when it is loadable (durable, or pending and served by its live trainer); otherwise the head
        after settling it (sealed, or gone back to the nearest durable ancestor)."""
        if (head.model, head.checkpoint_id) in self._durable:
            return head
        manifest = await asyncio.to_thread(self.registry.get_manifest, head.model, head.checkpoint_id)
        if not manifest.pending:
            self._remember(head)
            return head
        if await self.holds(manifest):
            return head
        async with self._locks.setdefault(head.model, asyncio.Lock()):  # one settles; the others read what it left
            return await asyncio.to_thread(self.registry.settle_pending, head.model, head)

    def _remember(self, head: Head) -> None:
        self._durable[head.model, head.checkpoint_id] = None
        while len(self._durable) > KNOWN_DURABLE:
            self._durable.popitem(last=False)
