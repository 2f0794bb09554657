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
            from mcp import Client
        except ImportError:
            raise ImportError("MCP tools need the mcp SDK: pip install 'yieldloop[mcp]'") from None
        ready: asyncio.Future = asyncio.get_running_loop().create_future()

        async def run() -> None:
            try:
                async with Client(self._target()) as client:
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

    async def call(self, tool: str, arguments: dict[str, Any]) -> str:
        result = await self.client.call_tool(tool, arguments)
        text = "\n".join(getattr(block, "text", "") or json.dumps(block.model_dump(mode="json")) for block in result.content)
        if not text and result.structured_content is not None:
            text = json.dumps(result.structured_content)
        if result.is_error:
            raise RuntimeError(text or f"MCP tool {tool!r} failed")
        return text


def _mcp_tool(connection: McpConnection, spec: Any) -> Tool:
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
        for spec in (await connection.client.list_tools()).tools:
            env.add_tool(_mcp_tool(connection, spec))
            connection.tool_names.append(spec.name)


async def disconnect_all(env: Environment) -> None:
    """Closes the sessions and unregisters their tools."""
    for connection in env.mcp_connections.values():
        for name in connection.tool_names:
            env.tools.pop(name, None)
        await connection.close()
    env.mcp_connections.clear()
