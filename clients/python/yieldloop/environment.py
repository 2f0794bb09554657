"""The environment SDK: tools, two-yield scenarios, hooks, tasks.

An environment is written like this::

    env = Environment("letters", tool_timeout_s=10)

    @env.setup()
    def fresh_state(ctx: EpisodeContext) -> None:
        ctx.state["calls"] = 0

    @env.tool()
    def count(text: str, letter: str, ctx: EpisodeContext) -> int:
        "Counts how often `letter` occurs in `text`."
        ctx.state["calls"] += 1
        return text.count(letter)

    @env.scenario()
    async def repeat(letter: str):
        answer = yield f"Write the letter {letter} many times."
        yield answer.count(letter) / max(len(answer), 1)

    task = repeat.task(letter="a")

The first ``yield`` sends the prompt (a string or chat messages); the agent's
answer is sent back in; the second ``yield`` returns the reward, a float in
[0, 1] or a :class:`Grade`. A parameter annotated :class:`EpisodeContext`
(on a tool, a scenario or a hook) receives the episode's context, whose
``state`` is fresh for every episode. :class:`~yieldloop.episode.Episode`
drives one scenario instance and enforces the protocol.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
from collections.abc import AsyncGenerator, Callable
from typing import Any

from yieldloop.errors import NotFoundError
from yieldloop.schema import docstring_args, injected_parameters, signature_schema, validate_arguments


class RawText(str):
    """A prompt given to the model as it is, not as a chat message: ``yield RawText("12 + 30 =")``.

    For completion tasks on base models. (A model whose tokenizer has no chat template gets every prompt as
    raw text: a plain string as it is, chat messages joined by newlines.)
    """

    __slots__ = ()


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

    def to_dict(self) -> dict[str, Any]:
        return {"env": self.env, "scenario": self.scenario, "args": self.args}


@dataclasses.dataclass(frozen=True)
class FinalCompletion:
    """The model's final turn, as the agent submitted it with the answer."""

    text: str
    token_ids: tuple[int, ...] = ()
    """The ids the model sampled (with the end-of-sequence token when it wrote one)."""
    stop_reason: str = ""
    """"eos", "length", "stop_string", "context", "cancelled", or "" when the agent did not say."""


@dataclasses.dataclass
class EpisodeContext:
    """What one episode's tools, scenario and hooks share; fresh for every episode."""

    episode_id: str
    task: Task
    state: dict[str, Any] = dataclasses.field(default_factory=dict)
    completion: FinalCompletion | None = None
    """Set when the answer arrives, before the scenario's grading resumes (None when the agent sent only text):
    a scenario taking ``ctx`` can grade how the answer ended and which tokens spelled it."""


async def call_maybe_async(fn: Callable[..., Any], *args: Any, is_async: bool | None = None, **kwargs: Any) -> Any:
    """Calls a sync or async function; sync ones run in a thread so they never block the event loop."""
    if inspect.iscoroutinefunction(fn) if is_async is None else is_async:
        return await fn(*args, **kwargs)
    import asyncio

    return await asyncio.to_thread(fn, *args, **kwargs)


@dataclasses.dataclass
class Tool:
    """An agent-callable function with a JSON schema for its arguments."""

    name: str
    description: str
    fn: Callable[..., Any]
    parameters: dict[str, Any]
    context_params: set[str] = dataclasses.field(default_factory=set)

    def __post_init__(self) -> None:
        self.is_async = inspect.iscoroutinefunction(self.fn)
        self._what = f"tool {self.name!r}"

    def validate(self, arguments: dict[str, Any]) -> None:
        validate_arguments(arguments, self.parameters, what=self._what, reason="TOOL_ARGS_INVALID")

    async def call(self, arguments: dict[str, Any], ctx: EpisodeContext) -> Any:
        if self.context_params:
            arguments = dict(arguments)
            for param in self.context_params:
                arguments[param] = ctx
        if self.is_async:  # (no detour through call_maybe_async: a tool call is the message sent most)
            return await self.fn(**arguments)
        return await call_maybe_async(self.fn, is_async=False, **arguments)


@dataclasses.dataclass
class Scenario:
    """A registered two-yield async generator."""

    env: Environment
    name: str
    description: str
    fn: Callable[..., AsyncGenerator[Any, Any]]

    def __post_init__(self) -> None:
        # Computed once: type-hint resolution is far too slow for every episode.
        self.context_params = injected_parameters(self.fn, EpisodeContext)
        self.args_schema = signature_schema(self.fn, skip=self.context_params)

    def validate(self, args: dict[str, Any]) -> None:
        """Checks arguments against the signature's schema (INVALID_ARGUMENT / SCENARIO_ARGS_INVALID)."""
        validate_arguments(args, self.args_schema, what=f"scenario {self.name!r}", reason="SCENARIO_ARGS_INVALID")

    def task(self, **args: Any) -> Task:
        """Binds and validates ``args`` against the scenario's signature."""
        self.validate(args)
        return Task(env=self.env.name, scenario=self.name, args=args)


class Environment:
    """A named set of tools, scenarios and per-episode hooks.

    Args:
        name: The environment's name (tasks refer to it).
        episode_timeout_s: Longest an episode may live, start to grade (a gRPC
            deadline shorter than this wins).
        tool_timeout_s: Longest one tool call may take.
    """

    def __init__(self, name: str, *, episode_timeout_s: float = 600.0, tool_timeout_s: float = 60.0) -> None:
        self.name = name
        self.episode_timeout_s = episode_timeout_s
        self.tool_timeout_s = tool_timeout_s
        self.tools: dict[str, Tool] = {}
        self.scenarios: dict[str, Scenario] = {}
        self.setup_hooks: list[Callable[..., Any]] = []
        self.teardown_hooks: list[Callable[..., Any]] = []
        self.mcp_servers: dict[str, dict[str, Any]] = {}
        self.mcp_connections: dict[str, Any] = {}
        """Live MCP sessions by server name (see yieldloop.mcp_tools)."""
        self.start_hooks: list[Callable[[Environment], Any]] = []
        """Run (with the environment) when a host loads it, before the first episode: what the environment serves
        from comes up here, and may add scenarios and tools (:meth:`start`)."""
        self.stop_hooks: list[Callable[[Environment], Any]] = []
        self.reward_range: tuple[float, float] = (0.0, 1.0)
        """Rewards a scenario may yield (finite, within these bounds)."""

    def tool(self, name: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Registers a typed function (sync or async) as a tool; returns it unchanged."""

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            context = injected_parameters(fn, EpisodeContext)
            summary, _ = docstring_args(inspect.getdoc(fn) or "")
            self.add_tool(Tool(name or fn.__name__, summary, fn, signature_schema(fn, skip=context), context))
            return fn

        return register

    def add_tool(self, tool: Tool) -> None:
        if tool.name in self.tools:
            raise ValueError(f"environment {self.name!r} already has a tool {tool.name!r}")
        self.tools[tool.name] = tool

    def scenario(self, name: str | None = None) -> Callable[[Callable[..., Any]], Scenario]:
        """Registers a two-yield async generator function as a scenario."""

        def register(fn: Callable[..., Any]) -> Scenario:
            if not inspect.isasyncgenfunction(fn):
                raise TypeError(f"scenario {fn.__name__!r} must be an async generator function (two yields)")
            summary, _ = docstring_args(inspect.getdoc(fn) or "")
            scenario = Scenario(self, name or fn.__name__, summary, fn)
            self.scenarios[scenario.name] = scenario
            return scenario

        return register

    def setup(self) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Registers a hook run at the start of every episode, before the scenario (takes the context)."""

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.setup_hooks.append(fn)
            return fn

        return register

    def teardown(self) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Registers a hook run when every episode ends, however it ends (takes the context)."""

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.teardown_hooks.append(fn)
            return fn

        return register

    async def start(self) -> None:
        """Runs the start hooks; a host calls it once, after connecting the MCP servers
        (:func:`yieldloop.mcp_tools.connect_all`)."""
        for hook in self.start_hooks:
            await call_maybe_async(hook, self)

    async def stop(self) -> None:
        """Runs the stop hooks, in reverse."""
        for hook in reversed(self.stop_hooks):
            await call_maybe_async(hook, self)

    def connect_mcp_config(self, config: dict[str, Any]) -> None:
        """Adds the tools of MCP servers, in the common ``{"mcpServers": {name: {...}}}`` form.

        Each server is ``{"command": ..., "args": [...], "env": {...}}`` (stdio) or
        ``{"url": "http://.../mcp"}`` (streamable HTTP). Servers are connected
        when the environment is loaded (:meth:`~yieldloop.mcp_tools.connect`).
        """
        servers = config.get("mcpServers", config)
        for name, server in servers.items():
            if not ("command" in server) ^ ("url" in server):
                raise ValueError(f"MCP server {name!r} needs exactly one of 'command' (stdio) and 'url' (HTTP)")
            self.mcp_servers[name] = dict(server)

    def get_scenario(self, name: str) -> Scenario:
        if name not in self.scenarios:
            raise NotFoundError(
                f"environment {self.name!r} has no scenario {name!r}; known: {sorted(self.scenarios)}",
                reason="SCENARIO_NOT_FOUND",
            )
        return self.scenarios[name]
