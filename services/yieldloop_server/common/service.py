"""What a service's ``build(options, store, transport)`` returns: how to start it and how to stop it."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

Starter = Callable[[], Awaitable[str]]
Stopper = Callable[[float], Awaitable[None]]


@dataclasses.dataclass
class Service:
    """A built service (not started).

    ``start()`` serves and returns its gRPC (or HTTP) address; ``stop(grace)`` gives in-flight calls ``grace``
    seconds, then releases everything the build made. ``ports`` names the other ports the started service serves
    (the rollout's OpenAI endpoint: ``http_port``), recorded in its ready file so a supervised restart binds them
    again."""

    start: Starter
    stop: Stopper
    ports: dict[str, int] = dataclasses.field(default_factory=dict)
