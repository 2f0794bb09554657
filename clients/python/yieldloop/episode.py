"""One episode of a scenario: setup hooks, prompt, tool calls, the graded answer, teardown.

Protocol misuse is an error with a clear message, never a silent score: a
scenario that ends without a prompt or a reward, yields a reward that is not
a finite number in [0, 1], or yields a third time fails the episode with
FAILED_PRECONDITION / ENVIRONMENT_ERROR; so does a scenario or hook that raises.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from typing import Any

from yieldloop.environment import (
    Environment,
    EpisodeContext,
    FinalCompletion,
    Grade,
    Prompt,
    Scenario,
    Task,
    call_maybe_async,
)
from yieldloop.errors import FailedPreconditionError, InvalidArgumentError

log = logging.getLogger(__name__)


def environment_error(message: str) -> FailedPreconditionError:
    return FailedPreconditionError(message, reason="ENVIRONMENT_ERROR")


def protocol_error(message: str) -> InvalidArgumentError:
    return InvalidArgumentError(message, reason="EPISODE_PROTOCOL")


def check_grade(value: Any, scenario: str, bounds: tuple[float, float] = (0.0, 1.0)) -> Grade:
    """The Grade for a second-yield value, or ENVIRONMENT_ERROR saying what was wrong (a reward is finite and
    within the environment's ``bounds``)."""
    grade = value if isinstance(value, Grade) else None
    if grade is None and isinstance(value, (int, float)) and not isinstance(value, bool):
        grade = Grade(float(value))
    if grade is None:
        raise environment_error(
            f"scenario {scenario!r}: the second yield must be a reward (float in [0, 1] or Grade), "
            f"got {type(value).__name__}"
        )
    low, high = bounds
    if not math.isfinite(grade.reward) or not low <= grade.reward <= high:
        raise environment_error(
            f"scenario {scenario!r}: reward {grade.reward!r} is not a finite number in [{low:g}, {high:g}]"
        )
    return grade


class Episode:
    """One run of a scenario. Call :meth:`start`, any :meth:`call_tool`, :meth:`submit`, and always :meth:`close`."""

    def __init__(self, env: Environment, scenario: Scenario, args: dict[str, Any], ctx: EpisodeContext) -> None:
        self.env = env
        self.scenario = scenario
        self.ctx = ctx
        self._args = {**args, **{p: ctx for p in scenario.context_params}}
        self._gen = None
        self._started = False
        self._graded = False
        self._closed = False

    @classmethod
    def of(cls, env: Environment, scenario: str, args: dict[str, Any], episode_id: str = "") -> Episode:
        """A fresh episode of ``env``'s ``scenario`` (arguments validated now)."""
        spec = env.get_scenario(scenario)
        spec.validate(args)
        ctx = EpisodeContext(episode_id or uuid.uuid4().hex, Task(env.name, scenario, args))
        return cls(env, spec, args, ctx)

    @property
    def episode_id(self) -> str:
        return self.ctx.episode_id

    async def start(self) -> Prompt:
        """Runs the setup hooks and the scenario to its first yield; returns the prompt."""
        if self._started:
            raise protocol_error("the episode was already started")
        self._started = True
        name = self.scenario.name
        try:
            for hook in self.env.setup_hooks:
                await call_maybe_async(hook, self.ctx)
            self._gen = self.scenario.fn(**self._args)
            prompt = await self._gen.__anext__()
        except StopAsyncIteration:
            raise environment_error(f"scenario {name!r} ended without yielding a prompt") from None
        except Exception as exc:  # user code: report it, never crash the service
            raise environment_error(f"scenario {name!r} raised before its prompt: {exc!r}") from exc
        if not isinstance(prompt, (str, list)):
            raise environment_error(f"scenario {name!r}: the first yield must be a prompt, got {type(prompt).__name__}")
        return prompt

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """Calls a tool; an exception inside the tool becomes an error result the agent sees."""
        if not self._started:
            raise protocol_error("tool call before start")
        if self._graded:
            raise protocol_error("tool call after submit")
        tool = self.env.tools.get(name)
        if tool is None:
            raise InvalidArgumentError(
                f"environment {self.env.name!r} has no tool {name!r}; known: {sorted(self.env.tools)}",
                reason="TOOL_NOT_FOUND",
                field="call_tool.name",
            )
        tool.validate(arguments)
        try:
            result = await tool.call(arguments, self.ctx)
        except Exception as exc:  # the agent sees the error and may recover
            return f"{type(exc).__name__}: {exc}", True
        return (result if isinstance(result, str) else _to_json(result)), False

    async def submit(self, answer: str, completion: FinalCompletion | None = None) -> Grade:
        """Sends the answer into the scenario (``completion`` on the context first) and returns its grade."""
        if not self._started:
            raise protocol_error("submit before start")
        if self._graded:
            raise protocol_error("the answer was already submitted")
        self._graded = True
        self.ctx.completion = completion
        name = self.scenario.name
        try:
            value = await self._gen.asend(answer)
        except StopAsyncIteration:
            raise environment_error(f"scenario {name!r} ended without yielding a reward (no second yield)") from None
        except Exception as exc:
            raise environment_error(f"scenario {name!r} raised while grading: {exc!r}") from exc
        grade = check_grade(value, name, self.env.reward_range)
        try:
            await self._gen.asend(None)
        except StopAsyncIteration:
            return grade
        except Exception as exc:
            raise environment_error(f"scenario {name!r} raised after grading: {exc!r}") from exc
        raise environment_error(f"scenario {name!r} yielded a third time (a scenario yields exactly twice)")

    async def close(self) -> None:
        """Finalises the scenario and runs the teardown hooks (idempotent; always call it)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._gen is not None:
                await self._gen.aclose()
        finally:
            for hook in self.env.teardown_hooks:
                try:
                    await call_maybe_async(hook, self.ctx)
                except Exception:  # a failing teardown must not mask how the episode ended
                    log.exception("teardown hook %s of %r failed", hook.__name__, self.env.name)


def _to_json(value: Any) -> str:
    if type(value) is int or type(value) is float:  # the common case, without the encoder's machinery
        return repr(value)
    return json.dumps(value, default=str)
