"""The environment SDK: tools, two-yield scenarios, tasks and the episode runner.

An environment is written like this::

    env = Environment("letters")

    @env.tool()
    def count(text: str, letter: str) -> int:
        "Counts how often `letter` occurs in `text`."
        return text.count(letter)

    @env.scenario()
    async def repeat(letter: str):
        answer = yield f"Write the letter {letter} many times."
        yield answer.count(letter) / max(len(answer), 1)

    task = repeat.task(letter="a")

The first ``yield`` sends the prompt; the agent's answer is sent back in; the
second ``yield`` returns the reward, a float in [0, 1] or a :class:`Grade`.
:class:`Episode` drives one scenario instance and enforces that protocol.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import math
import types
import typing
from collections.abc import AsyncGenerator, Callable
from typing import Any

from yieldloop.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError

Prompt = str | list[dict[str, str]]


@dataclasses.dataclass(frozen=True)
class Grade:
    """A reward with optional subscores and extra information."""

    reward: float
    subscores: dict[str, float] = dataclasses.field(default_factory=dict)
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Task:
    """A scenario bound to validated arguments: one unit of eval and training."""

    env: str
    scenario: str
    args: dict[str, Any]

    @property
    def task_id(self) -> str:
        """A stable id derived from env, scenario and arguments."""
        blob = json.dumps([self.env, self.scenario, self.args], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def args_json(self) -> str:
        return json.dumps(self.args, sort_keys=True)


_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


def json_schema_for(annotation: Any) -> dict[str, Any]:
    """A JSON schema for a Python type hint (the common cases; anything else is unconstrained)."""
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (list, tuple, set):
        return {"type": "array", "items": json_schema_for(args[0]) if args else {}}
    if origin is dict or annotation is dict:
        return {"type": "object"}
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        options = [json_schema_for(a) for a in args if a is not type(None)]
        return options[0] if len(options) == 1 else {"anyOf": options}
    return {}


def signature_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """JSON schema (object) of a function's parameters, from its type hints."""
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, param in inspect.signature(fn).parameters.items():
        properties[name] = json_schema_for(hints.get(name, Any))
        if param.default is inspect.Parameter.empty:
            required.append(name)
    return {"type": "object", "properties": properties, "required": required}


def bind_arguments(fn: Callable[..., Any], args: dict[str, Any], *, what: str) -> dict[str, Any]:
    """Binds keyword arguments to ``fn``'s signature; a mismatch is INVALID_ARGUMENT."""
    try:
        bound = inspect.signature(fn).bind(**args)
    except TypeError as exc:
        raise InvalidArgumentError(f"{what}: {exc}", reason="SCENARIO_ARGS_INVALID") from exc
    return dict(bound.arguments)


@dataclasses.dataclass
class Tool:
    """An agent-callable function with a JSON schema for its arguments."""

    name: str
    description: str
    fn: Callable[..., Any]
    parameters: dict[str, Any]

    async def call(self, arguments: dict[str, Any]) -> Any:
        result = self.fn(**arguments)
        if inspect.isawaitable(result):
            result = await result
        return result


@dataclasses.dataclass
class Scenario:
    """A registered two-yield async generator."""

    env: Environment
    name: str
    description: str
    fn: Callable[..., AsyncGenerator[Any, Any]]

    @property
    def args_schema(self) -> dict[str, Any]:
        return signature_schema(self.fn)

    def task(self, **args: Any) -> Task:
        """Binds and validates ``args`` against the scenario's signature."""
        bind_arguments(self.fn, args, what=f"scenario {self.name!r}")
        return Task(env=self.env.name, scenario=self.name, args=args)


class Environment:
    """A named set of tools and scenarios."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tools: dict[str, Tool] = {}
        self.scenarios: dict[str, Scenario] = {}

    def tool(self, name: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Registers a typed function (sync or async) as a tool; returns it unchanged."""

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            tool_name = name or fn.__name__
            description = inspect.getdoc(fn) or ""
            self.tools[tool_name] = Tool(tool_name, description, fn, signature_schema(fn))
            return fn

        return register

    def scenario(self, name: str | None = None) -> Callable[[Callable[..., Any]], Scenario]:
        """Registers a two-yield async generator function as a scenario."""

        def register(fn: Callable[..., Any]) -> Scenario:
            if not inspect.isasyncgenfunction(fn):
                raise TypeError(f"scenario {fn.__name__!r} must be an async generator function")
            scenario = Scenario(self, name or fn.__name__, inspect.getdoc(fn) or "", fn)
            self.scenarios[scenario.name] = scenario
            return scenario

        return register

    def get_scenario(self, name: str) -> Scenario:
        if name not in self.scenarios:
            raise NotFoundError(
                f"environment {self.name!r} has no scenario {name!r}; known: {sorted(self.scenarios)}",
                reason="SCENARIO_NOT_FOUND",
            )
        return self.scenarios[name]

    def episode(self, scenario: str, args: dict[str, Any]) -> Episode:
        """A fresh episode of ``scenario`` (arguments validated now)."""
        spec = self.get_scenario(scenario)
        return Episode(self, spec, bind_arguments(spec.fn, args, what=f"scenario {scenario!r}"))


def _environment_error(message: str) -> FailedPreconditionError:
    return FailedPreconditionError(message, reason="ENVIRONMENT_ERROR")


def _check_grade(value: Any, scenario: str) -> Grade:
    grade = value if isinstance(value, Grade) else None
    if grade is None and isinstance(value, (int, float)) and not isinstance(value, bool):
        grade = Grade(float(value))
    if grade is None:
        raise _environment_error(f"scenario {scenario!r} yielded {type(value).__name__}, not a reward")
    if not math.isfinite(grade.reward) or not 0.0 <= grade.reward <= 1.0:
        raise _environment_error(f"scenario {scenario!r} yielded reward {grade.reward!r}, outside [0, 1]")
    return grade


class Episode:
    """One run of a scenario: prompt, tool calls, then the graded answer."""

    def __init__(self, env: Environment, scenario: Scenario, args: dict[str, Any]) -> None:
        self.env = env
        self.scenario = scenario
        self._gen = scenario.fn(**args)
        self._started = False
        self._graded = False

    async def start(self) -> Prompt:
        """Runs the scenario to its first yield and returns the prompt."""
        if self._started:
            raise InvalidArgumentError("episode already started", reason="EPISODE_PROTOCOL")
        self._started = True
        try:
            prompt = await self._gen.__anext__()
        except StopAsyncIteration:
            raise _environment_error(f"scenario {self.scenario.name!r} ended without yielding a prompt")
        except Exception as exc:  # user code: report, never crash the service
            raise _environment_error(f"scenario {self.scenario.name!r} raised: {exc!r}") from exc
        if not isinstance(prompt, (str, list)):
            raise _environment_error(f"scenario {self.scenario.name!r} yielded a {type(prompt).__name__} prompt")
        return prompt

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """Calls a tool; an exception becomes an error result the agent sees."""
        if not self._started or self._graded:
            raise InvalidArgumentError("tool call outside a running episode", reason="EPISODE_PROTOCOL")
        tool = self.env.tools.get(name)
        if tool is None:
            raise InvalidArgumentError(
                f"no tool {name!r}; known: {sorted(self.env.tools)}", reason="TOOL_NOT_FOUND"
            )
        try:
            result = await tool.call(arguments)
        except Exception as exc:  # the agent sees the error and may recover
            return f"{type(exc).__name__}: {exc}", True
        return (result if isinstance(result, str) else json.dumps(result)), False

    async def submit(self, answer: str) -> Grade:
        """Sends the answer into the scenario and returns its grade."""
        if not self._started or self._graded:
            raise InvalidArgumentError("submit outside a running episode", reason="EPISODE_PROTOCOL")
        self._graded = True
        try:
            value = await self._gen.asend(answer)
        except StopAsyncIteration:
            raise _environment_error(f"scenario {self.scenario.name!r} ended without yielding a reward")
        except Exception as exc:
            raise _environment_error(f"scenario {self.scenario.name!r} raised: {exc!r}") from exc
        grade = _check_grade(value, self.scenario.name)
        try:
            await self._gen.asend(None)
        except StopAsyncIteration:
            return grade
        except Exception as exc:
            raise _environment_error(f"scenario {self.scenario.name!r} raised after grading: {exc!r}") from exc
        raise _environment_error(f"scenario {self.scenario.name!r} yielded a third time")

    async def close(self) -> None:
        """Finalises the generator (runs its ``finally`` blocks)."""
        await self._gen.aclose()
