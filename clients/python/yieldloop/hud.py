"""HUD environments served through EnvService, unchanged.

A HUD v6 environment (the HUD SDK's ``Environment``: ``@env.template()`` two-yield generators, tools published
as an MCP capability) runs in its own process, ``python -m hud.environment.server FILE``, and speaks
newline-delimited JSON-RPC 2.0 over TCP: ``hello`` (the session and its capabilities), ``tasks.list``,
``tasks.start`` (the prompt), ``tasks.grade`` (the reward), ``tasks.cancel``, ``bye``, and ``tunnel.open`` to
reach a capability through the control port. :class:`HudEnvironment` is a yieldloop :class:`Environment` that
plays them: each HUD template is a scenario (its arguments' JSON schema from the manifest), each tool of the
environment's MCP capability is a tool, an episode starts with ``tasks.start``, its tool calls go through MCP
(tunnelled through the control port, as the HUD SDK's own client does), its answer to ``tasks.grade``, and its
end (however it ends) sends ``tasks.cancel``.

The HUD SDK (``pip install 'yieldloop[hud]'``, or any interpreter that has ``hud``, named by ``python=`` or
``$YIELDLOOP_HUD_PYTHON``) is needed only by that process: EnvService itself imports nothing of it. Episodes
share one server process, each in its own control session, unless ``per_episode``: then every episode gets a
process of its own (for environments that keep state in their module). HUD rewards are any finite number.

EnvService loads one with ``--env-spec hud:path/to/env.py`` (``hud:FILE?env=NAME&per_episode=1&python=PATH``
for the options), or from a yieldloop environment file: ``env = HudEnvironment("path/to/env.py")``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import pathlib
import signal
import sys
import urllib.parse
from typing import Any

from yieldloop.environment import Environment, EpisodeContext, Grade, Prompt, Scenario, Tool
from yieldloop.episode import environment_error

log = logging.getLogger(__name__)

PORT_ANNOUNCEMENT = "HUD_SERVE_PORT="
"""What a HUD environment server prints once it listens (then its port)."""
FRAME_LIMIT = 16 << 20
MCP_PROTOCOL = "mcp"


def _frame(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


async def _read_frame(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    line = await reader.readline()
    return json.loads(line) if line else None


class _Control:
    """One control session with a HUD environment server: JSON-RPC calls, one at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    @classmethod
    async def open(cls, port: int, host: str = "127.0.0.1") -> _Control:
        reader, writer = await asyncio.open_connection(host, port, limit=FRAME_LIMIT)
        return cls(reader, writer)

    async def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        async with self._lock:
            msg_id = next(self._ids)
            self.writer.write(_frame({"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params or {}}))
            await self.writer.drain()
            while True:
                answer = await _read_frame(self.reader)
                if answer is None:
                    raise environment_error(f"the HUD environment closed the connection during {method}")
                if answer.get("id") == msg_id:
                    break
        if "error" in answer:
            raise environment_error(
                f"HUD environment: {method} failed: {answer['error'].get('message', answer['error'])}"
            )
        return answer.get("result") or {}

    async def close(self, goodbye: bool = True) -> None:
        if goodbye:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.call("bye"), 5.0)
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


class _ServerProcess:
    """``python -m hud.environment.server SOURCE``: started, its port read from its announcement, stopped."""

    def __init__(self, python: str, source: pathlib.Path, env: str | None) -> None:
        self.python, self.source, self.env = python, source, env
        self.process: asyncio.subprocess.Process | None = None
        self.port = 0
        self._drain: asyncio.Task[None] | None = None

    async def start(self, timeout_s: float) -> int:
        args = [self.python, "-m", "hud.environment.server", str(self.source), "--port", "0"]
        if self.env:
            args += ["--env", self.env]
        self.process = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            cwd=str(self.source.parent if self.source.is_file() else self.source),
            start_new_session=True,
        )
        assert self.process.stdout is not None
        seen: list[str] = []
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    line = await self.process.stdout.readline()
                    if not line:
                        raise environment_error(
                            f"the HUD environment {self.source} exited before serving: " + " | ".join(seen[-5:])
                        )
                    text = line.decode(errors="replace").strip()
                    if text.startswith(PORT_ANNOUNCEMENT):
                        self.port = int(text[len(PORT_ANNOUNCEMENT) :])
                        break
                    seen.append(text)
        except BaseException:
            await self.stop()
            raise
        self._drain = asyncio.create_task(self._log_output())
        return self.port

    async def _log_output(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        while line := await self.process.stdout.readline():
            log.debug("%s: %s", self.source.name, line.decode(errors="replace").rstrip())

    async def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)  # the environment's own daemons too
            try:
                await asyncio.wait_for(process.wait(), 10.0)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
        if self._drain is not None:
            self._drain.cancel()


class _Tunnel:
    """A loopback listener whose every connection reaches a capability through the server's control port
    (``tunnel.open``, then bytes both ways): the capability's URL need not be reachable from here."""

    def __init__(self, port: int, capability: dict[str, Any]) -> None:
        self.port, self.capability = port, capability
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._forward, "127.0.0.1", 0)
        local = self._server.sockets[0].getsockname()[1]
        parts = urllib.parse.urlsplit(self.capability["url"])
        return urllib.parse.urlunsplit((parts.scheme, f"127.0.0.1:{local}", parts.path, parts.query, parts.fragment))

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._pipes.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port, limit=FRAME_LIMIT)
            up_writer.write(
                _frame(
                    {
                        "jsonrpc": "2.0",
                        "id": 1,
                        "method": "tunnel.open",
                        "params": {"capability": self.capability["name"]},
                    }
                )
            )
            await up_writer.drain()
            opened = await _read_frame(up_reader)
            if opened is None or "error" in opened:
                log.warning("tunnel.open %r refused: %s", self.capability["name"], opened)
                up_writer.close()
                return
            await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
        except OSError as err:
            log.warning("tunnel to %r failed: %s", self.capability["name"], err)
        except asyncio.CancelledError:  # the session closed: a connection handler ends quietly
            pass
        finally:
            writer.close()
            self._pipes.discard(task)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for pipe in list(self._pipes):
                pipe.cancel()
            await asyncio.gather(*self._pipes, return_exceptions=True)
            self._server = None


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.close()


class _Session:
    """One control session (with its own server process when per episode) and an MCP client to its tools."""

    def __init__(self) -> None:
        self.process: _ServerProcess | None = None
        self.control: _Control | None = None
        self.tunnel: _Tunnel | None = None
        self.mcp: Any = None
        self.bindings: list[dict[str, Any]] = []
        self.env: dict[str, Any] = {}
        self.graded = False
        """tasks.grade answered (nothing to cancel)."""

    @classmethod
    async def open(cls, port: int, process: _ServerProcess | None = None) -> _Session:
        from yieldloop.mcp_tools import McpConnection

        session = cls()
        session.process = process
        try:
            session.control = await _Control.open(port)
            hello = await session.control.call("hello")
            session.bindings, session.env = hello.get("bindings", []), hello.get("env", {})
            tools = next((b for b in session.bindings if b.get("protocol", "").split("/")[0] == MCP_PROTOCOL), None)
            if tools is not None:
                session.tunnel = _Tunnel(port, tools)
                url = await session.tunnel.start()
                session.mcp = McpConnection(tools["name"], {"url": url})
                await session.mcp.open()
        except BaseException:
            await session.close()
            raise
        return session

    async def close(self, goodbye: bool = True) -> None:
        if self.mcp is not None:
            await self.mcp.close()
        if self.tunnel is not None:
            await self.tunnel.stop()
        if self.control is not None:
            await self.control.close(goodbye)
        if self.process is not None:
            await self.process.stop()


def _prompt(value: Any) -> Prompt:
    """A HUD prompt (text, or prompt messages whose content is a text block) as a yieldloop prompt."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        messages = []
        for message in value:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, dict):
                content = content.get("text", "")
            elif isinstance(content, list):
                content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
            messages.append({"role": str(message.get("role", "user")), "content": str(content or "")})
        return messages
    raise environment_error(f"the HUD environment's prompt is neither text nor messages: {type(value).__name__}")


class HudEnvironment(Environment):
    """A HUD environment, run by its own server process, as a yieldloop environment (see the module docstring).

    Args:
        source: The HUD environment's ``.py`` file (or directory), as ``python -m hud.environment.server`` takes.
        env: Which ``Environment`` of the source, when it defines several.
        python: The interpreter that has the HUD SDK (default: ``$YIELDLOOP_HUD_PYTHON``, else this one).
        per_episode: A server process per episode instead of one shared by every episode.
        name: The environment's name for yieldloop tasks (default: the HUD environment's own name).
        ready_timeout_s: How long a server may take to start (its ``@env.initialize`` hooks).
    """

    def __init__(
        self,
        source: str | os.PathLike[str],
        *,
        env: str | None = None,
        python: str | None = None,
        per_episode: bool = False,
        name: str | None = None,
        ready_timeout_s: float = 120.0,
        episode_timeout_s: float = 600.0,
        tool_timeout_s: float = 60.0,
    ) -> None:
        self.source = pathlib.Path(source).resolve()
        super().__init__(name or self.source.stem, episode_timeout_s=episode_timeout_s, tool_timeout_s=tool_timeout_s)
        self.hud_env, self.per_episode, self.ready_timeout_s = env, per_episode, ready_timeout_s
        python = python or os.environ.get("YIELDLOOP_HUD_PYTHON") or sys.executable
        # A relative path is this process's (the server runs in the source's folder); a venv's python is a link
        # that must stay one (the venv is found through it).
        self.python = os.path.abspath(python) if os.sep in python else python
        self._named = name is not None
        self.reward_range = (-math.inf, math.inf)
        self._shared: _ServerProcess | None = None
        self.start_hooks.append(self._discover)
        self.stop_hooks.append(self._shutdown)
        self.setup_hooks.append(self._open_session)
        self.teardown_hooks.append(self._close_session)

    async def _server(self) -> _ServerProcess:
        process = _ServerProcess(self.python, self.source, self.hud_env)
        await process.start(self.ready_timeout_s)
        return process

    async def _discover(self, _: Environment) -> None:
        """Starts a server and learns the templates and tools; kept as the shared server unless per episode."""
        process = await self._server()
        session = await _Session.open(process.port)
        try:
            if not self._named and session.env.get("name"):
                self.name = session.env["name"]
            assert session.control is not None
            for entry in (await session.control.call("tasks.list")).get("tasks", []):
                self._add_template(entry)
            if session.mcp is not None:
                for spec in await session.mcp.list_tool_specs():
                    self.add_tool(self._tool(spec))
        finally:
            await session.close()
        if self.per_episode:
            await process.stop()
        else:
            self._shared = process

    async def _shutdown(self, _: Environment) -> None:
        if self._shared is not None:
            await self._shared.stop()
            self._shared = None

    def _add_template(self, entry: dict[str, Any]) -> None:
        task_id = entry["id"]

        async def play(ctx: EpisodeContext, **args: Any) -> Any:
            session: _Session = ctx.state["hud"]
            assert session.control is not None
            frame = await session.control.call("tasks.start", {"id": task_id, "args": args})
            answer = yield _prompt(frame.get("prompt", ""))
            graded = await session.control.call("tasks.grade", {"answer": answer})
            session.graded = True
            score = graded.get("score")
            if isinstance(score, bool) or not isinstance(score, (int, float)):
                raise environment_error(f"HUD task {task_id!r} graded without a numeric score: {graded}")
            yield Grade(float(score), info={k: v for k, v in graded.items() if k != "score"})

        scenario = Scenario(self, task_id, entry.get("description") or "", play)
        scenario.args_schema = dict(entry.get("args") or {"type": "object", "properties": {}})
        scenario.args_schema.setdefault("properties", {})
        scenario.args_schema.setdefault("required", [])
        self.scenarios[task_id] = scenario

    def _tool(self, spec: Any) -> Tool:
        name = spec.name

        async def call(ctx: EpisodeContext, **arguments: Any) -> str:
            session: _Session = ctx.state["hud"]
            return await session.mcp.call(name, arguments)

        schema = hud_agent_schema(spec.input_schema) if spec.input_schema else {"type": "object", "properties": {}}
        return Tool(name, spec.description or f"Call {name}", call, schema, {"ctx"})

    async def _open_session(self, ctx: EpisodeContext) -> None:
        if self.per_episode:
            process = await self._server()
            ctx.state["hud"] = await _Session.open(process.port, process)
        else:
            if self._shared is None:
                raise environment_error(f"the HUD environment {self.name!r} is not started")
            ctx.state["hud"] = await _Session.open(self._shared.port)

    async def _close_session(self, ctx: EpisodeContext) -> None:
        session: _Session | None = ctx.state.pop("hud", None)
        if session is None:
            return
        if session.control is not None and not session.graded:
            with contextlib.suppress(Exception):  # the episode ended before its grade: the task is cancelled
                await asyncio.wait_for(session.control.call("tasks.cancel"), 5.0)
        await session.close()


_HUD_SCHEMA_KEYS = ("type", "description", "enum", "required", "default", "minimum", "maximum", "minItems", "maxItems")


def hud_agent_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A tool's MCP input schema as the HUD SDK's OpenAI-compatible agent sends it to the model (its
    ``_sanitize_schema_for_openai``): the keys chat tools take, ``anyOf`` reduced to its first non-null branch,
    ``prefixItems`` to an array, everything else (titles, ``additionalProperties``, ...) dropped. The model sees
    the same tool text whether an episode runs through EnvService or through the HUD SDK's own agent, so what it
    learns on one path holds on the other."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "anyOf" and isinstance(value, list):
            branches = [b for b in value if isinstance(b, dict) and b.get("type") != "null"]
            if branches:
                out.update(hud_agent_schema(branches[0]))
            else:
                out["type"] = "string"
        elif key == "prefixItems" and isinstance(value, list):
            out["type"] = "array"
            first = value[0] if value else None
            out["items"] = {"type": first.get("type", "string") if isinstance(first, dict) else "string"}
        elif key == "properties" and isinstance(value, dict):
            out[key] = {k: hud_agent_schema(v) for k, v in value.items() if isinstance(v, dict)}
        elif key == "items" and isinstance(value, dict):
            out[key] = hud_agent_schema(value)
        elif key in _HUD_SCHEMA_KEYS:
            out[key] = value
    return out or {"type": "object"}


def from_spec(spec: str) -> HudEnvironment:
    """``hud:FILE`` with options as a query: ``hud:env.py?env=NAME&per_episode=1&python=/path/bin/python``."""
    target, _, query = spec.removeprefix("hud:").partition("?")
    options = dict(urllib.parse.parse_qsl(query))
    unknown = set(options) - {"env", "per_episode", "python", "name"}
    if unknown:
        raise ValueError(f"{spec!r}: unknown options {sorted(unknown)} (env, per_episode, python, name)")
    return HudEnvironment(
        target,
        env=options.get("env"),
        python=options.get("python"),
        name=options.get("name"),
        per_episode=options.get("per_episode", "0").lower() in ("1", "true", "yes"),
    )
