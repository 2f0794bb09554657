"""An environment whose tool names the process running the episode (tests of EnvService's processes)."""

from __future__ import annotations

import os

from yieldloop.environment import Environment, EpisodeContext

env = Environment("pids")


@env.tool()
async def pid(ctx: EpisodeContext) -> int:
    """The id of the process this episode runs in."""
    return os.getpid()


@env.scenario()
async def which(ctx: EpisodeContext = None):
    """Call pid, then answer anything."""
    yield "Call pid, then answer."
    yield 1.0
