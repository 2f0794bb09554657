"""The models a rollout service serves: an engine per slug, loaded on first use, each following its own head.

Beyond ``max_models`` engines, or beyond ``memory_budget_bytes`` of loaded weights (each slug counts its
base checkpoint's size as recorded at import), the least recently used engine that no request holds is
unloaded (see :class:`~yieldloop_server.common.pool.Pool`); a model larger than the whole budget is
RESOURCE_EXHAUSTED/MODEL_TOO_LARGE. A load holds the admission lock for its duration (seconds for a small model): requests for
loaded models wait that long to enter.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import pathlib
from collections.abc import Callable
from typing import Any

from yieldloop.client import Client
from yieldloop.errors import NotFoundError, ResourceExhaustedError
from yieldloop_server.common.pool import Pool
from yieldloop_server.rollout.engines import Engine
from yieldloop_server.rollout.weights import PinnedEngines, WeightFollower
from yieldloop_server.store import ObjectStore


@dataclasses.dataclass(eq=False)
class ServedModel:
    """One slug's engine, the follower keeping it on the slug's head, and its candidates' pinned engines."""

    slug: str
    engine: Engine
    follower: Any
    """A :class:`WeightFollower` (or, for a fixed engine, anything with ``wait_for``, ``head_sequence``, ``last_error``)."""
    pinned: PinnedEngines | None = None
    task: asyncio.Task | None = None

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        if self.pinned is not None:
            await self.pinned.close()
        await self.engine.close()


class ServedModels:
    """Engines for every slug by name (a :class:`~yieldloop_server.common.pool.Pool` of :class:`ServedModel`).

    Args:
        default: The slug requests naming no model get (loaded at start).
        make_engine: A new, empty engine of the service's kind.
        make_pinned_engine: A new engine for a candidate checkpoint (the light torch engine).
        store: Where checkpoints are read from.
        checkpoints: CheckpointService client (heads, manifests).
        cache_dir: Local folder for verified checkpoints.
        max_models: Engines loaded at once.
        on_default_reload: ``async (ok) -> None`` after each head of the default slug was handled (health).
        memory_budget_bytes: Bytes of weights loaded at once (0: no byte budget, only ``max_models``).
    """

    def __init__(
        self,
        default: str,
        make_engine: Callable[[], Engine] | None,
        make_pinned_engine: Callable[[], Engine] | None,
        store: ObjectStore | None,
        checkpoints: Client | None,
        cache_dir: pathlib.Path | None,
        max_models: int = 2,
        on_default_reload: Any = None,
        memory_budget_bytes: int = 0,
    ) -> None:
        self.default = default
        self.make_engine = make_engine
        self.make_pinned_engine = make_pinned_engine
        self.store = store
        self.checkpoints = checkpoints
        self.cache_dir = cache_dir
        self.on_default_reload = on_default_reload
        self.memory_budget_bytes = memory_budget_bytes
        self._pool: Pool[ServedModel] = Pool(
            default, self._load, ServedModel.close, max_models, check=self._check,
            budget_bytes=memory_budget_bytes, owner="this rollout service",
        )

    @classmethod
    def fixed(cls, slug: str, engine: Engine, follower: Any) -> ServedModels:
        """Serves one already-loaded engine and nothing else (benchmarks, engine tests)."""
        models = cls(slug, None, None, None, None, None, max_models=1)
        models._pool.put(slug, ServedModel(slug, engine, follower))
        return models

    async def start(self) -> None:
        """Loads the default slug (a missing model fails the start, not the first request)."""
        async with self.use(self.default):
            pass

    def use(self, model: str = "") -> contextlib.AbstractAsyncContextManager[ServedModel]:
        """The engine serving ``model`` (default: the default slug), loaded if needed, held for the block."""
        return self._pool.use(model)

    @property
    def loaded(self) -> list[ServedModel]:
        return self._pool.items

    async def _check(self, slug: str) -> int:
        """The slug's size; NOT_FOUND (MODEL_NOT_FOUND) for a slug this service cannot load, RESOURCE_EXHAUSTED
        (MODEL_TOO_LARGE) for one larger than the whole memory budget."""
        if self.make_engine is None or self.checkpoints is None:
            raise NotFoundError(f"this server serves only {self.default!r}, not {slug!r}", reason="MODEL_NOT_FOUND")
        await self.checkpoints.get_head(slug)
        if not self.memory_budget_bytes:
            return 0
        listed = await self.checkpoints.list_models()
        size = next((m.size_bytes for m in listed.models if m.slug == slug), 0)
        if size > self.memory_budget_bytes:
            raise ResourceExhaustedError(
                f"model {slug!r} needs {size / 1e6:.1f} MB of weights, more than this rollout service's whole "
                f"budget of {self.memory_budget_bytes / 1e6:.1f} MB", reason="MODEL_TOO_LARGE",
            )
        return size

    async def _load(self, slug: str) -> ServedModel:
        assert self.make_engine is not None
        engine = self.make_engine()
        follower = WeightFollower(engine, slug, self.store, self.checkpoints, self.cache_dir)
        if slug == self.default:
            follower.on_reload = self.on_default_reload
        task = asyncio.create_task(follower.run())
        loaded = asyncio.create_task(follower.wait_loaded())
        await asyncio.wait({loaded, task}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():  # the follower gave up (e.g. the model vanished): fail this request, not the service
            loaded.cancel()
            await engine.close()
            task.result()
        pinned = PinnedEngines(follower, self.make_pinned_engine) if self.make_pinned_engine else None
        return ServedModel(slug, engine, follower, pinned, task)

    async def close(self) -> None:
        await self._pool.close()
