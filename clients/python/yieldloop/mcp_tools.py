"""Tools from MCP servers (stdio and streamable HTTP), through the official ``mcp`` SDK.

``env.connect_mcp_config({...})`` records the servers; when the environment is
loaded into a host, :func:`connect_all` opens one client session per server,
lists its tools and registers each as an environment tool whose calls go to
that session. The sessions live as long as the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from typing import Any

from yieldloop.environment import Environment, EpisodeContext, Tool

log = logging.getLogger(__name__)


@dataclasses.dataclass
class McpConnection:
    """One MCP client session, entered and exited inside its own task (anyio scopes require it)."""

    name: str
    server: dict[str, Any]
    client: Any = None
    tool_names: list[str] = dataclasses.field(default_factory=list)
    _task: asyncio.Task | None = None
    _stop: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    def _target(self) -> Any:
        if "url" in self.server:
            return self.server["url"]
        from mcp import StdioServerParameters

        return StdioServerParameters(
            command=self.server["command"], args=list(self.server.get("args", [])), env=self.server.get("env")
        )

    async def open(self, timeout_s: float = 60.0) -> None:
        try:
            import mcp
        except ImportError:
            raise ImportError("MCP tools need the mcp SDK: pip install 'yieldloop[mcp]'") from None
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        target = self._target()

        async def run() -> None:
            try:
                async with mcp.Client(target) if hasattr(mcp, "Client") else _Session1(target) as client:
                    self.client = client
                    ready.set_result(None)
                    await self._stop.wait()
            except Exception as exc:  # surfaced to open(), which raises it
                if not ready.done():
                    ready.set_exception(exc)
                else:
                    log.error("MCP server %r disconnected: %r", self.name, exc)

        self._task = asyncio.create_task(run())
        await asyncio.wait_for(ready, timeout_s)

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task

    async def list_tool_specs(self) -> list[ToolSpec]:
        """The server's tools (name, description, JSON schema of the arguments)."""
        return [
            ToolSpec(spec.name, spec.description or "", _field(spec, "input_schema", "inputSchema"))
            for spec in (await self.client.list_tools()).tools
        ]

    async def call(self, tool: str, arguments: dict[str, Any]) -> str:
        result = await self.client.call_tool(tool, arguments)
        text = "\n".join(
            getattr(block, "text", "") or json.dumps(block.model_dump(mode="json")) for block in result.content
        )
        structured = _field(result, "structured_content", "structuredContent")
        if not text and structured is not None:
            text = json.dumps(structured)
        if _field(result, "is_error", "isError"):
            raise RuntimeError(text or f"MCP tool {tool!r} failed")
        return text


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    input_schema: dict[str, Any] | None


def _field(obj: Any, name: str, older: str) -> Any:
    """A field of an MCP type by its name in mcp 2 or, failing that, in mcp 1 (camelCase)."""
    value = getattr(obj, name, None)
    return value if value is not None else getattr(obj, older, None)


class _Session1:
    """mcp 1.x's client (no ``mcp.Client`` there): a transport and an initialized ``ClientSession``. The HUD SDK
    pins mcp < 2, so an environment that has both gets this one."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Any:
        from mcp import ClientSession

        if isinstance(self.target, str):
            from mcp.client.streamable_http import streamablehttp_client

            read, write, _ = await self._stack.enter_async_context(streamablehttp_client(self.target))
        else:
            from mcp.client.stdio import stdio_client

            read, write = await self._stack.enter_async_context(stdio_client(self.target))
        session = await self._stack.enter_async_context(ClientSession(read, write))
        await session.initialize()
        return session

    async def __aexit__(self, *exc: Any) -> None:
        await self._stack.__aexit__(*exc)


def _mcp_tool(connection: McpConnection, spec: ToolSpec) -> Tool:
    async def call(ctx: EpisodeContext, **arguments: Any) -> str:
        return await connection.call(spec.name, arguments)

    schema = dict(spec.input_schema or {"type": "object", "properties": {}})
    schema.setdefault("properties", {})
    schema.setdefault("required", [])
    return Tool(spec.name, spec.description or "", call, schema, {"ctx"})


async def connect_all(env: Environment) -> None:
    """Connects the environment's MCP servers and registers their tools (no-op without servers)."""
    for name, server in env.mcp_servers.items():
        if name in env.mcp_connections:
            continue
        connection = McpConnection(name, server)
        await connection.open()
        env.mcp_connections[name] = connection
        for spec in await connection.list_tool_specs():
            env.add_tool(_mcp_tool(connection, spec))
            connection.tool_names.append(spec.name)


async def disconnect_all(env: Environment) -> None:
    """Closes the sessions and unregisters their tools."""
    for connection in env.mcp_connections.values():
        for name in connection.tool_names:
            env.tools.pop(name, None)
        await connection.close()
    env.mcp_connections.clear()
