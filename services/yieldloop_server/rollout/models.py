"""The models a rollout service serves: an engine per slug, loaded on first use, each following its own head.

A LoRA fork has no engine of its own: its adapter is served by the engine of its frozen base weights (pool
name ``base@checkpoint``, loaded once for every LoRA fork over them), applied per request, and follows the
fork's head like any slug (an adapter reload never touches the base weights).

Beyond ``max_models`` engines, or beyond ``memory_budget_bytes`` of loaded weights (each slug counts its
base checkpoint's size as recorded at import), the least recently used engine that no request holds is
unloaded (see :class:`~yieldloop_server.common.pool.Pool`); a model larger than the whole budget is
RESOURCE_EXHAUSTED/MODEL_TOO_LARGE. A load holds the admission lock for its duration (seconds for a small
model): requests for loaded models wait that long to enter.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import pathlib
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from yieldloop.client import Client
from yieldloop.errors import FailedPreconditionError, NotFoundError, ResourceExhaustedError
from yieldloop.types import ModelInfo
from yieldloop_server.common.pool import Pool
from yieldloop_server.rollout.engines import AdapterEngine, Engine
from yieldloop_server.rollout.weights import PinnedEngines, WeightFollower
from yieldloop_server.store import ObjectStore
from yieldloop_server.weights import open_sink


@dataclasses.dataclass(eq=False)
class ServedModel:
    """One slug's engine, the follower keeping it on the slug's head, and its candidates' pinned engines."""

    slug: str
    engine: Engine
    follower: Any
    """A :class:`WeightFollower` (or, for a fixed engine, anything with ``wait_for``, ``head_sequence``,
    ``last_error``)."""
    pinned: PinnedEngines | None = None
    task: asyncio.Task | None = None
    adapter_base: str = ""
    """For a LoRA fork: its base engine's pool name ("slug@checkpoint")."""
    adapters: dict[str, ServedModel] = dataclasses.field(default_factory=dict)
    """For a LoRA forks' base engine: each fork served by it, by slug."""
    adapter_lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    candidates_like_head: bool = False
    """Whether ``pinned`` engines are like ``engine`` (the same kind, in the same process)."""

    async def close(self) -> None:
        for view in list(self.adapters.values()):
            await view.close()
        self.adapters.clear()
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
        make_engine: ``(lora) -> Engine``: a new, empty engine of the service's kind (serving LoRA adapters
            when ``lora``).
        make_pinned_engine: A new engine for a candidate checkpoint (the light torch engine).
        store: Where checkpoints are read from.
        checkpoints: CheckpointService client (heads, manifests).
        cache_dir: Local folder for verified checkpoints.
        max_models: Engines loaded at once.
        on_default_reload: ``async (ok) -> None`` after each head of the default slug was handled (health).
        memory_budget_bytes: Bytes of weights loaded at once (0: no byte budget, only ``max_models``).
        weights_from: How pending checkpoints come from their trainer (see :func:`open_sink`).
        device: The engines' device (a weight group on CUDA may be NCCL).
        candidates_like_head: Whether ``make_pinned_engine``'s engines are like ``make_engine(False)``'s (the same
            kind, in the same process).
    """

    def __init__(
        self,
        default: str,
        make_engine: Callable[[bool], Engine] | None,
        make_pinned_engine: Callable[[], Engine] | None,
        store: ObjectStore | None,
        checkpoints: Client | None,
        cache_dir: pathlib.Path | None,
        max_models: int = 2,
        on_default_reload: Any = None,
        memory_budget_bytes: int = 0,
        weights_from: str = "auto",
        device: str = "cpu",
        candidates_like_head: bool = False,
    ) -> None:
        self.default = default
        self.candidates_like_head = candidates_like_head
        self.make_engine = make_engine
        self.make_pinned_engine = make_pinned_engine
        self.store = store
        self.checkpoints = checkpoints
        self.cache_dir = cache_dir
        self.fetcher = (
            open_sink(weights_from, store, checkpoints, cache_dir, device=device, in_use=self._serving)
            if store is not None and checkpoints is not None and cache_dir is not None
            else None
        )
        self.on_default_reload = on_default_reload
        self.memory_budget_bytes = memory_budget_bytes
        self._infos: dict[str, ModelInfo] = {}
        self._pool: Pool[ServedModel] = Pool(
            default,
            self._load,
            ServedModel.close,
            max_models,
            check=self._check,
            budget_bytes=memory_budget_bytes,
            owner="this rollout service",
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
        return self._use(model or self.default)

    @contextlib.asynccontextmanager
    async def _use(self, slug: str) -> AsyncIterator[ServedModel]:
        info = await self._info(slug)
        if info is None or info.lora is None:
            async with self._pool.use(slug) as served:
                yield served
            return
        async with self._pool.use(f"{info.adapter_base_model}@{info.adapter_base_checkpoint_id}") as base:
            yield await self._adapter(base, slug)

    async def _info(self, slug: str) -> ModelInfo | None:
        """The slug's record (kept: a slug's kind never changes); None when this service has no registry."""
        if self.checkpoints is None or self.make_engine is None:
            return None
        if slug not in self._infos:
            self._infos[slug] = await self.checkpoints.get_model(slug)  # NOT_FOUND (MODEL_NOT_FOUND)
        return self._infos[slug]

    def _serving(self) -> set[tuple[str, str]]:
        """(model, checkpoint id) of what every loaded engine serves, candidates' pinned engines included."""
        versions = set()
        for item in self._pool.items:
            for served in (item, *item.adapters.values()):
                slug = served.slug.split("@")[0]
                versions.add((slug, served.engine.weight_version))
                if served.pinned is not None:
                    versions.update((slug, checkpoint_id) for checkpoint_id in served.pinned.loaded_checkpoints)
        return versions

    @property
    def loaded(self) -> list[ServedModel]:
        """Every slug served now: engines, and the LoRA forks their adapters serve."""
        return [
            served for item in self._pool.items for served in (item, *item.adapters.values()) if "@" not in served.slug
        ]

    async def _check(self, name: str) -> int:
        """The size of a slug (or of ``slug@checkpoint``, a LoRA forks' base); NOT_FOUND (MODEL_NOT_FOUND,
        CHECKPOINT_NOT_FOUND) for one this service cannot load, RESOURCE_EXHAUSTED (MODEL_TOO_LARGE) for one
        larger than the whole memory budget."""
        if self.make_engine is None or self.checkpoints is None:
            raise NotFoundError(f"this server serves only {self.default!r}, not {name!r}", reason="MODEL_NOT_FOUND")
        slug, _, checkpoint_id = name.partition("@")
        if checkpoint_id:
            await self.checkpoints.get_checkpoint(slug, checkpoint_id)
        else:
            await self.checkpoints.get_head(slug)
        if not self.memory_budget_bytes:
            return 0
        size = (await self.checkpoints.get_model(slug)).size_bytes
        if size > self.memory_budget_bytes:
            raise ResourceExhaustedError(
                f"model {slug!r} needs {size / 1e6:.1f} MB of weights, more than this rollout service's whole "
                f"budget of {self.memory_budget_bytes / 1e6:.1f} MB",
                reason="MODEL_TOO_LARGE",
            )
        return size

    async def _follow(self, engine: Engine, slug: str) -> tuple[WeightFollower, asyncio.Task]:
        """A follower keeping ``engine`` on the slug's head, once the first head was handled (a follower that
        gave up, e.g. because the model vanished, fails this request, not the service)."""
        assert self.fetcher is not None
        follower = WeightFollower(engine, slug, self.fetcher)
        if slug == self.default:
            follower.on_reload = self.on_default_reload
        task = asyncio.create_task(follower.run())
        loaded = asyncio.create_task(follower.wait_loaded())
        await asyncio.wait({loaded, task}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            loaded.cancel()
            await engine.close()
            task.result()
        return follower, task

    async def _load(self, name: str) -> ServedModel:
        assert self.make_engine is not None
        slug, _, checkpoint_id = name.partition("@")
        if checkpoint_id:  # LoRA forks' frozen base weights: loaded once, never reloaded
            engine = self.make_engine(True)
            try:
                assert self.fetcher is not None
                await engine.load_weights(await self.fetcher.fetch(slug, checkpoint_id), checkpoint_id)
            except BaseException:
                await engine.close()
                raise
            return ServedModel(name, engine, FixedWeights(engine))
        engine = self.make_engine(False)
        follower, task = await self._follow(engine, slug)
        pinned = PinnedEngines(follower, self.make_pinned_engine) if self.make_pinned_engine else None
        return ServedModel(slug, engine, follower, pinned, task, candidates_like_head=self.candidates_like_head)

    async def _adapter(self, base: ServedModel, slug: str) -> ServedModel:
        """The LoRA fork ``slug`` served by ``base``'s engine (its adapter loaded and following its head)."""
        async with base.adapter_lock:
            view = base.adapters.get(slug)
            if view is None:
                follower, task = await self._follow(AdapterEngine(base.engine, slug), slug)

                def candidate() -> Engine:  # a candidate checkpoint: the same base, another adapter name
                    return AdapterEngine(base.engine, f"{slug}@{uuid.uuid4().hex[:8]}")

                view = base.adapters[slug] = ServedModel(
                    slug,
                    follower.engine,
                    follower,
                    PinnedEngines(follower, candidate),
                    task,
                    base.slug,
                    candidates_like_head=True,
                )
            return view

    async def close(self) -> None:
        await self._pool.close()
        if self.fetcher is not None:
            await self.fetcher.close()


class FixedWeights:
    """The follower of an engine whose weights never move (a LoRA forks' base)."""

    head_sequence = 1
    last_error = ""
    following = True
    follow_error = ""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def wait_for(self, checkpoint_id: str) -> None:
        if checkpoint_id != self.engine.weight_version:
            raise FailedPreconditionError(
                f"this engine holds {self.engine.weight_version} only", reason="CHECKPOINT_NOT_FOUND"
            )
