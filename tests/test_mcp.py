"""MCP tools (stdio and streamable HTTP servers) listed and called through EnvService episodes."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest
import pytest_asyncio

from yieldloop.client import Client
from yieldloop.proto.common.v1 import common_pb2 as common_pb
from yieldloop_server.env.hosts import HostConfig, create_host
from yieldloop_server.env.server import make_server as build

HERE = pathlib.Path(__file__).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def http_mcp_url():
    port = free_port()
    process = subprocess.Popen([sys.executable, str(HERE / "mcp_server.py"), "http", str(port), "web_"])
    try:
        for _ in range(200):
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert process.poll() is None, "MCP HTTP server exited"
            import time

            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.terminate()
        process.wait(10)


@pytest_asyncio.fixture(scope="module", params=["inprocess", "workers"])
async def mcp_client(request, http_mcp_url):
    os.environ["YL_MCP_URL"] = http_mcp_url
    config = HostConfig("workers", num_workers=1) if request.param == "workers" else HostConfig("inprocess")
    server = await build(create_host((f"{HERE / 'envs' / 'mcp_env.py'}:env",), config))
    await server.start()
    async with Client(env=server.address) as client:
        yield client
    await server.stop(1.0)


async def test_mcp_tools_are_listed(mcp_client: Client) -> None:
    tools = {t.name: t for t in (await mcp_client.list_scenarios()).tools}
    assert {"add", "shout", "refuse", "web_add", "web_shout", "web_refuse"} <= set(tools)
    schema = json.loads(tools["add"].parameters_json_schema)
    assert schema["required"] == ["a", "b"] and schema["properties"]["a"]["type"] == "integer"
    assert tools["web_shout"].description == "Upper-cases text."


async def test_mcp_tools_are_called_through_an_episode(mcp_client: Client) -> None:
    task = common_pb.Task(env="mcp", scenario="add_up", args_json='{"a": 2, "b": 3}')
    async with mcp_client.episode(task) as episode:
        assert episode.started.prompt == "What is 2 + 3?"
        assert [t.name for t in episode.started.tools if t.name.endswith("add")] == ["add", "web_add"]
        total = await episode.call_tool("add", '{"a": 2, "b": 3}')
        assert (total.content, total.is_error) == ("5", False)
        assert (await episode.call_tool("web_shout", '{"text": "hi"}')).content == "HI"
        refused = await episode.call_tool("web_refuse", '{"reason": "no way"}')
        assert refused.is_error
        graded = await episode.submit(total.content)
    assert graded.reward == 1.0


async def test_concurrent_episodes_share_the_sessions(mcp_client: Client) -> None:
    async def one(i: int) -> str:
        task = common_pb.Task(env="mcp", scenario="add_up", args_json=json.dumps({"a": i, "b": 1}))
        async with mcp_client.episode(task) as episode:
            return (await episode.call_tool("web_add", json.dumps({"a": i, "b": 1}))).content

    assert await asyncio.gather(*(one(i) for i in range(8))) == [str(i + 1) for i in range(8)]
