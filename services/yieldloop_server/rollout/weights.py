"""Follows a model's head: fetch its weights (through the service's :class:`WeightSink`, verified), hot-reload
them into the engine; and engines pinned to other checkpoints (a candidate's evaluation).

A checkpoint that fails verification is refused: the previous weights keep
serving and the error is kept for GetServingInfo and the logs.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import pathlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from yieldloop.errors import FailedPreconditionError, NotFoundError, UnavailableError, YieldloopError
from yieldloop.retry import Backoff
from yieldloop.types import Head
from yieldloop_server.common import telemetry
from yieldloop_server.rollout.engines import Engine
from yieldloop_server.weights.base import WeightSink

log = logging.getLogger(__name__)


class WeightFollower:
    """Keeps ``engine`` on the head of ``model``.

    Args:
        engine: The engine to load weights into.
        model: The model slug whose head is followed.
        fetcher: Where checkpoints' weights come from.
    """

    def __init__(self, engine: Engine, model: str, fetcher: WeightSink) -> None:
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
        """One checkpoint's sampler weights, verified; returns its local folder (see :class:`WeightSink`)."""
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
                engine = self._idle_at_capacity()
                if engine is None:
                    engine = self.make_engine()
                    engine.start_from(self.follower.engine)  # the head's weights: a candidate differs in its weights
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
