"""A small MCP server for the tests.

``python tests/mcp_server.py stdio [PREFIX]`` or ``python tests/mcp_server.py http PORT [PREFIX]``;
every tool name starts with PREFIX (so two servers can serve one environment).
"""

from __future__ import annotations

import sys

from mcp.server.mcpserver import MCPServer


def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b


def shout(text: str) -> str:
    """Upper-cases text."""
    return text.upper()


def refuse(reason: str) -> str:
    """Always fails."""
    raise ValueError(reason)


def make_server(prefix: str) -> MCPServer:
    server = MCPServer("yieldloop-test-tools", log_level="CRITICAL")
    for fn in (add, shout, refuse):
        server.tool(name=prefix + fn.__name__)(fn)
    return server


if __name__ == "__main__":
    if sys.argv[1] == "stdio":
        make_server(sys.argv[2] if len(sys.argv) > 2 else "").run("stdio")
    else:
        make_server(sys.argv[3] if len(sys.argv) > 3 else "").run(
            "streamable-http", host="127.0.0.1", port=int(sys.argv[2])
        )
