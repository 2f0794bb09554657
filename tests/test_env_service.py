"""EnvService over the wire: episodes, typed errors, teardown, deadlines, worker isolation, replicas.

Runs against both hosts: environment code in the service's process, and in a pool of worker processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio

from yieldloop import errors
from yieldloop.client import Client
from yieldloop.proto.common.v1 import common_pb2 as common_pb
from yieldloop.proto.env.v1 import env_service_pb2 as env_pb
from yieldloop.proto.env.v1 import env_service_pb2_grpc as env_grpc
from yieldloop.transport import TransportConfig
from yieldloop_server.env.hosts import HostConfig, create_host
from yieldloop_server.env.server import make_server as build

SDK_ENV = f"{pathlib.Path(__file__).parent / 'envs' / 'sdk_env.py'}:env"
MAX_MESSAGE_BYTES = 1 << 20


def task(scenario: str = "count_to", **args) -> common_pb.Task:
    return common_pb.Task(env="sdk", scenario=scenario, args_json=json.dumps(args))


class Served:
    def __init__(self, server, host, markers: pathlib.Path, multiplex: bool = False) -> None:
        self.server, self.host, self.markers, self.multiplex = server, host, markers, multiplex
        self.client = Client(env=server.address, multiplex_episodes=multiplex)

    def marks(self, tag: str) -> list[str]:
        path = self.markers / tag
        return path.read_text().split() if path.exists() else []

    async def settled(self, tag: str) -> None:
        """Waits until the episode tagged ``tag`` was torn down and nothing is live."""
        for _ in range(200):
            if self.marks(tag)[-1:] == ["teardown"] and self.host.num_live_episodes == 0:
                return
            await asyncio.sleep(0.025)
        raise AssertionError(f"episode {tag}: marks {self.marks(tag)}, live {self.host.num_live_episodes}")


async def serve(kind: str, markers: pathlib.Path, multiplex: bool = False) -> Served:
    os.environ["YL_TEST_MARKERS"] = str(markers)  # worker processes inherit it
    config = HostConfig("workers", num_workers=2, hang_timeout_s=5.0) if kind == "workers" else HostConfig("inprocess")
    host = create_host((SDK_ENV,), config)
    server = await build(host, transport=TransportConfig(max_message_bytes=MAX_MESSAGE_BYTES))
    await server.start()
    return Served(server, host, markers, multiplex)


# Each host, with one stream per episode (StreamEpisode) and with episodes multiplexed (StreamEpisodes).
@pytest_asyncio.fixture(scope="module", params=["inprocess", "workers", "inprocess-multiplexed", "workers-multiplexed"])
async def served(request, tmp_path_factory) -> AsyncIterator[Served]:
    kind, _, multiplexed = request.param.partition("-")
    served = await serve(kind, tmp_path_factory.mktemp(f"markers-{request.param}"), bool(multiplexed))
    yield served
    await served.client.close()
    await served.server.stop(1.0)


async def test_episode_over_the_wire(served: Served) -> None:
    listed = await served.client.list_scenarios()
    assert {s.name for s in listed.scenarios} == {
        "count_to",
        "slow_grade",
        "echo",
        "complete",
        "exact_digits",
        "flaky_start",
    }
    assert {t.name for t in listed.tools} >= {"increment", "pid", "sleep", "fail"}
    async with served.client.episode(task(target=3, tag="wire")) as episode:
        started = episode.started
        assert [m.role for m in started.messages] == ["system", "user"]
        assert started.prompt.endswith("Bring the counter to 3.")
        increment = next(t for t in started.tools if t.name == "increment")
        assert json.loads(increment.parameters_json_schema)["properties"]["by"]["description"] == "How much to add."
        assert (await episode.call_tool("increment", '{"by": 1}')).content == "1"
        assert (await episode.call_tool("increment", '{"by": 2}', call_id="c2")).call_id == "c2"
        failed = await episode.call_tool("fail", '{"message": "nope"}')
        assert failed.is_error and failed.content == "RuntimeError: nope"
        graded = await episode.submit("3")
    assert graded.reward == 1.0 and json.loads(graded.info_json) == {"subscores": {"reached": 1.0}, "counter": 3}
    await served.settled("wire")
    assert served.marks("wire") == ["setup", "teardown"]


async def raw_episode(served: Served, *requests: env_pb.StreamEpisodeRequest) -> list[env_pb.StreamEpisodeResponse]:
    """Sends requests on one raw stream (or as the frames of one tag of a StreamEpisodes stream) and returns the
    responses (raising the typed error)."""
    from yieldloop._status import error_from_rpc

    async with grpc.aio.insecure_channel(served.server.address) as channel:
        if served.multiplex:
            return await raw_tagged_episode(env_grpc.EnvServiceStub(channel), requests)
        call = env_grpc.EnvServiceStub(channel).StreamEpisode(iter(requests))
        try:
            return [response async for response in call]
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err) from None


async def raw_tagged_episode(stub: env_grpc.EnvServiceStub, requests) -> list[env_pb.StreamEpisodeResponse]:
    """The requests as frames of tag 7, all in one message, with the close; the responses until its closing frame
    (whose error is raised, typed). A second episode (tag 8) runs beside it and is unaffected."""
    from yieldloop._status import error_from_rpc
    from yieldloop.errors import error_from_wire

    frames = [env_pb.EpisodeRequestFrame(tag=7, request=r) for r in requests]
    frames[-1].close = True
    frames.insert(0, env_pb.EpisodeRequestFrame(tag=8, request=start(task("echo", word="b"))))
    call = stub.StreamEpisodes()
    await call.write(env_pb.StreamEpisodesRequest(frames=frames))
    responses, other = [], []
    try:
        while True:
            message = await call.read()
            assert message is not grpc.aio.EOF
            for frame in message.frames:
                (responses if frame.tag == 7 else other).append(frame)
            if any(frame.closed for frame in responses):
                break
        await call.write(
            env_pb.StreamEpisodesRequest(frames=[env_pb.EpisodeRequestFrame(tag=8, request=submit("b"), close=True)])
        )
        while not any(frame.closed for frame in other):
            other += (await call.read()).frames
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
    except grpc.aio.AioRpcError as err:
        raise error_from_rpc(err) from None
    assert [f.response.WhichOneof("event") for f in other if not f.closed] == ["started", "graded"]
    assert other[-1].closed and not other[-1].HasField("error") and other[1].response.graded.reward == 1.0
    closing = responses.pop()
    if closing.HasField("error"):
        e = closing.error
        raise error_from_wire(dict(code=e.code, message=e.message, reason=e.reason, field=e.field))
    return [frame.response for frame in responses]


def start(t: common_pb.Task) -> env_pb.StreamEpisodeRequest:
    return env_pb.StreamEpisodeRequest(start=env_pb.StartEpisode(task=t))


def call(name: str, arguments: str = "{}") -> env_pb.StreamEpisodeRequest:
    return env_pb.StreamEpisodeRequest(call_tool=env_pb.CallTool(name=name, arguments_json=arguments))


def submit(answer: str) -> env_pb.StreamEpisodeRequest:
    return env_pb.StreamEpisodeRequest(submit=env_pb.SubmitAnswer(answer=answer))


BAD_INPUT = {
    "unknown-scenario": ((start(task("nope")),), errors.NotFoundError, "SCENARIO_NOT_FOUND", "has no scenario 'nope'"),
    "unknown-env": (
        (start(common_pb.Task(env="other", scenario="echo")),),
        errors.NotFoundError,
        "ENVIRONMENT_NOT_FOUND",
        "no environment 'other'",
    ),
    "args-not-matching": (
        (start(task(target="three")),),
        errors.InvalidArgumentError,
        "SCENARIO_ARGS_INVALID",
        "argument 'target'='three' does not match",
    ),
    "missing-arg": ((start(task()),), errors.InvalidArgumentError, "SCENARIO_ARGS_INVALID", "missing required"),
    "args-not-json": (
        (start(common_pb.Task(env="sdk", scenario="echo", args_json="{oops")),),
        errors.InvalidArgumentError,
        "SCENARIO_ARGS_INVALID",
        "not valid JSON",
    ),
    "unknown-tool": (
        (start(task(target=1)), call("teleport")),
        errors.InvalidArgumentError,
        "TOOL_NOT_FOUND",
        "has no tool 'teleport'",
    ),
    "tool-args-not-matching": (
        (start(task(target=1)), call("increment", '{"by": "x"}')),
        errors.InvalidArgumentError,
        "TOOL_ARGS_INVALID",
        "argument 'by'='x' does not match",
    ),
    "tool-call-before-start": (
        (call("increment", '{"by": 1}'),),
        errors.InvalidArgumentError,
        "EPISODE_PROTOCOL",
        "call_tool before start",
    ),
    "submit-before-start": ((submit("x"),), errors.InvalidArgumentError, "EPISODE_PROTOCOL", "submit before start"),
    "two-starts": (
        (start(task(target=1)), start(task(target=1))),
        errors.InvalidArgumentError,
        "EPISODE_PROTOCOL",
        "already started",
    ),
    "two-submits": (
        (start(task("echo", word="a")), submit("a"), submit("a")),
        errors.InvalidArgumentError,
        "EPISODE_PROTOCOL",
        "already submitted",
    ),
    "empty-message": (
        (env_pb.StreamEpisodeRequest(),),
        errors.InvalidArgumentError,
        "EPISODE_PROTOCOL",
        "an empty message before start",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUT, ids=list(BAD_INPUT))
async def test_bad_input_is_typed_and_nothing_leaks(served: Served, case: str) -> None:
    requests, error, reason, message = BAD_INPUT[case]
    with pytest.raises(error, match=message) as err:
        await raw_episode(served, *requests)
    assert err.value.reason == reason
    for _ in range(100):
        if served.host.num_live_episodes == 0:
            break
        await asyncio.sleep(0.02)
    assert served.host.num_live_episodes == 0
    assert (await served.client.list_scenarios()).scenarios, "still serving"


async def test_oversized_message_is_resource_exhausted(served: Served) -> None:
    with pytest.raises(errors.ResourceExhaustedError):
        await raw_episode(served, start(task("echo", word="x" * (MAX_MESSAGE_BYTES + 10))))
    assert (await served.client.list_scenarios()).scenarios


async def test_client_disconnect_runs_teardown(served: Served) -> None:
    client = Client(env=served.server.address, multiplex_episodes=served.multiplex)
    episode = client.episode(task(target=5, tag="vanished"))
    await episode.start()
    await episode.call_tool("increment", '{"by": 1}')
    await client.close()  # the client goes away mid-episode
    await served.settled("vanished")
    assert served.marks("vanished") == ["setup", "teardown"]


async def test_tool_deadline_from_the_environment(served: Served) -> None:
    async with served.client.episode(task(target=1, tag="slow-tool")) as episode:
        with pytest.raises(errors.DeadlineExceededError, match="tool 'sleep' exceeded its deadline") as err:
            await episode.call_tool("sleep", '{"seconds": 5}')
    assert err.value.reason == "TOOL_DEADLINE"
    await served.settled("slow-tool")


async def test_episode_deadline_from_grpc(served: Served) -> None:
    episode = served.client.episode(task(target=1, tag="grpc-deadline"), timeout=0.5)
    await episode.start()
    await asyncio.sleep(0.8)  # the agent thinks too long
    with pytest.raises(errors.DeadlineExceededError):
        await episode.call_tool("increment", '{"by": 1}')
    await served.settled("grpc-deadline")


async def test_episode_deadline_while_grading_stops_the_grade_and_tears_down(served: Served) -> None:
    """The episode's deadline passes while its scenario grades (here or in a worker process): the caller hears
    DEADLINE_EXCEEDED, the grading is stopped and the episode's teardown runs, not after the grade would have."""
    episode = served.client.episode(task("slow_grade", seconds=30, tag="slow-grade"), timeout=0.5)
    await episode.start()
    with pytest.raises(errors.DeadlineExceededError):
        await episode.submit("anything")
    await served.settled("slow-grade")


async def test_cpu_hog_does_not_stall_other_episodes(served: Served) -> None:
    async def hog() -> None:
        async with served.client.episode(task(target=1, tag="hog")) as episode:
            with pytest.raises(errors.DeadlineExceededError):
                await episode.call_tool("busy", '{"seconds": 2.5}')

    async def quick(i: int) -> float:
        async with served.client.episode(task("echo", word=f"w{i}", tag=f"quick{i}")) as episode:
            return (await episode.submit(f"w{i}")).reward

    hogging = asyncio.create_task(hog())
    await asyncio.sleep(0.1)
    rewards = await asyncio.wait_for(asyncio.gather(*(quick(i) for i in range(8))), 2.0)
    assert rewards == [1.0] * 8
    await hogging
    await served.settled("hog")


async def test_worker_killed_mid_episode(tmp_path) -> None:
    served = await serve("workers", tmp_path)
    pool = served.host
    try:
        episodes = [served.client.episode(task(target=2, tag=f"k{i}")) for i in range(4)]
        for episode in episodes:
            await episode.start()
        pids = [int((await e.call_tool("pid")).content) for e in episodes]
        assert len(set(pids)) == 2, "episodes spread over both workers"
        victim = pids[0]
        os.kill(victim, signal.SIGKILL)
        for episode, pid in zip(episodes, pids, strict=True):
            if pid == victim:
                with pytest.raises(errors.UnavailableError) as err:
                    await episode.call_tool("increment", '{"by": 2}')
                assert err.value.reason == "WORKER_DIED" and isinstance(err.value, ConnectionError)
            else:
                assert (await episode.call_tool("increment", '{"by": 2}')).content == "2"
                assert (await episode.submit("2")).reward == 1.0
        # The pool recovers: a replacement worker serves new episodes.
        for _ in range(300):
            if pool.num_replaced == 1 and all(w is not None and w.alive for w in pool.workers):
                break
            await asyncio.sleep(0.05)
        assert pool.num_replaced == 1
        fresh = [served.client.episode(task("echo", word="z", tag=f"after{i}")) for i in range(4)]
        for episode in fresh:
            await episode.start()
        new_pids = {int((await episode.call_tool("pid")).content) for episode in fresh}
        for episode in fresh:
            assert (await episode.submit("z")).reward == 1.0
        assert victim not in new_pids and len(new_pids) == 2, "both workers serve again"
        # A tool that kills its own worker fails only its episode, retryably.
        async with served.client.episode(task(target=1, tag="suicide")) as episode:
            with pytest.raises(errors.UnavailableError, match="died"):
                await episode.call_tool("crash")
        for episode in episodes:
            await episode.close()
        for _ in range(200):
            if pool.num_live_episodes == 0:
                break
            await asyncio.sleep(0.02)
        assert pool.num_live_episodes == 0
    finally:
        await served.client.close()
        await served.server.stop(1.0)
    # A stopped pool closes its worker connections itself: left to the garbage collector, uvloop
    # closes such a socket's fd twice, possibly someone else's file by then (uvloop #763).
    assert all(w.writer.transport.is_closing() for w in pool.workers if w is not None)


async def test_client_spreads_episodes_across_replicas(tmp_path) -> None:
    first, second = await serve("inprocess", tmp_path), await serve("inprocess", tmp_path)
    client = Client(env=[first.server.address, second.server.address])
    try:
        episodes = [client.episode(task("echo", word="r", tag=f"r{i}")) for i in range(4)]
        for episode in episodes:
            await episode.start()
        assert (first.host.num_live_episodes, second.host.num_live_episodes) == (2, 2)
        for episode in episodes:
            assert (await episode.submit("r")).reward == 1.0
    finally:
        await client.close()
        for served in (first, second):
            await served.client.close()
            await served.server.stop(1.0)


async def test_multiplexed_episodes_share_one_stream_and_fail_alone(tmp_path) -> None:
    served = await serve("inprocess", tmp_path, multiplex=True)
    client = served.client
    try:

        async def echo(i: int) -> float:
            async with client.episode(task("echo", word=f"m{i}", tag=f"m{i}")) as episode:
                return (await episode.submit(f"m{i}" if i % 2 else "wrong")).reward

        async def bad() -> None:
            async with client.episode(task(target=1, tag="bad")) as episode:
                with pytest.raises(errors.InvalidArgumentError, match="does not match") as err:
                    await episode.call_tool("increment", '{"by": "x"}')
                assert err.value.reason == "TOOL_ARGS_INVALID" and err.value.field == "by"
                with pytest.raises(errors.InvalidArgumentError):  # the episode stays failed
                    await episode.call_tool("increment", '{"by": 1}')

        rewards, _ = await asyncio.gather(asyncio.gather(*(echo(i) for i in range(32))), bad())
        assert rewards == [float(i % 2) for i in range(32)]
        (streams,) = client._episode_streams.values()
        assert next(streams._tags) == 34 and len(streams._streams) == 1, "33 episodes, one stream"
        await served.settled("bad")
        # A new stream opens when each has per_stream episodes open (behind one balancing address, streams
        # spread over the replicas).
        streams.per_stream = 2
        busy = [client.episode(task("echo", word="s", tag=f"s{i}")) for i in range(5)]
        for episode in busy:
            await episode.start()
        assert sorted(len(stream.sessions) for stream in streams._streams) == [1, 2, 2]
        for episode in busy:
            assert (await episode.submit("s")).reward == 1.0
        # A stream fails: the episodes open on it fail (typed), the next one opens a new stream.
        episode = client.episode(task(target=2, tag="cut"))
        await episode.start()
        episode._stream._call.cancel()
        with pytest.raises(errors.YieldloopError):
            await episode.call_tool("increment", '{"by": 1}')
        await served.settled("cut")
        async with client.episode(task("echo", word="again")) as again:
            assert (await again.submit("again")).reward == 1.0
    finally:
        await client.close()
        await served.server.stop(1.0)


async def test_a_stream_ends_when_its_last_frames_and_the_end_come_together() -> None:
    """The last closing frame and the stream's end queued before the write loop wakes: it writes the frame and
    returns (it once waited for a wake-up the frame had consumed, and the stream hung to its deadline)."""
    from yieldloop_server.env.servicer import _Frames

    class Context:
        def __init__(self) -> None:
            self.written: list[env_pb.StreamEpisodesResponse] = []

        async def write(self, message: env_pb.StreamEpisodesResponse) -> None:
            await asyncio.sleep(0)
            self.written.append(message)

    context = Context()
    frames = _Frames(context)
    frames.send(env_pb.EpisodeResponseFrame(tag=1, closed=True))
    frames.finish()
    await asyncio.wait_for(frames.write_loop(), 5)
    assert [frame.tag for message in context.written for frame in message.frames] == [1]


def test_load_harness_small_run(tmp_path) -> None:
    """The load harness end to end (128 episodes): every run completes with 0 errors and reports its figures."""
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    harness = pathlib.Path(__file__).parents[1] / "loadtest" / "envbench.py"
    result = subprocess.run(
        [sys.executable, str(harness), "--episodes", "128", "--calls", "8", "--out", str(out), "--timeout", "120"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(out.read_text())
    for run in ("inprocess", "echo", "ours", "ours-workers", "echo-multiplexed", "ours-multiplexed"):
        assert figures[run]["num_errors"] == 0, (run, figures[run]["errors"])
        assert figures[run]["episodes_ok"] == 128 and figures[run]["tool_calls"] == 128 * 8
        assert figures[run]["latency_ms"]["p99"] >= figures[run]["latency_ms"]["p50"] >= 0
    for run in ("ours", "ours-workers", "ours-multiplexed"):
        assert figures[run]["rate_vs_echo"] > 0 and figures[run]["server_rss_mb"]["peak"] > 0
    assert figures["ours-multiplexed"]["rate_vs_echo-multiplexed"] > 0
    assert "calls/s" in result.stdout and "vs echo" in result.stdout
