"""The environment SDK: schemas, tasks, tasksets, hooks and state, and the two-yield protocol."""

from __future__ import annotations

import json
import math
import pathlib

import pytest

from yieldloop.environment import Environment, EpisodeContext, Grade, Task
from yieldloop.episode import Episode
from yieldloop.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from yieldloop.taskset import Taskset

env = Environment("sdk-test")
events: list[str] = []


@env.setup()
async def setup(ctx: EpisodeContext) -> None:
    ctx.state["seen"] = []
    events.append(f"setup {ctx.episode_id}")


@env.teardown()
def teardown(ctx: EpisodeContext) -> None:
    events.append(f"teardown {ctx.episode_id}")


@env.tool()
async def add(a: int, b: int = 2) -> int:
    """Adds two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return a + b


@env.tool()
def remember(item: str, ctx: EpisodeContext) -> list:
    """Remembers an item for this episode only (a sync tool)."""
    ctx.state["seen"].append(item)
    return ctx.state["seen"]


@env.tool()
def explode(reason: str) -> str:
    """Always raises."""
    raise RuntimeError(reason)


@env.scenario()
async def echo(word: str, times: int = 1):
    """Rewards answers that repeat the word."""
    answer = yield f"Say {word} {times} times"
    yield Grade(1.0 if answer == " ".join([word] * times) else 0.0, subscores={"exact": 1.0}, info={"n": times})


@env.scenario()
async def chat(topic: str):
    yield [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"About {topic}?"}]
    yield 0.5


def second_yield_scenario(name: str, make_value) -> None:
    @env.scenario(name)
    async def scenario():
        yield "prompt"
        yield make_value()
        if name == "third_yield":
            yield 0.5


second_yield_scenario("nan_reward", lambda: math.nan)
second_yield_scenario("reward_above_one", lambda: 1.5)
second_yield_scenario("negative_reward", lambda: -0.1)
second_yield_scenario("third_yield", lambda: 0.5)
second_yield_scenario("raises_while_grading", lambda: 1 / 0)
second_yield_scenario("string_reward", lambda: "high")
second_yield_scenario("bool_reward", lambda: True)


@env.scenario("no_second_yield")
async def no_second_yield():
    yield "prompt"


@env.scenario("no_prompt")
async def no_prompt():
    return
    yield  # an async generator that never yields


@env.scenario("raises_before_prompt")
async def raises_before_prompt():
    raise KeyError("missing fixture")
    yield


def test_tool_schema_from_type_hints_and_docstring() -> None:
    tool = env.tools["add"]
    assert tool.description == "Adds two integers."
    assert tool.parameters == {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "description": "The first addend."},
            "b": {"type": "integer", "description": "The second addend.", "default": 2},
        },
        "required": ["a"],
    }
    # The episode context is injected, never part of what the agent sees.
    assert env.tools["remember"].parameters["properties"] == {"item": {"type": "string"}}


def test_task_binds_and_validates() -> None:
    task = echo.task(word="hi", times=2)
    assert (task.env, task.scenario, task.args) == ("sdk-test", "echo", {"word": "hi", "times": 2})
    assert task.task_id == echo.task(word="hi", times=2).task_id != echo.task(word="ho").task_id
    with pytest.raises(InvalidArgumentError, match=r"missing required argument\(s\) \['word'\]") as err:
        echo.task(times=2)
    assert err.value.reason == "SCENARIO_ARGS_INVALID" and err.value.field == "word"
    with pytest.raises(InvalidArgumentError, match=r"unexpected argument\(s\) \['colour'\]"):
        echo.task(word="hi", colour="red")
    with pytest.raises(InvalidArgumentError, match=r"argument 'times'='2' does not match"):
        echo.task(word="hi", times="2")
    with pytest.raises(NotFoundError, match="has no scenario 'nope'"):
        Episode.of(env, "nope", {})


def test_taskset_round_trips(tmp_path: pathlib.Path) -> None:
    tasks = Taskset([echo.task(word="a"), echo.task(word="b", times=3), chat.task(topic="rl")])
    for name in ("tasks.json", "tasks.jsonl"):
        path = tasks.save(tmp_path / name)
        assert Taskset.load(path, env) == tasks
        assert Taskset.load(path) == tasks  # without an env: loaded as written
    module = tmp_path / "my_tasks.py"
    module.write_text(
        f"import sys; sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})\n"
        "from test_environment import echo\n"
        "tasks = [echo.task(word=w) for w in 'xyz']\n"
    )
    assert [t.args["word"] for t in Taskset.load(module)] == ["x", "y", "z"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"env": "sdk-test", "scenario": "echo", "args": {"wrd": "a"}}) + "\n")
    with pytest.raises(InvalidArgumentError, match="unexpected argument"):
        Taskset.load(bad, env)
    with pytest.raises(ValueError, match="unsupported taskset file"):
        Taskset.load(tmp_path / "tasks.csv")


async def test_episode_round_trip_with_hooks_and_fresh_state() -> None:
    first = Episode.of(env, "echo", {"word": "hi", "times": 2}, episode_id="e1")
    assert await first.start() == "Say hi 2 times"
    assert await first.call_tool("add", {"a": 1}) == ("3", False)
    assert await first.call_tool("remember", {"item": "x"}) == ('["x"]', False)
    content, is_error = await first.call_tool("explode", {"reason": "boom"})
    assert is_error and content == "RuntimeError: boom"
    with pytest.raises(InvalidArgumentError, match="has no tool 'missing'") as err:
        await first.call_tool("missing", {})
    assert err.value.reason == "TOOL_NOT_FOUND"
    with pytest.raises(InvalidArgumentError, match="argument 'a'='one' does not match") as err:
        await first.call_tool("add", {"a": "one"})
    assert err.value.reason == "TOOL_ARGS_INVALID"
    assert await first.submit("hi hi") == Grade(1.0, {"exact": 1.0}, {"n": 2})
    with pytest.raises(InvalidArgumentError, match="already submitted"):
        await first.submit("again")
    with pytest.raises(InvalidArgumentError, match="tool call after submit"):
        await first.call_tool("add", {"a": 1})
    await first.close()
    await first.close()  # idempotent: teardown runs once

    second = Episode.of(env, "chat", {"topic": "rl"}, episode_id="e2")
    prompt = await second.start()
    assert prompt[1] == {"role": "user", "content": "About rl?"}
    assert await second.call_tool("remember", {"item": "y"}) == ('["y"]', False), "state is per episode"
    await second.close()
    assert events == ["setup e1", "teardown e1", "setup e2", "teardown e2"]


async def test_protocol_order() -> None:
    episode = Episode.of(env, "echo", {"word": "a"})
    with pytest.raises(InvalidArgumentError, match="tool call before start"):
        await episode.call_tool("add", {"a": 1})
    with pytest.raises(InvalidArgumentError, match="submit before start"):
        await episode.submit("a")
    await episode.start()
    with pytest.raises(InvalidArgumentError, match="already started"):
        await episode.start()
    await episode.close()


@pytest.mark.parametrize(
    ("scenario", "message"),
    [
        ("nan_reward", r"reward nan is not a finite number in \[0, 1\]"),
        ("reward_above_one", r"reward 1.5 is not a finite number in \[0, 1\]"),
        ("negative_reward", r"reward -0.1 is not a finite number in \[0, 1\]"),
        ("third_yield", "yielded a third time"),
        ("raises_while_grading", "raised while grading: ZeroDivisionError"),
        ("string_reward", "the second yield must be a reward .* got str"),
        ("bool_reward", "the second yield must be a reward .* got bool"),
        ("no_second_yield", r"ended without yielding a reward \(no second yield\)"),
    ],
)
async def test_protocol_misuse_is_an_environment_error(scenario: str, message: str) -> None:
    episode = Episode.of(env, scenario, {})
    await episode.start()
    with pytest.raises(FailedPreconditionError, match=message) as err:
        await episode.submit("answer")
    assert err.value.reason == "ENVIRONMENT_ERROR" and err.value.code == "FAILED_PRECONDITION"
    await episode.close()


@pytest.mark.parametrize(
    ("scenario", "message"),
    [("no_prompt", "ended without yielding a prompt"), ("raises_before_prompt", "raised before its prompt: KeyError")],
)
async def test_scenario_failing_before_its_prompt(scenario: str, message: str) -> None:
    episode = Episode.of(env, scenario, {})
    with pytest.raises(FailedPreconditionError, match=message):
        await episode.start()
    await episode.close()


def test_registration_errors() -> None:
    with pytest.raises(TypeError, match="must be an async generator function"):

        @env.scenario()
        async def not_a_generator():
            return 1

    with pytest.raises(ValueError, match="already has a tool 'add'"):
        env.tool("add")(lambda: 0)
    with pytest.raises(ValueError, match="exactly one of 'command'"):
        env.connect_mcp_config({"mcpServers": {"bad": {}}})


def test_task_is_plain_data() -> None:
    task = Task("e", "s", {"x": 1})
    assert task.to_dict() == {"env": "e", "scenario": "s", "args": {"x": 1}} and task.args_json == '{"x": 1}'
