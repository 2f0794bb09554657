"""Named resources loaded on first use, held while in use, the least recently used idle ones closed to make room.

The rollout service's engines (one per model slug) and the trainer's sessions (one per slug) are both such a
pool: a request holds its slug's item for its duration; loading a new one first checks that it can be
loaded, then closes idle items until the count (and, where sizes are given, the byte budget) has room; when
every item is busy the request is refused (RESOURCE_EXHAUSTED/TOO_MANY_MODELS) instead of taking work away
from another. One load at a time: a load holds the admission lock while it runs.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Generic, TypeVar

from yieldloop.errors import ResourceExhaustedError

T = TypeVar("T")


class Pool(Generic[T]):
    """Items by name.

    Args:
        default: The name a request naming none gets.
        load: Loads the item of a name (raising when it cannot: nothing is closed for it then).
        close: Releases an item.
        max_items: Items loaded at once.
        check: Checks a name before anything is closed for it and returns its size in bytes (0 when sizes
            do not matter); raises for a name that cannot be loaded.
        budget_bytes: Total size of the loaded items (0: only ``max_items`` limits).
        busy: Whether an idle item must still not be closed (e.g. it holds pending gradients).
        owner: Who holds the items, for messages ("the trainer").
        busy_hint: What frees a busy item, for messages.
    """

    def __init__(
        self,
        default: str,
        load: Callable[[str], Awaitable[T]],
        close: Callable[[T], Awaitable[None]],
        max_items: int,
        *,
        check: Callable[[str], Awaitable[int]] | None = None,
        budget_bytes: int = 0,
        busy: Callable[[T], bool] = lambda item: False,
        owner: str = "this service",
        busy_hint: str = "",
    ) -> None:
        self.default = default
        self._load, self._close, self._check, self._busy = load, close, check, busy
        self.max_items = max(1, max_items)
        self.budget_bytes = budget_bytes
        self.owner, self.busy_hint = owner, busy_hint
        self._items: collections.OrderedDict[str, T] = collections.OrderedDict()
        self._sizes: dict[str, int] = {}
        self._users: collections.Counter[str] = collections.Counter()
        self._lock = asyncio.Lock()

    def put(self, name: str, item: T, size: int = 0) -> None:
        """Adds an already-loaded item."""
        self._items[name], self._sizes[name] = item, size

    @property
    def items(self) -> list[T]:
        return list(self._items.values())

    @property
    def names(self) -> list[str]:
        return list(self._items)

    @contextlib.asynccontextmanager
    async def use(self, name: str = "") -> AsyncIterator[T]:
        """The item of ``name`` (default: the default name), loaded if needed, held for the block."""
        name = name or self.default
        async with self._lock:
            item = self._items.get(name)
            if item is None:
                size = await self._check(name) if self._check is not None else 0
                await self._make_room(size)
                item = await self._load(name)
                self.put(name, item, size)
            self._items.move_to_end(name)
            self._users[name] += 1
        try:
            yield item
        finally:
            self._users[name] -= 1

    def _over_budget(self, size: int) -> bool:
        if len(self._items) >= self.max_items:
            return True
        return bool(self.budget_bytes) and sum(self._sizes.values()) + size > self.budget_bytes

    async def _make_room(self, size: int) -> None:
        while self._over_budget(size):
            idle = [name for name, item in self._items.items() if not self._users[name] and not self._busy(item)]
            if not idle:
                hint = f": {self.busy_hint}" if self.busy_hint else ""
                raise ResourceExhaustedError(
                    f"{self.owner} holds {len(self._items)} models ({', '.join(self._items)}), all busy{hint}",
                    reason="TOO_MANY_MODELS",
                )
            name = idle[0]  # least recently used first
            self._sizes.pop(name, None)
            await self._close(self._items.pop(name))

    async def close(self) -> None:
        async with self._lock:
            for item in self._items.values():
                await self._close(item)
            self._items.clear()
            self._sizes.clear()
