"""The transport seam: one interceptor, installed through TransportConfig, sees every call of all four services
(unary and every streaming kind, StreamEpisode and Health.Watch included) and the HTTP endpoint's requests; an
interceptor refusing a call answers a typed error on gRPC and an OpenAI-shaped one on HTTP."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from yieldloop import errors
from yieldloop._status import to_rpc_status
from yieldloop.client import Client, sampling_params
from yieldloop.environment import Task
from yieldloop.transport import CallInfo, TransportConfig, open_channel
from yieldloop.types import Datum
from yieldloop.wire import calls as client_module
from yieldloop.wire.calls import CallStatus as _CallStatus
from yieldloop_server.config import EnvOptions, StackConfig
from yieldloop_server.stack import InProcessStack

HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"


def _count(recorder, since: int) -> collections.Counter:
    return collections.Counter(method for method, _, _ in recorder.calls[since:])


async def _health(address: str) -> None:
    """One Check and one Watch (a handler written with context.write) on a service."""
    async with open_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING
        watch = health.Watch(health_pb2.HealthCheckRequest())
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()


def _http(url: str, key: str) -> tuple[int, dict]:
    try:
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


async def test_one_interceptor_sees_every_rpc_kind_of_every_service_and_http(
    stack, client: Client, call_recorder
) -> None:
    since = len(call_recorder.calls)
    for address in stack.addresses.values():
        await _health(address)
    await client.list_models()  # checkpoint: unary
    head = await client.get_head("tiny")
    async for seen in client.watch_head("tiny"):  # checkpoint: server stream (async generator)
        assert seen.checkpoint_id == head.checkpoint_id
        break
    await client.list_scenarios()  # env: unary
    async with client.episode(Task("letters", "repeat", {"letter": "a"})) as episode:  # env: bidi, read/write
        await episode.submit("'a'")
    await client.get_trainer_info()  # trainer: unary
    task = Task("letters", "repeat", {"letter": "b"})
    runs = [
        run
        async for run in client.stream_rollouts(
            [task],
            group_size=2,  # rollout: server stream
            sampling=sampling_params(max_tokens=2),
        )
    ]
    await client.forward_scored(runs=runs)  # trainer: client stream
    await client.generate([1, 40, 41], sampling=sampling_params(max_tokens=2))  # rollout: server stream
    info = await client.get_serving_info()
    assert (await asyncio.to_thread(_http, info.openai_base_url + "/models", stack.api_key))[0] == 200  # HTTP

    counts = _count(call_recorder, since)
    assert counts[HEALTH_CHECK] == 4 and counts[HEALTH_WATCH] == 4
    for method, expected in [
        ("/yieldloop.checkpoint.v1.CheckpointService/ListModels", 2),  # ours, and /v1/models listing the store
        ("/yieldloop.env.v1.EnvService/ListScenarios", 1),
        ("/yieldloop.trainer.v1.TrainerService/GetTrainerInfo", 1),
        ("/yieldloop.trainer.v1.TrainerService/Forward", 1),
        ("/yieldloop.rollout.v1.RolloutService/Generate", 1),
        ("/yieldloop.rollout.v1.RolloutService/StreamRollouts", 1),
        ("/yieldloop.rollout.v1.RolloutService/GetServingInfo", 1),
        ("GET /v1/models", 1),
    ]:
        assert counts[method] == expected, (method, counts)
    # Ours only: the rollout service's group went over its shared StreamEpisodes stream, which stays open (the
    # recorder counts a call as it ends; service-to-service calls are seen too).
    assert counts["/yieldloop.env.v1.EnvService/StreamEpisode"] == 1, counts
    assert counts["/yieldloop.checkpoint.v1.CheckpointService/WatchHead"] >= 1
    protocols = {method: protocol for method, protocol, _ in call_recorder.calls[since:]}
    assert protocols["GET /v1/models"] == "http" and protocols[HEALTH_WATCH] == "grpc"


class Refuse:
    """Refuses the calls whose method it names, as an authentication check would."""

    def __init__(self, methods: set[str]) -> None:
        self.methods = methods

    @contextlib.asynccontextmanager
    async def intercept(self, call: CallInfo):
        if call.method in self.methods:
            raise errors.PermissionDeniedError(f"{call.method} is refused", reason="PERMISSION_DENIED")
        yield


@pytest.fixture(scope="module")
async def refusing_stack(tmp_path_factory: pytest.TempPathFactory):
    refuse = Refuse(
        {
            "/yieldloop.checkpoint.v1.CheckpointService/ListModels",
            "/yieldloop.env.v1.EnvService/StreamEpisode",
            "/yieldloop.trainer.v1.TrainerService/ForwardBackward",
            "GET /v1/models",
        }
    )
    config = StackConfig(
        data_dir=tmp_path_factory.mktemp("refusing"),
        env=EnvOptions(workers=0),
        transport=TransportConfig(server_interceptors=(refuse,)),
    )
    stack = InProcessStack(config)
    await stack.start()
    yield stack
    await stack.stop()


class _Status:  # the shape grpcio keeps a call's current status in (code as an int, trailers as pairs)
    def __init__(self, code: grpc.StatusCode, details: str, trailers: tuple = ()) -> None:
        self._code, self._details, self._trailers = code.value[0], details, trailers

    def code(self) -> int:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return self._trailers


class _Call:  # what _CallStatus uses of a grpc.aio call
    def __init__(self) -> None:
        self._cython_call = self
        self._status: _Status | None = None
        self._callbacks: list = []

    def add_done_callback(self, callback) -> None:
        self._callbacks.append(callback)

    def set(self, status: _Status) -> None:  # as grpcio does: every status runs every callback
        self._status = status
        for callback in self._callbacks:
            callback(self)

    async def code(self) -> grpc.StatusCode:
        return next(code for code in grpc.StatusCode if code.value[0] == self._status.code())

    async def details(self) -> str:
        return self._status.details()

    async def trailing_metadata(self) -> grpc.aio.Metadata:
        return grpc.aio.Metadata(*self._status.trailing_metadata())


async def test_a_refused_stream_reports_the_servers_status_not_cores(monkeypatch) -> None:
    """grpc/grpc#36066 in both orders: core's INTERNAL replacing the server's status, and arriving first."""
    refused = to_rpc_status(errors.PermissionDeniedError("refused", reason="PERMISSION_DENIED"))
    server = _Status(grpc.StatusCode.PERMISSION_DENIED, "refused", tuple(refused.trailing_metadata))
    core = _Status(grpc.StatusCode.INTERNAL, "Internal error from Core")
    core_error = grpc.aio.AioRpcError(
        grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), "Internal error from Core"
    )
    for later in (False, True):
        call = _Call()
        status = _CallStatus(call)
        if later:
            call.set(core)
            asyncio.get_running_loop().call_later(0.05, call.set, server)
        else:
            call.set(server)
            call.set(core)
        error = await status.error(core_error)
        assert isinstance(error, errors.PermissionDeniedError) and error.reason == "PERMISSION_DENIED"
    monkeypatch.setattr(client_module, "_SERVER_STATUS_WITHIN_S", 0.05)
    call = _Call()
    status = _CallStatus(call)
    call.set(core)  # no status from the server ever: core's stands
    assert isinstance(await status.error(core_error), errors.InternalError)


async def test_an_interceptor_refuses_with_typed_errors(refusing_stack) -> None:
    async with Client(**refusing_stack.addresses, api_key=refusing_stack.api_key, timeout=60) as client:
        with pytest.raises(errors.PermissionDeniedError) as refused:
            await client.list_models()
        assert refused.value.reason == "PERMISSION_DENIED"
        # Streams refused while the client is still sending: grpcio may report those as INTERNAL
        # (grpc/grpc#36066); the client reads the call's own status, every time.
        for _ in range(20):
            with pytest.raises(errors.PermissionDeniedError):  # bidi (call.write)
                async with client.episode(Task("letters", "repeat", {"letter": "a"})):
                    pass
            with pytest.raises(errors.PermissionDeniedError):  # client stream (a request iterator)
                await client.forward_backward(datums=[Datum([1, 2, 3], [2, 3, 4])] * 64)
        assert (await client.get_head("tiny")).checkpoint_id  # what is not refused still works
        info = await client.get_serving_info()
    status, body = await asyncio.to_thread(_http, info.openai_base_url + "/models", refusing_stack.api_key)
    assert (
        status == 403 and body["error"]["type"] == "permission_error" and body["error"]["code"] == "permission_denied"
    )
    async with open_channel(refusing_stack.addresses["checkpoint"]) as channel:  # health stays open
        health = health_pb2_grpc.HealthStub(channel)
        assert (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING
    assert grpc.StatusCode.PERMISSION_DENIED.name == refused.value.code


async def test_a_server_without_interceptors_refuses_undecodable_requests_typed():
    """With no interceptor installed, calls skip the interceptor layer's context managers (tool calls are the
    messages sent most), and a request that does not parse is still INVALID_ARGUMENT, unary or streamed."""
    from yieldloop_server.env.inprocess import InProcessHost
    from yieldloop_server.env.loader import load_environment
    from yieldloop_server.env.server import make_server as build

    server = await build(InProcessHost([load_environment("yieldloop.envs.bench:env")]), transport=TransportConfig())
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            for method, kind in (("ListScenarios", "unary_unary"), ("StreamEpisode", "stream_stream")):
                rpc = getattr(channel, kind)(f"/yieldloop.env.v1.EnvService/{method}")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    if kind == "unary_unary":
                        await rpc(b"\xff\xff\xff\x01", timeout=30)
                    else:
                        async for _ in rpc(iter([b"\xff\xff\xff\x01"]), timeout=30):
                            pass
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, err.value)
                assert "does not parse" in err.value.details()
    finally:
        await server.stop(0)


async def test_aborted_streams_leave_no_error_in_the_log(client: Client, caplog) -> None:
    """Clients that hang up mid-stream (Generate cut after its first delta, hundreds at once) leave nothing at
    WARNING or above: every interceptor's exit (the auth principal, spans) runs in the call's own task, not in a
    finalizer of another context ("Task exception was never retrieved ... created in a different Context")."""
    import gc
    import logging

    caplog.set_level(logging.WARNING)

    async def hang_up(seed: int) -> None:
        stream = client.generate_stream(
            [1, 2, 3 + seed % 50], sampling=sampling_params(max_tokens=64, seed=seed), model="tiny"
        )
        async for _ in stream:
            break
        await stream.aclose()

    for _ in range(4):
        await asyncio.gather(*(hang_up(seed) for seed in range(100)))
        gc.collect()
        await asyncio.sleep(0.2)
    gc.collect()
    await asyncio.sleep(0.5)
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not noisy, [r.getMessage()[:300] for r in noisy[:3]]


async def test_stream_rollouts_batches_runs_only_when_asked(client: Client) -> None:
    """Without ``batch_runs`` (what other languages' clients send) every response holds one run; with it (the Python
    client) the runs recorded together come in one response: the same runs either way."""
    from yieldloop.convert import task_to_pb
    from yieldloop.proto.rollout.v1 import rollout_service_pb2 as rollout_pb

    task = task_to_pb(Task("letters", "repeat", {"letter": "c"}))
    for batch in (False, True):
        request = rollout_pb.StreamRolloutsRequest(
            tasks=[task], group_size=4, sampling=rollout_pb.SamplingParams(max_tokens=2), batch_runs=batch
        )
        responses = [response async for response in client.raw.rollout.StreamRollouts(request, timeout=120)]
        runs = [run for response in responses for run in (response.runs if batch else [response.run])]
        assert len(runs) == 4 and all(run.trace_id and run.turns for run in runs)
        if batch:
            assert not any(response.HasField("run") for response in responses) and len(responses) <= 4
        else:
            assert len(responses) == 4 and not any(response.runs for response in responses)
