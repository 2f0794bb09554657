"""Weights to the fleet by broadcast: a checkpoint's sampler weights sent once for every rollout service of a model.

Both halves of the group protocol live here: :class:`WeightGroups` (the trainer's) and :class:`WeightSubscription`
(a rollout service's). Rollout services subscribe (SubscribeWeights) and become members of their model's weight
group. When the trainer publishes a checkpoint (before it commits it), the group is formed anew if members came or
went since the last broadcast (a process group of its own, see :mod:`.collective`: the trainer is rank 0, the
members ranks 1..N; NCCL when the trainer and every member have CUDA, gloo otherwise): every member is told which
group to join, then which objects follow, and rank 0 broadcasts their bytes in pieces. Broadcasts of one model go
one after another, off the step's path (the step commits while the bytes are in flight). A broadcast that fails (a
member gone, a timeout) closes the group and ends every member's stream with UNAVAILABLE: they subscribe again, and
meanwhile pull (PullWeights).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import pathlib
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from yieldloop.client import RETRY, Client
from yieldloop.errors import UnavailableError, YieldloopError
from yieldloop.types import (
    Manifest,
    ObjectInfo,
    WeightBroadcast,
    WeightEvent,
    WeightGroup,
    WeightSubscribed,
)
from yieldloop_server.store.base import check_name
from yieldloop_server.weights import collective
from yieldloop_server.weights.collective import broadcast_files, close_group, make_group, open_store
from yieldloop_server.weights.files import staged, verify_folder

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

    async def subscribe(self, model: str, backend: str) -> AsyncIterator[WeightEvent]:
        """The stream of one member (see TrainerService.SubscribeWeights); membership ends with the stream."""
        member = _Member(backend)
        self._members.setdefault(model, []).append(member)
        try:
            yield WeightSubscribed()
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
                    WeightGroup(address, generation.name, rank, len(members) + 1, generation.backend, True)
                )
        assert generation is not None
        objects = list(manifest.sampler_objects)
        announcement = WeightBroadcast(
            manifest.checkpoint_id,
            CHUNK_BYTES[generation.backend],
            tuple(ObjectInfo(o.name, o.size, o.sha256, key="") for o in objects),
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


ANNOUNCE_GRACE_S = 1.0
"""How long a member waits for a pending checkpoint's announcement before pulling it: its trainer announces
before committing, so the announcement is usually there before the head move that asks for it."""


JOIN_GRACE_S = 10.0
"""How long that wait goes on while this member joins a new group (NCCL connects in seconds; a group whose other
member never joins fails only after GROUP_TIMEOUT_S: the checkpoint is pulled meanwhile)."""


class WeightSubscription:
    """This rollout service's membership in one trainer's weight group for one model (SubscribeWeights): joins
    each group the trainer names, receives every checkpoint it broadcasts into ``cache`` (verified against the
    announced sizes and sha256, then renamed into place, as a download), and subscribes again after any failure
    (meanwhile checkpoints are pulled).

    Args:
        trainer: Client of the trainer.
        model: The model slug followed.
        cache: The model's folder of verified checkpoints (``cache/<checkpoint_id>``).
        backend: "nccl" when this service's engine is on CUDA (the group is NCCL if every member and the trainer
            are), else "gloo".
    """

    KEEP = 16
    """Arrivals remembered (checkpoint id -> outcome) for fetches that come late."""

    def __init__(self, trainer: Client, model: str, cache: pathlib.Path, backend: str = "gloo") -> None:
        self.trainer = trainer
        self.model = model
        self.cache = cache
        self.backend = backend
        self.subscribed = False
        self._joining = False
        self._joined_at = 0.0
        """When the last join ended (loop time)."""
        self.received = 0
        """Checkpoints received by broadcast."""
        self._arrivals: collections.OrderedDict[str, asyncio.Future[pathlib.Path]] = collections.OrderedDict()
        self._announced = asyncio.Condition()
        self._stopped = threading.Event()
        """Set when closing: a thread waiting for a group to open stops waiting."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def arrival(self, checkpoint_id: str) -> pathlib.Path | None:
        """The folder of ``checkpoint_id`` once its broadcast arrived and verified; None when it was not (or will
        not be) broadcast to this member, or its broadcast failed: pull it."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with self._announced:
            # While a group is being joined the announcements behind it wait: so does this, a while longer.
            while self.subscribed and checkpoint_id not in self._arrivals:
                # A group just joined: the announcement behind it is the stream's next message.
                left = (
                    started + JOIN_GRACE_S if self._joining else max(started, self._joined_at) + ANNOUNCE_GRACE_S
                ) - loop.time()
                if left <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._announced.wait(), left)
        future = self._arrivals.get(checkpoint_id)
        if future is None:
            return None
        try:
            return await asyncio.shield(future)
        except YieldloopError as err:
            log.warning("checkpoint %s/%s did not arrive by broadcast (%s); pulling it", self.model, checkpoint_id, err)
            return None

    async def _run(self) -> None:
        attempt = 0
        while True:
            group: tuple[Any, str] | None = None  # (process group, backend)
            try:
                async for event in self.trainer.subscribe_weights(self.model, self.backend):
                    if isinstance(event, WeightSubscribed):
                        self.subscribed, attempt = True, 0
                    elif isinstance(event, WeightGroup):
                        if group is not None:
                            await asyncio.to_thread(close_group, group[0])
                        group = None
                        await self._set_joining(True)
                        try:
                            group = (await asyncio.to_thread(_join, event, self._stopped), event.backend)
                        finally:
                            await self._set_joining(False)
                    elif isinstance(event, WeightBroadcast):
                        if group is None:
                            raise UnavailableError(
                                "a broadcast was announced before any group", reason="WEIGHT_GROUP_UNAVAILABLE"
                            )
                        await self._receive(group, event)
                raise UnavailableError("the weight group's stream ended", reason="WEIGHT_GROUP_UNAVAILABLE")
            except asyncio.CancelledError:
                raise
            except Exception as err:  # deliberate degrade: pull meanwhile, subscribe again
                log.warning("out of the weight group of %s (%s); subscribing again", self.model, err)
            finally:
                self.subscribed = False
                self._fail_waiting("this member left its weight group")
                with contextlib.suppress(BaseException):
                    await self._set_joining(False)
                if group is not None:
                    close_group(group[0])
            await asyncio.sleep(RETRY.delay(attempt))
            attempt += 1

    async def _receive(self, group: tuple[Any, str], announcement: WeightBroadcast) -> None:
        """Takes part in one broadcast (always: the others wait for every member), then verifies what came."""
        checkpoint_id = announcement.checkpoint_id
        future: asyncio.Future[pathlib.Path] = asyncio.get_running_loop().create_future()
        async with self._announced:
            self._arrivals[checkpoint_id] = future
            while len(self._arrivals) > self.KEEP:  # a fetch still waiting on one holds it
                self._arrivals.popitem(last=False)
            self._announced.notify_all()
        objects = list(announcement.objects)
        what = f"checkpoint {self.model}/{checkpoint_id} (broadcast)"
        try:
            check_name(checkpoint_id, "checkpoint_id")
            for obj in objects:
                check_name(obj.name, "objects.name")
        except YieldloopError as err:  # a trainer that names files out of the cache: out of its group
            _settle(future, err)
            raise
        try:
            with staged(self.cache / checkpoint_id) as staging:
                try:
                    digests = await asyncio.to_thread(
                        broadcast_files, group[0], group[1], objects, max(1, announcement.chunk_bytes), target=staging
                    )
                except Exception as err:  # the group is broken: every member subscribes again
                    raise _GroupBroken(f"{what}: {err}") from err
                await asyncio.to_thread(verify_folder, staging, objects, what, digests)
        except _GroupBroken as err:
            raise _settle(future, UnavailableError(str(err), reason="WEIGHT_GROUP_UNAVAILABLE")) from None
        except Exception as err:  # this checkpoint only (it failed verification): it is pulled instead
            _settle(
                future,
                err
                if isinstance(err, YieldloopError)
                else UnavailableError(f"{what}: {err}", reason="WEIGHT_GROUP_UNAVAILABLE"),
            )
            return
        self.received += 1
        future.set_result(self.cache / checkpoint_id)

    async def _set_joining(self, joining: bool) -> None:
        async with self._announced:
            self._joining = joining
            if not joining:
                self._joined_at = asyncio.get_running_loop().time()
            self._announced.notify_all()

    def _fail_waiting(self, why: str) -> None:
        for future in self._arrivals.values():
            if not future.done():
                _settle(future, UnavailableError(why, reason="WEIGHT_GROUP_UNAVAILABLE"))

    async def close(self) -> None:
        self._stopped.set()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def _settle(future: asyncio.Future, error: Exception) -> Exception:
    """Fails ``future`` with ``error`` (marked retrieved: most arrivals are never awaited); returns ``error``."""
    future.set_exception(error)
    future.exception()
    return error


class _GroupBroken(Exception):
    """A broadcast piece failed: the group is unusable."""


def _join(group: WeightGroup, stopped: threading.Event) -> Any:
    """Joins the process group a WeightGroup message names once the trainer opened it (it does when its previous
    broadcast ended, which for a large model can take longer than a join may: see :func:`collective.wait_opened`;
    at once for a trainer that does not say it opens groups), then blocks until every member and the trainer have
    joined."""
    host, port = group.address.rsplit(":", 1)
    store = open_store(host.strip("[]"), int(port), collective.GROUP_TIMEOUT_S)
    if group.wait_until_open:
        collective.wait_opened(store, group.name, stopped)
    return make_group(store, group.name, group.rank, group.size, group.backend, collective.GROUP_TIMEOUT_S)
