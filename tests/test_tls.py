"""TLS on every service, the HTTP endpoint and every internal client (issue 16): `--tls` makes a private CA."""

from __future__ import annotations

import dataclasses
import ssl

import aiohttp
import pytest
import pytest_asyncio

from yieldloop import errors
from yieldloop.client import Client, sampling_params
from yieldloop.transport import TransportConfig
from yieldloop_server.common.grpc_server import GrpcServer
from yieldloop_server.common.tls import ensure_stack_certs
from yieldloop_server.config import EnvOptions
from yieldloop_server.stack import InProcessStack, StackConfig


@pytest_asyncio.fixture(scope="module")
async def tls_stack(tmp_path_factory: pytest.TempPathFactory):
    stack = InProcessStack(StackConfig(data_dir=tmp_path_factory.mktemp("tls"), tls=True, env=EnvOptions(workers=0)))
    await stack.start()
    yield stack
    await stack.stop()


async def test_every_service_speaks_tls(tls_stack: InProcessStack) -> None:
    """The services talk to each other over TLS (a rollout episode crosses rollout -> env and rollout ->
    checkpoint; a step crosses trainer -> checkpoint and rollout -> trainer), and clients with the CA and a key
    reach all four and the HTTP endpoint."""
    from yieldloop.envs.letters import tasks

    transport = TransportConfig(tls_ca=tls_stack.config.transport.tls_ca)
    async with Client(**tls_stack.addresses, api_key=tls_stack.api_key, transport=transport, timeout=120) as client:
        assert (await client.list_scenarios()).scenarios
        runs = [
            run
            async for run in client.stream_rollouts(tasks("ab"), group_size=2, sampling=sampling_params(max_tokens=4))
        ]
        await client.forward_backward(runs=runs)
        step = await client.optim_step(learning_rate=1e-4)
        info = await client.get_serving_info(wait_for_checkpoint_id=step.checkpoint.checkpoint_id)
        assert info.weight_version == step.checkpoint.checkpoint_id
        assert info.openai_base_url.startswith("https://")
        context = ssl.create_default_context(cafile=transport.tls_ca)
        headers = {"Authorization": f"Bearer {tls_stack.api_key}"}
        async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(ssl=context)) as http:
            async with http.get(info.openai_base_url + "/models") as response:
                assert response.status == 200 and (await response.json())["data"][0]["id"] == "tiny"
        async with aiohttp.ClientSession(headers=headers) as http:  # the system's CAs do not know ours
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await http.get(info.openai_base_url + "/models")


async def test_clients_without_the_ca_are_refused(tls_stack: InProcessStack, tmp_path) -> None:
    other_ca, _, _ = ensure_stack_certs(tmp_path / "other")
    for transport in (TransportConfig(), TransportConfig(tls_ca=str(other_ca))):
        async with Client(
            **tls_stack.addresses, api_key=tls_stack.api_key, transport=transport, timeout=5, retry_within_s=0
        ) as client:
            for call in (
                client.list_models(),
                client.list_scenarios(),
                client.get_trainer_info(),
                client.generate([1, 2], sampling=sampling_params(max_tokens=1)),
            ):
                with pytest.raises(errors.UnavailableError):
                    await call


async def test_plaintext_only_on_loopback(tmp_path) -> None:
    with pytest.raises(ValueError, match="refusing to serve plaintext"):
        await GrpcServer("0.0.0.0", 0).start()
    server = GrpcServer("0.0.0.0", 0, TransportConfig(allow_plaintext=True))
    await server.start()
    await server.stop(0)
    ca, cert, key = ensure_stack_certs(tmp_path / "tls", ["0.0.0.0"])
    secure = GrpcServer("0.0.0.0", 0, TransportConfig(tls_cert=str(cert), tls_key=str(key)))
    await secure.start()
    await secure.stop(0)
    again = ensure_stack_certs(tmp_path / "tls")  # still good: kept, not remade
    assert again == (ca, cert, key) and dataclasses.replace(TransportConfig(), tls_ca=str(ca)).tls_ca


async def test_a_tls_server_answers_probes_on_its_plaintext_health_port(tmp_path) -> None:
    """Kubernetes' gRPC probes speak no TLS: --health-port serves grpc.health.v1 alone, in plaintext, with the
    server's own statuses (NOT_SERVING once it stops)."""
    import socket

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    ca, cert, key = ensure_stack_certs(tmp_path / "tls")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        probe_port = sock.getsockname()[1]
    server = GrpcServer(transport=TransportConfig(tls_cert=str(cert), tls_key=str(key), health_port=probe_port))
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{probe_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        answer = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        other = channel.unary_unary("/yieldloop.checkpoint.v1.CheckpointService/ListModels")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await other(b"", timeout=10)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED  # nothing but health there
    async with grpc.aio.insecure_channel(server.address) as channel:  # the service's own port: TLS only
        with pytest.raises(grpc.aio.AioRpcError):
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    await server.stop(0)
