"""Where environment code runs: the EpisodeHost interface, environment descriptions, the factory.

Two implementations: :class:`~.inprocess.InProcessHost` (trusted, light
environments, in the service's own event loop) and
:class:`~.workers.WorkerPoolHost` (a pool of worker processes, so a crashing,
hanging or CPU-hogging environment cannot stop the service).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

from yieldloop.environment import Environment, FinalCompletion, Grade, Prompt
from yieldloop.errors import NotFoundError


@dataclasses.dataclass(frozen=True)
class EnvInfo:
    """What the service needs to know of an environment without running its code (picklable)."""

    name: str
    episode_timeout_s: float
    tool_timeout_s: float
    scenarios: list[dict[str, Any]]
    """Each {"name", "description", "args_schema"}."""
    tools: list[dict[str, Any]]
    """Each {"name", "description", "parameters"}."""

    @classmethod
    def of(cls, env: Environment) -> EnvInfo:
        return cls(
            name=env.name,
            episode_timeout_s=env.episode_timeout_s,
            tool_timeout_s=env.tool_timeout_s,
            scenarios=[
                {"name": s.name, "description": s.description, "args_schema": s.args_schema}
                for s in env.scenarios.values()
            ],
            tools=[
                {"name": t.name, "description": t.description, "parameters": t.parameters} for t in env.tools.values()
            ],
        )


def resolve_env(envs: dict[str, EnvInfo], name: str) -> EnvInfo:
    """The named environment ("" means the only one)."""
    if not name and len(envs) == 1:
        return next(iter(envs.values()))
    if name not in envs:
        raise NotFoundError(f"no environment {name!r}; loaded: {sorted(envs)}", reason="ENVIRONMENT_NOT_FOUND")
    return envs[name]


class EpisodeHost(abc.ABC):
    """Runs episodes of the loaded environments, addressed by episode id."""

    envs: dict[str, EnvInfo]

    @abc.abstractmethod
    async def start(self) -> None:
        """Loads the environments (fills :attr:`envs`)."""

    @abc.abstractmethod
    async def stop(self) -> None: ...

    @abc.abstractmethod
    async def open(self, env: str, scenario: str, args: dict[str, Any], episode_id: str) -> Prompt:
        """Starts an episode (setup hooks, first yield); on failure it is already closed."""

    @abc.abstractmethod
    async def call_tool(self, episode_id: str, name: str, arguments: dict[str, Any]) -> tuple[str, bool]: ...

    @abc.abstractmethod
    async def submit(self, episode_id: str, answer: str, completion: FinalCompletion | None = None) -> Grade:
        """Grades the answer. The episode ends with it: a host may run its teardown right after the grade, unasked
        (:meth:`is_open` then says so, and a :meth:`close` has nothing to do)."""

    @abc.abstractmethod
    async def close(self, episode_id: str) -> None:
        """Ends an episode and runs its teardown (idempotent)."""

    @abc.abstractmethod
    def is_open(self, episode_id: str) -> bool:
        """Whether the episode is open here (a :meth:`close` would have something to do)."""

    @property
    @abc.abstractmethod
    def num_live_episodes(self) -> int: ...
