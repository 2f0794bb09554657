"""API keys, roles and team ownership on every RPC of every service and every HTTP route (issue 16).

The session stack runs with auth on (the default): its admin key is ``stack.api_key``. Team keys are made
through CheckpointService.CreateApiKey, as `yieldloop keys create` does.
"""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import grpc
import pytest
import pytest_asyncio

from yieldloop import errors
from yieldloop.client import Client, sampling_params
from yieldloop.envs.letters import tasks
from yieldloop.proto.checkpoint.v1 import checkpoint_service_pb2 as ckpt_pb
from yieldloop.proto.env.v1 import env_service_pb2 as env_pb
from yieldloop.proto.rollout.v1 import rollout_service_pb2 as rollout_pb
from yieldloop.proto.trainer.v1 import trainer_service_pb2 as trainer_pb
from yieldloop.types import Datum
from yieldloop_server.common.auth import KEY_CACHE_S, METHOD_ROLES, OPEN_METHODS

PROMPT = [1, 40, 41, 42, 43, 44]
SERVICES = {  # service -> (proto module, address key)
    "yieldloop.env.v1.EnvService": (env_pb, "env"),
    "yieldloop.rollout.v1.RolloutService": (rollout_pb, "rollout"),
    "yieldloop.trainer.v1.TrainerService": (trainer_pb, "trainer"),
    "yieldloop.checkpoint.v1.CheckpointService": (ckpt_pb, "checkpoint"),
}


def every_method() -> list[tuple[str, str, object]]:
    """(address key, full method, method descriptor) of every RPC of the four services."""
    out = []
    for name, (module, address) in SERVICES.items():
        service = module.DESCRIPTOR.services_by_name[name.rsplit(".", 1)[1]]
        for method in service.methods:
            out.append((address, f"/{name}/{method.name}", method))
    return out


@dataclasses.dataclass
class Keys:
    admin: str
    a_train: str
    a_sample: str
    b_train: str
    revoked: str
    revoked_id: str


@pytest_asyncio.fixture(scope="module")
async def keys(stack, client: Client) -> Keys:
    assert stack.api_key, "the stack runs with auth on by default"
    made = {}
    for label, team, role in (
        ("a_train", "team-a", "train"),
        ("a_sample", "team-a", "sample"),
        ("b_train", "team-b", "train"),
        ("revoked", "team-a", "train"),
    ):
        made[label] = await client.create_api_key(team, role, name=label)
    await client.revoke_api_key(made["revoked"].info.key_id)
    await asyncio.sleep(KEY_CACHE_S)  # nothing cached it yet; waiting keeps the test honest for other services
    return Keys(
        stack.api_key,
        made["a_train"].api_key,
        made["a_sample"].api_key,
        made["b_train"].api_key,
        made["revoked"].api_key,
        made["revoked"].info.key_id,
    )


async def raw_call(channel: grpc.aio.Channel, path: str, method, metadata: tuple) -> grpc.StatusCode:
    """Calls ``path`` with an empty request (one empty message for client streams); the status code."""
    request = method.input_type._concrete_class()
    response_type = method.output_type._concrete_class
    kind = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }[(method.client_streaming, method.server_streaming)]
    call = kind(
        path, request_serializer=lambda m: m.SerializeToString(), response_deserializer=response_type.FromString
    )(iter([request]) if method.client_streaming else request, metadata=metadata, timeout=3)
    try:
        if method.server_streaming:
            async for _ in call:
                break
            call.cancel()
            return grpc.StatusCode.OK
        await call
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as err:
        code = err.code()
        if code == grpc.StatusCode.INTERNAL:  # grpc/grpc#36066: the call's own status is the server's
            code = await call.code()
        return code


def test_every_rpc_has_a_role() -> None:
    """A new RPC is closed (admin only) until listed; the table names no RPC that does not exist."""
    methods = {path for _, path, _ in every_method()}
    assert methods <= set(METHOD_ROLES), sorted(methods - set(METHOD_ROLES))
    assert {m for m in METHOD_ROLES if m.startswith("/")} == methods


async def test_auth_matrix_over_every_rpc(stack, keys: Keys) -> None:
    """No key, a wrong key, a revoked key: UNAUTHENTICATED; a role below the method's: PERMISSION_DENIED; the
    right key passes (the empty request then fails, if at all, on its content). Streaming RPCs included, each
    refusal repeated (grpc/grpc#36066 reports some as INTERNAL)."""
    levels = {"sample": 1, "train": 2, "admin": 3, "service": 3}
    channels = {name: grpc.aio.insecure_channel(address) for name, address in stack.addresses.items()}
    refused = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
    try:
        for address, path, method in every_method():
            channel = channels[address]
            for metadata in (
                (),
                (("authorization", "Bearer yl_000000000000_nope"),),
                (("x-api-key", keys.revoked),),
                (("authorization", "Basic abc"),),
            ):
                for _ in range(3 if method.client_streaming else 1):
                    assert await raw_call(channel, path, method, metadata) == grpc.StatusCode.UNAUTHENTICATED, (
                        path,
                        metadata,
                    )
            role = METHOD_ROLES[path]
            for key, level in ((keys.a_sample, 1), (keys.a_train, 2)):
                code = await raw_call(channel, path, method, (("authorization", f"Bearer {key}"),))
                if level < levels[role]:
                    assert code == grpc.StatusCode.PERMISSION_DENIED, (path, key[:15])
                else:
                    assert code not in (grpc.StatusCode.UNAUTHENTICATED,), (path, code)
            code = await raw_call(channel, path, method, (("x-api-key", keys.admin),))
            assert code not in refused, (path, code)
    finally:
        for channel in channels.values():
            await channel.close()


async def test_health_and_reflection_stay_open(stack) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    for address in stack.addresses.values():
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert OPEN_METHODS


async def test_the_client_library_raises_unauthenticated_on_streams(stack, keys: Keys) -> None:
    """Client streams (ForwardBackward) and bidi (StreamEpisode) refused by the server raise
    UnauthenticatedError every time, never INTERNAL (grpc/grpc#36066)."""
    async with (
        Client(**stack.addresses, api_key="yl_000000000000_wrong", timeout=30) as wrong,
        Client(**stack.addresses, timeout=30) as none,
    ):
        for client, reason in ((wrong, "API_KEY_INVALID"), (none, "API_KEY_MISSING")):
            for _ in range(20):
                with pytest.raises(errors.UnauthenticatedError) as caught:
                    await client.forward_backward(datums=[Datum([1, 2, 3], [2, 3, 4], [-1.0] * 3, [1.0] * 3, [])] * 8)
                assert caught.value.reason == reason
                with pytest.raises(errors.UnauthenticatedError):
                    async with client.episode(tasks("a")[0]) as episode:
                        await episode.start()
            with pytest.raises(errors.UnauthenticatedError):
                await client.generate(PROMPT, sampling=sampling_params(max_tokens=2))
            with pytest.raises(errors.UnauthenticatedError):
                async for _ in client.watch_head("tiny"):
                    break


async def test_two_teams_on_one_stack(stack, client: Client, keys: Keys) -> None:
    """Team B cannot list, sample, train, fork from, move the head of, or read the runs of team A's fork;
    team A's sample key samples it but cannot train it; the admin can do everything."""
    async with (
        Client(**stack.addresses, api_key=keys.a_train, timeout=120) as a,
        Client(**stack.addresses, api_key=keys.a_sample, timeout=120) as a_sample,
        Client(**stack.addresses, api_key=keys.b_train, timeout=120) as b,
    ):
        forked = await a.fork_model("tiny", "team-a-private")
        assert forked.model.owner == "team-a" and not forked.model.public
        with pytest.raises(errors.PermissionDeniedError) as caught:
            await a.fork_model("tiny", "team-a-for-b", owner="team-b")
        assert caught.value.reason == "ROLE_NOT_ALLOWED"
        # Visibility: A sees its fork and the public base; B sees the base only; the admin sees both.
        assert {"tiny", "team-a-private"} <= {m.slug for m in (await a.list_models())}
        b_sees = {m.slug for m in (await b.list_models())}
        assert "tiny" in b_sees and "team-a-private" not in b_sees
        assert "team-a-private" in {m.slug for m in (await client.list_models())}
        # A runs a job on its fork and trains it.
        job = await a.create_job(model="team-a-private", name="a-job")
        runs = [
            run
            async for run in a.stream_rollouts(
                tasks("ab"),
                group_size=2,
                job_id=job.job_id,
                model="team-a-private",
                sampling=sampling_params(max_tokens=4, temperature=1.0),
            )
        ]
        assert len(runs) == 4
        await a.forward_backward(runs=runs, model="team-a-private", loss_fn="importance_sampling")
        step = await a.optim_step(model="team-a-private", learning_rate=1e-3)
        await a_sample.generate(PROMPT, model="team-a-private", sampling=sampling_params(max_tokens=2))
        with pytest.raises(errors.PermissionDeniedError) as caught:
            await a_sample.forward_backward(runs=runs, model="team-a-private")
        assert caught.value.reason == "ROLE_NOT_ALLOWED"
        # Team B: refused everywhere, with the reason.
        refusals = {
            "get_model": b.get_model("team-a-private"),
            "generate": b.generate(PROMPT, model="team-a-private", sampling=sampling_params(max_tokens=2)),
            "forward_backward": b.forward_backward(runs=runs, model="team-a-private"),
            "optim_step": b.optim_step(model="team-a-private", learning_rate=1e-3),
            "fork": b.fork_model("team-a-private", "b-steals"),
            "set_head": b.set_head("team-a-private", step.checkpoint.checkpoint_id),
            "list_checkpoints": b.list_checkpoints("team-a-private"),
            "delete": b.delete_model("team-a-private"),
            "serving_info": b.get_serving_info(model="team-a-private"),
        }
        for name, call in refusals.items():
            with pytest.raises(errors.PermissionDeniedError) as caught:
                await call
            assert caught.value.reason == "MODEL_NOT_OWNED", name
        with pytest.raises(errors.PermissionDeniedError) as caught:
            async for _ in b.job_runs(job.job_id):
                pass
        assert caught.value.reason == "JOB_NOT_OWNED"
        with pytest.raises(errors.PermissionDeniedError):
            async for _ in b.stream_rollouts(tasks("a"), job_id=job.job_id):
                pass
        assert job.job_id not in {j.job_id for j in await b.list_jobs()}
        assert job.job_id in {j.job_id for j in await a.list_jobs()}
        # B forks the public base for itself: its own fork, private to B; A's runs stay A's, even by trace id.
        mine = await b.fork_model("tiny", "team-b-own")
        assert mine.model.owner == "team-b"
        assert all(run.team == "team-a" for run in await a.get_runs([r.trace_id for r in runs]))
        with pytest.raises(errors.PermissionDeniedError) as caught:
            await b.get_runs([runs[0].trace_id])
        assert caught.value.reason == "RUN_NOT_OWNED"
        with pytest.raises(errors.PermissionDeniedError) as caught:
            await b.forward_backward(runs=[r.trace_id for r in runs], model="team-b-own")
        assert caught.value.reason == "RUN_NOT_OWNED"
        with pytest.raises(errors.PermissionDeniedError):
            await b.get_trace_spans(runs[0].trace_id)
        # The admin does anything.
        assert len([run async for run in client.job_runs(job.job_id)]) == 4
        await client.set_head("team-a-private", step.checkpoint.checkpoint_id)
        await client.delete_model("team-b-own")


async def test_http_routes_check_the_key_and_the_model(client: Client, keys: Keys) -> None:
    base = (await client.get_serving_info()).openai_base_url
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
    async with aiohttp.ClientSession() as http:
        for route, payload in (
            ("/models", None),
            ("/completions", body),
            ("/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2}),
        ):
            for headers, status, reason in (
                ({}, 401, "API_KEY_MISSING"),
                ({"Authorization": "Bearer yl_000000000000_x"}, 401, "API_KEY_INVALID"),
                ({"x-api-key": keys.revoked}, 401, "API_KEY_INVALID"),
                ({"Authorization": f"Bearer {keys.b_train}"}, 200, ""),
            ):
                method = http.get if payload is None else http.post
                async with method(base + route, json=payload, headers=headers) as response:
                    assert response.status == status, (route, headers, await response.text())
                    if reason:
                        assert (await response.json())["error"]["code"] == reason.lower()
        headers = {"Authorization": f"Bearer {keys.b_train}"}
        async with http.post(base + "/completions", json={**body, "model": "team-a-private"}, headers=headers) as r:
            assert r.status == 403 and (await r.json())["error"]["code"] == "model_not_owned"
        async with http.get(base + "/models", headers=headers) as r:
            assert "team-a-private" not in {m["id"] for m in (await r.json())["data"]}


async def test_admin_only_key_management(stack, keys: Keys) -> None:
    async with Client(**stack.addresses, api_key=keys.a_train, timeout=30) as a:
        with pytest.raises(errors.PermissionDeniedError) as caught:
            await a.create_api_key("team-a", "admin")
        assert caught.value.reason == "ROLE_NOT_ALLOWED"
        with pytest.raises(errors.PermissionDeniedError):
            await a.list_api_keys()
    async with Client(**stack.addresses, api_key=keys.admin, timeout=30) as admin:
        listed = {k.key_id: k for k in await admin.list_api_keys()}
        assert listed[keys.revoked_id].revoked_time > 0
        with pytest.raises(errors.InvalidArgumentError):
            await admin.create_api_key("team-a", "superuser")
        with pytest.raises(errors.NotFoundError):
            await admin.revoke_api_key("000000000000")


def test_a_deployments_keys_come_from_its_secrets(tmp_path, monkeypatch) -> None:
    """YIELDLOOP_ADMIN_KEY and YIELDLOOP_SERVICE_KEY (minted offline by `yieldloop keys mint`, kept in Secrets) are
    registered by the first service that starts, once; a key whose id is taken by another is refused."""
    import subprocess
    import sys

    from yieldloop.errors import AlreadyExistsError
    from yieldloop_server.config import ServeOptions
    from yieldloop_server.serve import secured_transport
    from yieldloop_server.store.fs import FsStore

    def mint() -> str:
        return subprocess.run(
            [sys.executable, "-m", "yieldloop.cli", "keys", "mint"], capture_output=True, text=True, check=True
        ).stdout.strip()

    store = FsStore(tmp_path / "store")
    admin, service = mint(), mint()
    monkeypatch.setenv("YIELDLOOP_ADMIN_KEY", admin)
    monkeypatch.setenv("YIELDLOOP_SERVICE_KEY", service)
    for name in ("checkpoint", "env"):  # every service of the deployment, each at its start
        transport, keys = secured_transport(ServeOptions(service=name), store)
        assert transport.api_key == service
    assert keys.check(admin).role == "admin" and keys.check(service).role == "service"
    assert len(keys.list()) == 2
    forged = admin.rsplit("_", 1)[0] + "_another-secret"
    with pytest.raises(AlreadyExistsError):
        keys.adopt(forged, "team-x", "admin")
