"""The environment SDK: schemas, task binding and the two-yield protocol."""

from __future__ import annotations

import math

import pytest

from yieldloop.environment import Environment, Grade
from yieldloop.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError

env = Environment("sdk-test")


@env.tool()
async def add(a: int, b: int = 2) -> int:
    """Adds two integers."""
    return a + b


@env.tool()
def explode(reason: str) -> str:
    """Always raises."""
    raise RuntimeError(reason)


@env.scenario()
async def echo(word: str, times: int = 1):
    """Rewards answers that repeat the word."""
    answer = yield f"Say {word} {times} times"
    yield Grade(1.0 if answer == " ".join([word] * times) else 0.0, subscores={"exact": 1.0}, info={"n": times})


def make_scenario(name: str, second):
    @env.scenario(name)
    async def scenario():
        yield "prompt"
        value = second()
        yield value
        if name == "third":
            yield 0.5

    return scenario


make_scenario("nan", lambda: math.nan)
make_scenario("too_big", lambda: 1.5)
make_scenario("third", lambda: 0.5)
make_scenario("raises", lambda: 1 / 0)
make_scenario("not_a_number", lambda: "high")


@env.scenario("no_second")
async def no_second():
    yield "prompt"


def test_tool_schema_from_type_hints() -> None:
    tool = env.tools["add"]
    assert tool.description == "Adds two integers."
    assert tool.parameters == {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a"],
    }


def test_task_binds_and_validates() -> None:
    task = echo.task(word="hi", times=2)
    assert (task.env, task.scenario, task.args) == ("sdk-test", "echo", {"word": "hi", "times": 2})
    assert task.task_id == echo.task(word="hi", times=2).task_id != echo.task(word="ho").task_id
    with pytest.raises(InvalidArgumentError):
        echo.task(times=2)
    with pytest.raises(NotFoundError):
        env.episode("nope", {})


async def test_episode_round_trip() -> None:
    episode = env.episode("echo", {"word": "hi", "times": 2})
    assert await episode.start() == "Say hi 2 times"
    assert await episode.call_tool("add", {"a": 1}) == ("3", False)
    content, is_error = await episode.call_tool("explode", {"reason": "boom"})
    assert is_error and "boom" in content
    with pytest.raises(InvalidArgumentError) as err:
        await episode.call_tool("missing", {})
    assert err.value.reason == "TOOL_NOT_FOUND"
    grade = await episode.submit("hi hi")
    assert grade == Grade(1.0, {"exact": 1.0}, {"n": 2})
    with pytest.raises(InvalidArgumentError):
        await episode.submit("again")


@pytest.mark.parametrize("scenario", ["nan", "too_big", "third", "raises", "not_a_number", "no_second"])
async def test_protocol_misuse_is_an_environment_error(scenario: str) -> None:
    episode = env.episode(scenario, {})
    await episode.start()
    with pytest.raises(FailedPreconditionError) as err:
        await episode.submit("answer")
    assert err.value.reason == "ENVIRONMENT_ERROR"
    await episode.close()


def test_scenario_must_be_an_async_generator() -> None:
    with pytest.raises(TypeError):

        @env.scenario()
        async def not_a_generator():
            return 1
