"""The ``bench`` environment: the load harness's workload (cheap tools, exact rewards).

Each episode asks the agent to walk a counter from 0 to ``n`` with the ``step``
tool; the reward is 1 when the answer names the final count.
"""

from __future__ import annotations

from yieldloop.environment import Environment, EpisodeContext

env = Environment("bench", episode_timeout_s=600, tool_timeout_s=30)


@env.setup()
async def reset(ctx: EpisodeContext) -> None:
    ctx.state["count"] = 0


@env.tool()
async def step(by: int, ctx: EpisodeContext) -> int:
    """Adds `by` to the episode's counter and returns the new count.

    Args:
        by: Amount to add.
    """
    ctx.state["count"] += by
    return ctx.state["count"]


@env.scenario()
async def walk(n: int = 8, ctx: EpisodeContext = None):
    """Walk the counter to n with the step tool, then answer with the count."""
    answer = yield f"Use step to bring the counter to {n}, then answer with the count."
    yield 1.0 if answer.strip() == str(n) and ctx.state["count"] == n else 0.0
