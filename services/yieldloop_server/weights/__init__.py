"""Weights in flight: every way a checkpoint's weights move between the trainer, the store and the fleet.

- :mod:`.base`: the interfaces, :class:`~.base.WeightSource` (trainer) and :class:`~.base.WeightSink` (rollout).
- :mod:`.files`: the checkpoint folder format (store keys, upload, verified download, checksums, finiteness).
- :mod:`.source`: the trainer's published folders (PullWeights in place or streamed; the weight group).
- :mod:`.sink`: the rollout's sinks, one class per transport (store, stream, group).
- :mod:`.group`: both halves of the broadcast protocol; :mod:`.collective`: its process groups.

Nothing here imports generated protobuf code: the servicers convert (:mod:`yieldloop.convert`).
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from yieldloop.client import Client
    from yieldloop_server.store import ObjectStore
    from yieldloop_server.weights.base import WeightSink, WeightSource

TRANSPORTS = ("auto", "stream", "group", "store")
"""How a rollout service gets a checkpoint's weights before the store has them (``--rollout-weights-from``)."""


def open_sink(
    transport: str,
    store: ObjectStore,
    checkpoints: Client,
    cache_dir: pathlib.Path,
    *,
    device: str = "cpu",
    in_use: Callable[[], Collection[tuple[str, str]]] = tuple,
) -> WeightSink:
    """The rollout side of ``transport``: "store" (durable checkpoints only), "stream" (pending ones pulled as a
    gRPC stream), "auto" (in place on the trainer's host, else streamed) or "group" (broadcast by the trainer's
    weight group: NCCL when ``device`` is CUDA and every member and the trainer have it, gloo otherwise)."""
    from yieldloop_server.weights.sink import GroupSink, PullSink, StoreSink

    if transport == "store":
        return StoreSink(store, checkpoints, cache_dir, in_use)
    if transport == "group":
        backend = "nccl" if device.startswith("cuda") else "gloo"
        return GroupSink(store, checkpoints, cache_dir, in_use, backend=backend)
    if transport in ("auto", "stream"):
        return PullSink(store, checkpoints, cache_dir, in_use, in_place=transport == "auto")
    raise ValueError(f"unknown weight transport {transport!r} (one of {', '.join(TRANSPORTS)})")


def open_source(work_dir: pathlib.Path, address: Callable[[], str], *, cuda: bool = False) -> WeightSource:
    """The trainer side: checkpoints published under ``work_dir``, served at ``address`` (pulled in place or
    streamed) and broadcast to each model's weight group (NCCL when ``cuda`` and every member asks for it)."""
    from yieldloop_server.weights.group import WeightGroups
    from yieldloop_server.weights.source import WeightPublisher

    return WeightPublisher(work_dir, address, WeightGroups(address, cuda=cuda))
