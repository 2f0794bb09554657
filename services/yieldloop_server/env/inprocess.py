"""Episodes in the current event loop: the trusted, light path (and what each worker process runs)."""

from __future__ import annotations

from typing import Any

from yieldloop.environment import Environment, FinalCompletion, Grade, Prompt
from yieldloop.episode import Episode, protocol_error
from yieldloop_server.env.host import EnvInfo, EpisodeHost, resolve_env


class InProcessHost(EpisodeHost):
    def __init__(self, envs: list[Environment]) -> None:
        self._environments = {env.name: env for env in envs}
        self.envs = {env.name: EnvInfo.of(env) for env in envs}
        self._episodes: dict[str, Episode] = {}

    async def start(self) -> None:
        from yieldloop.mcp_tools import connect_all

        for env in self._environments.values():
            await connect_all(env)
            await env.start()  # e.g. a HUD environment's process (which may name the environment)
        self._environments = {env.name: env for env in self._environments.values()}
        self.envs = {env.name: EnvInfo.of(env) for env in self._environments.values()}

    async def stop(self) -> None:
        for episode_id in list(self._episodes):
            await self.close(episode_id)
        from yieldloop.mcp_tools import disconnect_all

        for env in self._environments.values():
            await env.stop()
            await disconnect_all(env)

    def _episode(self, episode_id: str) -> Episode:
        episode = self._episodes.get(episode_id)
        if episode is None:
            raise protocol_error(f"no live episode {episode_id!r}")
        return episode

    async def open(self, env: str, scenario: str, args: dict[str, Any], episode_id: str) -> Prompt:
        if episode_id in self._episodes:
            raise protocol_error("the episode was already started")  # one episode per id
        environment = self._environments[resolve_env(self.envs, env).name]
        episode = Episode.of(environment, scenario, args, episode_id)
        self._episodes[episode_id] = episode
        try:
            return await episode.start()
        except BaseException:
            await self.close(episode_id)
            raise

    async def call_tool(self, episode_id: str, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        return await self._episode(episode_id).call_tool(name, arguments)

    async def submit(self, episode_id: str, answer: str, completion: FinalCompletion | None = None) -> Grade:
        return await self._episode(episode_id).submit(answer, completion)  # closed by the caller, after the grade

    async def close(self, episode_id: str) -> None:
        episode = self._episodes.pop(episode_id, None)
        if episode is not None:
            await episode.close()

    def is_open(self, episode_id: str) -> bool:
        return episode_id in self._episodes

    @property
    def num_live_episodes(self) -> int:
        return len(self._episodes)
