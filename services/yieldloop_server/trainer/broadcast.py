"""Weights to the fleet by broadcast: a checkpoint's sampler weights sent once for every rollout service of a model.

Rollout services subscribe (SubscribeWeights) and become members of their model's weight group. When the trainer
publishes a checkpoint (before it commits it), the group is formed anew if members came or went since the last
broadcast (a process group of its own, see :mod:`yieldloop_server.common.collective`: the trainer is rank 0, the
members ranks 1..N; NCCL when the trainer and every member have CUDA, gloo otherwise): every member is told which
group to join, then which objects follow, and rank 0 broadcasts their bytes in pieces. Broadcasts of one model
go one after another, off the step's path (the step commits while the bytes are in flight). A broadcast that
fails (a member gone, a timeout) closes the group and ends every member's stream with UNAVAILABLE: they
subscribe again, and meanwhile pull (PullWeights).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import pathlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from yieldloop.errors import UnavailableError
from yieldloop.proto.trainer.v1 import trainer_service_pb2 as pb
from yieldloop.types import Manifest, ObjectInfo
from yieldloop_server.common import collective
from yieldloop_server.common.collective import broadcast_files, close_group, make_group, open_store

log = logging.getLogger(__name__)

CHUNK_BYTES = {"gloo": 4 << 20, "nccl": 64 << 20}
"""Bytes per broadcast piece, per backend: a bound on each side's buffer whatever a file's size (gloo over TCP
moves small pieces faster: one is written while the next arrives; NCCL wants large ones)."""


@dataclasses.dataclass(eq=False)
class _Member:
    backend: str
    queue: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    """Messages for the member's stream; an exception ends it."""


@dataclasses.dataclass(eq=False)
class _Generation:
    model: str
    name: str
    members: tuple[_Member, ...]
    backend: str
    group: Any = None
    failed: bool = False


class WeightGroups:
    """The weight groups of one TrainerService, one per model slug with subscribers.

    Args:
        host: The trainer's address as members reach it (its advertised name); the rendezvous store listens on
            every interface of that host, on a free port.
        cuda: The trainer trains on CUDA: its groups may be NCCL (when every member asked for it).
    """

    def __init__(self, host: Callable[[], str], cuda: bool = False) -> None:
        self._host = host
        self.cuda = cuda
        self._store: Any = None
        self._members: dict[str, list[_Member]] = {}
        self._generations: dict[str, _Generation] = {}
        self._sending: dict[str, asyncio.Task] = {}
        self._numbers = itertools.count(1)
        self._unopened: set[_Generation] = set()
        """Generations announced to their members and not opened yet (:func:`collective.open_group`)."""
        self._nccl_failed: set[str] = set()
        """Models whose NCCL group failed (e.g. two members on one GPU): their groups use gloo from then on."""

    def members(self, model: str) -> int:
        return len(self._members.get(model, ()))

    async def subscribe(self, model: str, backend: str) -> AsyncIterator[pb.SubscribeWeightsResponse]:
        """The stream of one member (see TrainerService.SubscribeWeights); membership ends with the stream."""
        member = _Member(backend)
        self._members.setdefault(model, []).append(member)
        try:
            yield pb.SubscribeWeightsResponse(subscribed=True)
            while True:
                message = await member.queue.get()
                if isinstance(message, BaseException):
                    raise message
                yield message
        finally:
            members = self._members.get(model, [])
            if member in members:
                members.remove(member)
            if not members:
                self._members.pop(model, None)

    def announce(self, manifest: Manifest, folder: pathlib.Path) -> None:
        """Broadcasts the sampler weights of ``manifest`` (files in ``folder``) to the model's members, if any:
        they are told now (before the commit that moves the head to it), the bytes follow in the background."""
        members = tuple(self._members.get(manifest.model, ()))
        if not members:
            return
        if self._store is None:
            self._store = open_store("0.0.0.0", 0, collective.GROUP_TIMEOUT_S, master=True)
        previous = self._generations.get(manifest.model)
        generation = previous
        if previous is None or previous.failed or previous.members != members:
            cuda = self.cuda and manifest.model not in self._nccl_failed and all(m.backend == "nccl" for m in members)
            generation = _Generation(
                manifest.model, f"{manifest.model}/{next(self._numbers)}/", members, "nccl" if cuda else "gloo"
            )
            self._generations[manifest.model] = generation
            self._unopened.add(generation)
            address = f"{self._host().rsplit(':', 1)[0]}:{self._store.port}"
            for rank, member in enumerate(members, 1):
                member.queue.put_nowait(
                    pb.SubscribeWeightsResponse(
                        group=pb.WeightGroup(
                            address=address,
                            name=generation.name,
                            rank=rank,
                            size=len(members) + 1,
                            backend=generation.backend,
                            wait_until_open=True,
                        )
                    )
                )
        assert generation is not None
        objects = list(manifest.sampler_objects)
        announcement = pb.SubscribeWeightsResponse(
            broadcast=pb.WeightBroadcast(
                checkpoint_id=manifest.checkpoint_id,
                chunk_bytes=CHUNK_BYTES[generation.backend],
                objects=[pb.WeightObject(name=o.name, size=o.size, sha256=o.sha256) for o in objects],
            )
        )
        for member in generation.members:
            member.queue.put_nowait(announcement)
        before = self._sending.get(manifest.model)
        retired = previous if previous is not generation else None
        self._sending[manifest.model] = asyncio.get_running_loop().create_task(
            self._send(before, retired, generation, folder, objects, manifest.checkpoint_id)
        )

    async def _send(
        self,
        before: asyncio.Task | None,
        retired: _Generation | None,
        generation: _Generation,
        folder: pathlib.Path,
        objects: list[ObjectInfo],
        checkpoint_id: str,
    ) -> None:
        if before is not None:
            await asyncio.wait([before])  # its outcome is its own (this task's cancellation still comes through)
        if retired is not None:
            await asyncio.to_thread(close_group, retired.group)
        if generation.failed:
            return
        try:
            if generation.group is None:
                self._unopened.discard(generation)
                generation.group = await asyncio.to_thread(self._form, generation)
            await asyncio.to_thread(
                broadcast_files,
                generation.group,
                generation.backend,
                objects,
                CHUNK_BYTES[generation.backend],
                source=folder,
            )
        except Exception as err:  # deliberate degrade: the members pull instead, and subscribe again
            log.warning(
                "broadcasting checkpoint %s to %d members failed (%s); they pull it instead",
                checkpoint_id,
                len(generation.members),
                err,
            )
            self._fail(generation, f"the weight group's broadcast of {checkpoint_id} failed: {err}")

    def _form(self, generation: _Generation) -> Any:
        """Opens the generation's group to its members (told of it when it was announced, they wait for this: the
        broadcast before it may have lasted longer than a join may take) and joins it as rank 0."""
        collective.open_group(self._store, generation.name)
        return make_group(
            self._store, generation.name, 0, len(generation.members) + 1, generation.backend, collective.GROUP_TIMEOUT_S
        )

    def _fail(self, generation: _Generation, why: str) -> None:
        """Ends the group and its members' streams; they are out at once (the next group is formed without them,
        not with members that will never join it), and subscribe again."""
        generation.failed = True
        self._unopened.discard(generation)
        collective.abandon_group(self._store, generation.name)  # members still waiting for it to open
        if generation.backend == "nccl":
            self._nccl_failed.add(generation.model)
        close_group(generation.group)
        generation.group = None
        members = self._members.get(generation.model, [])
        for member in generation.members:
            member.queue.put_nowait(UnavailableError(why, reason="WEIGHT_GROUP_UNAVAILABLE"))
            if member in members:
                members.remove(member)

    async def close(self) -> None:
        """Ends every broadcast and group (the members' streams end with the server)."""
        for task in self._sending.values():
            task.cancel()
        for task in self._sending.values():
            with contextlib.suppress(BaseException):
                await task
        for generation in self._unopened:  # their members would wait for them to open
            collective.abandon_group(self._store, generation.name)
        self._unopened.clear()
        for generation in self._generations.values():
            close_group(generation.group)
        self._generations.clear()
        self._sending.clear()
