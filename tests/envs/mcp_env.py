"""An environment whose tools come from MCP servers: one over stdio, one over streamable HTTP ($YL_MCP_URL)."""

from __future__ import annotations

import os
import pathlib
import sys

from yieldloop.environment import Environment

env = Environment("mcp")
_servers = {
    "local": {"command": sys.executable, "args": [str(pathlib.Path(__file__).parents[1] / "mcp_server.py"), "stdio"]}
}
if os.environ.get("YL_MCP_URL"):
    _servers["web"] = {"url": os.environ["YL_MCP_URL"]}
env.connect_mcp_config({"mcpServers": _servers})


@env.scenario()
async def add_up(a: int, b: int):
    """Asks for a + b; the agent may use the add tool."""
    answer = yield f"What is {a} + {b}?"
    yield 1.0 if answer.strip() == str(a + b) else 0.0
