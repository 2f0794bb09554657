"""EnvService served by several processes on one port (``yieldloop serve env --env-processes N``).

The first process binds the port with SO_REUSEPORT and starts the others on it; the kernel spreads connections
over them, and a client spreads its episodes over connections (``TransportConfig.env_connections``). Each
process is supervised: one that dies is started again on the same port, and none outlives the first process,
however that one ends. Without ``share_port`` a port in use is never shared (gRPC's own default would share it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import signal
import time

import pytest

from yieldloop.client import Client
from yieldloop.environment import Task
from yieldloop.transport import TransportConfig
from yieldloop_server.common.grpc_server import GrpcServer
from yieldloop_server.config import EnvOptions, ServeOptions
from yieldloop_server.supervisor import ServiceProcess

PID_ENV = f"{pathlib.Path(__file__).parent / 'envs' / 'pid_env.py'}:env"
CONNECTIONS = 16  # the kernel places each connection: all 16 on one of 2 processes has odds of 2^-15


async def _pids(address: str, episodes: int = 2 * CONNECTIONS, multiplex: bool = False) -> set[int]:
    """The processes that ran ``episodes`` episodes, each through the client's next connection."""
    async with Client(
        env=address, multiplex_episodes=multiplex, transport=TransportConfig(env_connections=CONNECTIONS)
    ) as client:

        async def one() -> int:
            async with client.episode(Task(env="pids", scenario="which", args={})) as episode:
                result = await episode.call_tool("pid")
                assert not result.is_error, result.content
                await episode.submit("done")
                return int(result.content)

        return set(await asyncio.gather(*(one() for _ in range(episodes))))


def _replica_pid(data_dir: pathlib.Path) -> int:
    """The pid in the second process's ready file (0 while it is being started again)."""
    try:
        return json.loads((data_dir / "work" / "env" / "process-1.json").read_text())["pid"]
    except FileNotFoundError:
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(FileNotFoundError):  # a zombie (exited, not yet reaped by its parent) is gone too
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


async def _until(condition, timeout_s: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


@pytest.fixture
async def env_processes(tmp_path: pathlib.Path):
    options = ServeOptions(
        service="env",
        data_dir=tmp_path,
        auth=False,
        ready_file=tmp_path / "env.json",
        env=EnvOptions(specs=(PID_ENV,), workers=0, processes=2),
    )
    service = ServiceProcess(options, tmp_path / "logs", ready_timeout_s=120)
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


async def test_episodes_spread_over_the_processes_of_one_port(env_processes: ServiceProcess, tmp_path: pathlib.Path):
    parent, replica = env_processes.process.pid, _replica_pid(tmp_path)
    assert await _pids(env_processes.address) == {parent, replica}
    assert await _pids(env_processes.address, multiplex=True) == {parent, replica}  # as RolloutService runs them

    # One that dies comes back on the same port, and serves again.
    os.kill(replica, signal.SIGKILL)
    await _until(
        lambda: _replica_pid(tmp_path) not in (0, replica) and not _alive(replica), what="the restarted process"
    )
    restarted = _replica_pid(tmp_path)
    assert await _pids(env_processes.address) == {parent, restarted}

    # The service stops with all its processes.
    await env_processes.stop()
    await _until(lambda: not _alive(restarted), timeout_s=30, what="the other process to stop")


async def test_no_process_outlives_the_first_killed(env_processes: ServiceProcess, tmp_path: pathlib.Path):
    parent, replica = env_processes.process.pid, _replica_pid(tmp_path)
    os.kill(parent, signal.SIGKILL)  # no cleanup runs in it: the kernel's parent-death signal stops the other
    await _until(lambda: not _alive(replica), timeout_s=30, what="the orphaned process to stop")
    # Its supervisor starts the first again, which starts its other again: the port is served as before.
    await _until(lambda: env_processes.process.pid != parent and (tmp_path / "env.json").exists(), what="restart")
    await _until(lambda: _replica_pid(tmp_path) not in (0, replica), what="the other process again")
    assert await _pids(env_processes.address) == {env_processes.process.pid, _replica_pid(tmp_path)}


async def test_a_port_in_use_is_shared_only_when_asked():
    first = GrpcServer(transport=TransportConfig())
    await first.start()
    try:
        with pytest.raises(RuntimeError, match="bind"):
            await GrpcServer(port=first.port, transport=TransportConfig()).start()
    finally:
        await first.stop(0)
    shared = [GrpcServer(transport=TransportConfig(share_port=True))]
    await shared[0].start()
    shared.append(GrpcServer(port=shared[0].port, transport=TransportConfig(share_port=True)))
    try:
        await shared[1].start()
        assert shared[0].port == shared[1].port
    finally:
        for server in shared:
            await server.stop(0)
