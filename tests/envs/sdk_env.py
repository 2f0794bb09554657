"""An environment for the EnvService tests: state, hooks, slow, crashing and failing tools.

Setup/teardown hooks append to ``$YL_TEST_MARKERS/<episode_id>`` so tests can
see that teardown ran, also when the episode ran in a worker process.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import time

from yieldloop.environment import Environment, EpisodeContext, Grade, RawText

env = Environment("sdk", episode_timeout_s=30, tool_timeout_s=1.0)


def _mark(ctx: EpisodeContext, what: str) -> None:
    folder = os.environ.get("YL_TEST_MARKERS")
    if folder:
        with open(pathlib.Path(folder) / ctx.task.args.get("tag", ctx.episode_id), "a") as f:
            f.write(what + "\n")


@env.setup()
def fresh_state(ctx: EpisodeContext) -> None:
    ctx.state["counter"] = 0
    _mark(ctx, "setup")


@env.teardown()
def leave(ctx: EpisodeContext) -> None:
    _mark(ctx, "teardown")


@env.tool()
def increment(by: int, ctx: EpisodeContext) -> int:
    """Adds to this episode's counter and returns it.

    Args:
        by: How much to add.
    """
    ctx.state["counter"] += by
    return ctx.state["counter"]


@env.tool()
async def pid() -> int:
    """The id of the process running this episode."""
    return os.getpid()


@env.tool()
async def sleep(seconds: float) -> str:
    """Sleeps (async), for deadline tests."""
    await asyncio.sleep(seconds)
    return "slept"


@env.tool()
def busy(seconds: float) -> str:
    """Burns CPU in a thread, for isolation tests."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return "done"


@env.tool()
def repeat(text: str, times: int) -> str:
    """Returns ``text`` repeated (a tool result as long as asked)."""
    return text * times


@env.tool()
def fail(message: str) -> str:
    """Always raises."""
    raise RuntimeError(message)


@env.tool()
def crash() -> str:
    """Kills the process it runs in."""
    os._exit(3)


@env.scenario()
async def count_to(target: int, tag: str = "", ctx: EpisodeContext = None):
    """Asks the agent to bring the counter to `target`; the answer must name the final count."""
    answer = yield [
        {"role": "system", "content": "Use the increment tool."},
        {"role": "user", "content": f"Bring the counter to {target}."},
    ]
    reached = ctx.state["counter"] == target
    yield Grade(
        1.0 if reached and answer.strip() == str(target) else 0.0,
        subscores={"reached": float(reached)},
        info={"counter": ctx.state["counter"]},
    )


@env.scenario()
async def slow_grade(seconds: float, tag: str = ""):
    """Takes ``seconds`` to grade any answer."""
    yield "Say anything."
    await asyncio.sleep(seconds)
    yield 1.0


@env.scenario()
async def echo(word: str, tag: str = ""):
    """Rewards answers equal to the word."""
    answer = yield f"Say {word}"
    yield 1.0 if answer == word else 0.0


@env.scenario()
async def complete(text: str, expected: str, tag: str = ""):
    """A completion task: the prompt is raw text, not a chat message."""
    answer = yield RawText(text)
    yield 1.0 if answer.strip() == expected else 0.0


@env.scenario()
async def exact_digits(number: str, tag: str = "", ctx: EpisodeContext = None):
    """Rewards the digits only when spelled by digit tokens alone and ended by the model (EOS), and reports
    what the grader saw."""
    answer = yield f"Write {number}"
    seen = ctx.completion
    info = {"stop_reason": seen.stop_reason, "token_ids": list(seen.token_ids)} if seen else {"completion": None}
    yield Grade(1.0 if seen and seen.stop_reason == "eos" and answer == number else 0.0, info=info)


@env.scenario()
async def flaky_start(marker: str, tag: str = ""):
    """Kills its worker process the first time (no marker file yet), then rewards any answer."""
    path = pathlib.Path(marker)
    if not path.exists():
        path.write_text("died once")
        os._exit(3)
    yield "Say anything."
    yield 1.0
