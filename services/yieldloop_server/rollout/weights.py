"""Follows a model's head: fetch (from the store, or from the trainer while a checkpoint is pending), verify,
hot-reload into the engine.

A checkpoint that fails verification is refused: the previous weights keep
serving and the error is kept for GetServingInfo and the logs.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import pathlib
import shutil
import threading
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any

from yieldloop.client import RETRY, Client
from yieldloop.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    NotFoundError,
    UnavailableError,
    YieldloopError,
)
from yieldloop.retry import Backoff
from yieldloop.types import Head, Manifest, ObjectInfo
from yieldloop_server.checkpoint.files import download_verified, host_id, link_objects, staged, verify_folder
from yieldloop_server.common import collective, telemetry
from yieldloop_server.common.collective import broadcast_files, close_group, make_group, open_store
from yieldloop_server.rollout.engines import Engine
from yieldloop_server.store import ObjectStore
from yieldloop_server.store.base import check_name

log = logging.getLogger(__name__)


KEEP_CACHED = 4
"""Checkpoint folders kept per model in a rollout service's cache besides those engines serve: the most recently
used; older ones go, or a long run would fill the disk with a copy of every step's weights."""


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


PULL_ATTEMPTS = 8
"""Tries to pull a pending checkpoint's weights from its trainer (about 20 s with the client's backoff) before the
checkpoint is refused as unreachable (its trainer died: a rollback head follows)."""


class CheckpointFetcher:
    """Local, verified copies of checkpoints' sampler weights (never the training state): from the object store,
    or, while a checkpoint is pending (not yet in the store), straight from the trainer that committed it
    (PullWeights: its files in place on the same host, a stream otherwise; or by broadcast, see ``weights_from``).
    Every object is checked against the sha256 its producer computed.

    Args:
        store: Object store holding the durable checkpoints.
        checkpoints: Client connected to CheckpointService.
        cache_dir: Local folder for verified copies (per model, the :data:`KEEP_CACHED` most recently used and
            those engines serve).
    """

    def __init__(
        self,
        store: ObjectStore,
        checkpoints: Client,
        cache_dir: pathlib.Path,
        weights_from: str = "auto",
        device: str = "cpu",
        in_use: Callable[[], Collection[tuple[str, str]]] = tuple,
    ) -> None:
        self.store = store
        self.checkpoints = checkpoints
        self.cache_dir = cache_dir
        self.weights_from = weights_from
        """How pending checkpoints come from their trainer: "auto" (the files in place on the trainer's host, a
        stream otherwise), "stream" (always a stream), "group" (by broadcast in the trainer's weight group, see
        :class:`WeightSubscription`; pulled as "auto" when a checkpoint was not broadcast to this service)."""
        self.in_use = in_use
        """(model, checkpoint id) of what engines serve now (their folders are never pruned)."""
        self.group_backend = "nccl" if device.startswith("cuda") else "gloo"
        """What this service asks its weight groups for: NCCL when its engine is on CUDA."""
        self._trainers: dict[str, Client] = {}
        self._subscriptions: dict[tuple[str, str], WeightSubscription] = {}
        self._pruning: asyncio.Task | None = None

    async def fetch(self, model: str, checkpoint_id: str, while_head: bool = False) -> pathlib.Path:
        """The local folder of one checkpoint's sampler weights. With ``while_head``, a pending checkpoint
        that stopped being the head (rolled back from) is given up at once.

        Raises:
            NotFoundError: CHECKPOINT_NOT_FOUND.
            FailedPreconditionError: CHECKPOINT_CORRUPT or NON_FINITE when an object fails verification;
                CHECKPOINT_PENDING when a pending checkpoint's trainer cannot be reached.
        """
        for attempt in itertools.count():
            manifest = await self.checkpoints.get_checkpoint(model, checkpoint_id)  # names checked there
            folder = self.cache_dir / model / manifest.checkpoint_id
            if folder.is_dir():
                return await self._used(folder)
            if not manifest.pending:
                await asyncio.to_thread(download_verified, self.store, manifest, folder, manifest.sampler_objects)
                return await self._used(folder)
            try:
                return await self._used(await self._pull(manifest, folder))
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

    def _trainer(self, address: str) -> Client:
        trainer = self._trainers.get(address)
        if trainer is None:
            trainer = self._trainers[address] = Client(
                trainer=address, transport=self.checkpoints.transport, retry_within_s=0
            )
        return trainer

    async def _pull(self, manifest: Manifest, folder: pathlib.Path) -> pathlib.Path:
        if self.weights_from == "group":
            key = (manifest.weights_source, manifest.model)
            subscription = self._subscriptions.get(key)
            if subscription is None:  # a member from now on: later checkpoints come by broadcast, this one is pulled
                for other in [k for k in self._subscriptions if k[1] == manifest.model]:  # its trainer moved
                    await self._subscriptions.pop(other).close()
                subscription = self._subscriptions[key] = WeightSubscription(
                    self._trainer(manifest.weights_source),
                    manifest.model,
                    self.cache_dir / manifest.model,
                    self.group_backend,
                )
            elif (arrived := await subscription.arrival(manifest.checkpoint_id)) is not None:
                return arrived
        trainer = self._trainer(manifest.weights_source)
        what = f"checkpoint {manifest.model}/{manifest.checkpoint_id}"
        objects = {obj.name: obj for obj in manifest.sampler_objects}
        here = host_id() if self.weights_from != "stream" else ""
        with staged(folder) as staging:
            file = None
            try:
                async for message in trainer.pull_weights(manifest.model, manifest.checkpoint_id, here):
                    if message.local_folder:  # the same host: its files, in place
                        await asyncio.to_thread(
                            link_objects, pathlib.Path(message.local_folder), staging, list(objects.values())
                        )
                        break
                    if file is None or file.name != str(staging / message.name):
                        if message.name not in objects or (staging / message.name).exists():
                            raise FailedPreconditionError(
                                f"{what}: the trainer sent an unexpected object {message.name[:80]!r}",
                                reason="CHECKPOINT_CORRUPT",
                            )
                        if file is not None:
                            file.close()
                        file = open(staging / message.name, "wb")
                    file.write(message.data)
            finally:
                if file is not None:
                    file.close()
            await asyncio.to_thread(verify_folder, staging, list(objects.values()), what)
        return folder

    async def close(self) -> None:
        if self._pruning is not None:
            await self._pruning
        for subscription in self._subscriptions.values():
            await subscription.close()
        self._subscriptions.clear()
        for client in self._trainers.values():
            await client.close()
        self._trainers.clear()


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
                async for message in self.trainer.subscribe_weights(self.model, self.backend):
                    event = message.WhichOneof("event")
                    if event == "subscribed":
                        self.subscribed, attempt = True, 0
                    elif event == "group":
                        if group is not None:
                            await asyncio.to_thread(close_group, group[0])
                        group = None
                        await self._set_joining(True)
                        try:
                            group = (
                                await asyncio.to_thread(_join, message.group, self._stopped),
                                message.group.backend,
                            )
                        finally:
                            await self._set_joining(False)
                    elif event == "broadcast":
                        if group is None:
                            raise UnavailableError(
                                "a broadcast was announced before any group", reason="WEIGHT_GROUP_UNAVAILABLE"
                            )
                        await self._receive(group, message.broadcast)
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

    async def _receive(self, group: tuple[Any, str], announcement: Any) -> None:
        """Takes part in one broadcast (always: the others wait for every member), then verifies what came."""
        checkpoint_id = announcement.checkpoint_id
        future: asyncio.Future[pathlib.Path] = asyncio.get_running_loop().create_future()
        async with self._announced:
            self._arrivals[checkpoint_id] = future
            while len(self._arrivals) > self.KEEP:  # a fetch still waiting on one holds it
                self._arrivals.popitem(last=False)
            self._announced.notify_all()
        objects = [ObjectInfo(o.name, o.size, o.sha256, key="") for o in announcement.objects]
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


def _join(group: Any, stopped: threading.Event) -> Any:
    """Joins the process group a WeightGroup message names once the trainer opened it (it does when its previous
    broadcast ended, which for a large model can take longer than a join may: see :func:`collective.wait_opened`;
    at once for a trainer that does not say it opens groups), then blocks until every member and the trainer have
    joined."""
    host, port = group.address.rsplit(":", 1)
    store = open_store(host.strip("[]"), int(port), collective.GROUP_TIMEOUT_S)
    if group.wait_until_open:
        collective.wait_opened(store, group.name, stopped)
    return make_group(store, group.name, group.rank, group.size, group.backend, collective.GROUP_TIMEOUT_S)


class WeightFollower:
    """Keeps ``engine`` on the head of ``model``.

    Args:
        engine: The engine to load weights into.
        model: The model slug whose head is followed.
        fetcher: Where checkpoints' weights come from.
    """

    def __init__(self, engine: Engine, model: str, fetcher: CheckpointFetcher) -> None:
        self.engine = engine
        self.model = model
        self.fetcher = fetcher
        self.checkpoints = fetcher.checkpoints
        self.head_sequence = 0
        self.last_error = ""
        self.refused: dict[str, str] = {}
        """Checkpoint id -> why it was refused."""
        self.following = False
        """Whether the head is being watched now (False after an error, until a retry succeeds)."""
        self.follow_error = ""
        """Why the head is not being followed (empty while it is)."""
        self.on_reload: Any = None
        """Optional ``async (ok: bool) -> None`` called after each head was handled (health reporting)."""
        self._changed = asyncio.Condition()

    async def run(self, backoff: Backoff = Backoff()) -> None:
        """Follows the head forever: after any error (the checkpoint service unreachable, a store error, a
        stream cut) it retries with backoff, and shows the gap (``following``, ``follow_error``, the health
        callback) until it follows again. Before the first head, a model that does not exist ends it."""
        attempt = 0
        while True:
            try:
                head = await self.checkpoints.get_head(self.model)
                recovered = bool(self.follow_error)
                self._followed(True)
                attempt = 0
                if head.sequence > self.head_sequence:
                    await self.load(head)
                elif recovered and self.on_reload is not None:  # back on the head it serves: healthy again
                    await self.on_reload(not self.last_error)
                async for head in self.checkpoints.watch_head(self.model, self.head_sequence):
                    await self.load(head)
                raise UnavailableError("the head stream ended", reason="INTERNAL")
            except asyncio.CancelledError:
                raise
            except Exception as err:  # deliberate degrade: keep serving the weights we have, retry
                if self.head_sequence == 0 and isinstance(err, NotFoundError):
                    raise  # the model does not exist: fail the request that asked for it
                self.follow_error = str(err)
                if self.following:
                    log.warning("not following the head of %s (%s); retrying with backoff", self.model, err)
                self._followed(False)
                if self.on_reload is not None:
                    await self.on_reload(False)
            await asyncio.sleep(backoff.delay(attempt))
            attempt += 1

    def _followed(self, following: bool) -> None:
        if following and self.follow_error:
            log.info("following the head of %s again", self.model)
            self.follow_error = ""
        self.following = following

    async def fetch(self, checkpoint_id: str, while_head: bool = False) -> pathlib.Path:
        """One checkpoint's sampler weights, verified; returns its local folder (see :class:`CheckpointFetcher`)."""
        return await self.fetcher.fetch(self.model, checkpoint_id, while_head)

    async def load(self, head: Head) -> None:
        """Loads one head (or records why it was refused)."""
        try:
            with (
                telemetry.span(
                    "weights.reload", {"yieldloop.model": self.model, "yieldloop.checkpoint_id": head.checkpoint_id}
                ),
                telemetry.timed(
                    "yieldloop.rollout.reload.duration", {"model": self.model}, "head move seen -> new weights serving"
                ),
            ):
                await self.engine.load_weights(await self.fetch(head.checkpoint_id, True), head.checkpoint_id)
            self.last_error = ""
        except Exception as err:  # deliberate degrade: refuse this head, keep serving the old weights
            log.error(
                "refused checkpoint %s: %s", head.checkpoint_id, err, exc_info=not isinstance(err, YieldloopError)
            )
            self.last_error = self.refused[head.checkpoint_id] = str(err)
        self.head_sequence = head.sequence
        if self.on_reload is not None:
            await self.on_reload(not self.last_error and self.following)
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


class PinnedEngines:
    """Engines for checkpoints other than the served head: a candidate evaluated before it is promoted.

    ``engine(checkpoint_id)`` yields the serving engine when it serves that
    checkpoint, else an engine made by ``make_engine`` with that checkpoint
    loaded (verified like a reload). Up to ``capacity`` idle pinned engines stay
    loaded for the next request; an engine in use is never closed.
    """

    def __init__(self, follower: WeightFollower, make_engine: Callable[[], Engine], capacity: int = 1) -> None:
        self.follower = follower
        self.make_engine = make_engine
        self.capacity = capacity
        self._engines: collections.OrderedDict[str, list[Any]] = collections.OrderedDict()
        """checkpoint id -> [engine, users]."""
        self._lock = asyncio.Lock()

    @property
    def loaded_checkpoints(self) -> list[str]:
        """The checkpoints loaded in pinned engines."""
        return list(self._engines)

    @contextlib.asynccontextmanager
    async def engine(self, checkpoint_id: str) -> AsyncIterator[Engine]:
        if not checkpoint_id or checkpoint_id == self.follower.engine.weight_version:
            yield self.follower.engine
            return
        async with self._lock:
            entry = self._engines.get(checkpoint_id)
            if entry is None:
                folder = await self.follower.fetch(checkpoint_id)  # NOT_FOUND / CHECKPOINT_CORRUPT raise here
                engine = self._idle_at_capacity() or self.make_engine()
                try:
                    await engine.load_weights(folder, checkpoint_id)
                except BaseException:
                    await engine.close()
                    raise
                entry = self._engines[checkpoint_id] = [engine, 0]
            self._engines.move_to_end(checkpoint_id)
            entry[1] += 1
        try:
            yield entry[0]
        finally:
            entry[1] -= 1
            await self._evict()

    def _idle_at_capacity(self) -> Engine | None:
        """The least recently used idle engine when no other may be loaded (it is reloaded with the new checkpoint
        instead of closed: no new engine to build, and its previous weights take the new ones in place)."""
        if len(self._engines) < self.capacity:
            return None
        for checkpoint_id, (engine, users) in self._engines.items():
            if users == 0:
                del self._engines[checkpoint_id]
                return engine
        return None

    async def _evict(self) -> None:
        async with self._lock:
            idle = [cid for cid, (_, users) in self._engines.items() if users == 0]
            for checkpoint_id in idle[: max(0, len(self._engines) - self.capacity)]:
                engine, _ = self._engines.pop(checkpoint_id)
                await engine.close()

    async def close(self) -> None:
        async with self._lock:
            for engine, _ in self._engines.values():
                await engine.close()
            self._engines.clear()
