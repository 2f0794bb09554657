"""A HUD environment, written with the HUD SDK only (as a HUD user writes one): a two-yield template and an MCP
tool the agent may call, served by FastMCP on loopback and published as the environment's ``tools`` capability.

The tool's calls are counted in module state (``CALLS``), so one process per episode keeps episodes apart.
"""

from __future__ import annotations

import asyncio
import socket

from hud import Environment
from hud.capabilities import Capability

env = Environment(name="hud-letters")
CALLS: list[str] = []
_SERVING: list[asyncio.Task] = []


@env.initialize
async def serve_tools() -> None:
    from fastmcp import FastMCP

    tools = FastMCP(name="letters-tools")

    @tools.tool()
    def count(letter: str) -> int:
        """Counts how often `letter` occurs in the word 'banana'."""
        CALLS.append(letter)
        return "banana".count(letter)

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    _SERVING.append(
        asyncio.create_task(tools.run_async(transport="http", host="127.0.0.1", port=port, show_banner=False))
    )
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.02)
            continue
        writer.close()
        break
    env.add_capability(Capability.mcp(name="tools", url=f"http://127.0.0.1:{port}/mcp"))


@env.template()
async def repeat(letter: str = "a"):
    """Write one letter many times; the reward is the share of the answer that is that letter."""
    answer = yield f"Write the letter {letter} many times."
    text = answer if isinstance(answer, str) else str(answer or "")
    yield text.count(letter) / max(len(text), 1)


@env.template()
async def tool_calls(letter: str = "a"):
    """Rewards an episode by the count tool's calls for ``letter`` (the module state of this episode's process)."""
    yield f"How many times does the letter {letter} occur in 'banana'? Use the count tool, then answer."
    yield float(CALLS.count(letter))


tasks = [repeat(letter=letter) for letter in "abcd"]
