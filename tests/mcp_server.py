"""A small MCP server for the tests: ``python tests/mcp_server.py stdio`` or ``... http PORT``."""

from __future__ import annotations

import sys

from mcp.server.mcpserver import MCPServer

server = MCPServer("yieldloop-test-tools", log_level="CRITICAL")


@server.tool()
def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b


@server.tool()
def shout(text: str) -> str:
    """Upper-cases text."""
    return text.upper()


@server.tool()
def refuse(reason: str) -> str:
    """Always fails."""
    raise ValueError(reason)


if __name__ == "__main__":
    if sys.argv[1] == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
