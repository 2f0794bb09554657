"""Shared fixtures: one in-process stack of all four services on port 0, driven by the real client.

The stack (and its tiny model, created offline) is built once per test session.
"""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import AsyncIterator, Iterator

from yieldloop.cli import quiet_libraries

quiet_libraries()

import pytest  # noqa: E402
import pytest_asyncio  # noqa: E402
import uvloop  # noqa: E402

from yieldloop.client import Client  # noqa: E402
from yieldloop.transport import TransportConfig  # noqa: E402
from yieldloop_server.stack import InProcessStack, StackConfig  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict:
    """The services run on uvloop in production; the tests do too."""
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A real S3 HTTP endpoint: moto_server on 127.0.0.1, started for this test session."""
    import os
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "yieldloop-test")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "yieldloop-test")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                break
        assert server.poll() is None and time.monotonic() < deadline, "moto_server did not start"
        time.sleep(0.1)
    yield f"http://127.0.0.1:{port}"
    server.terminate()
    server.wait(10)


@contextlib.asynccontextmanager
async def s3_stack(moto_endpoint: str, data_dir: pathlib.Path, timeout: float = 120):
    """An in-process stack keeping everything in a fresh bucket of moto_server (configured as users configure
    boto3: AWS_ENDPOINT_URL), and a client of it: ``(stack, client, bucket)``."""
    import os
    import uuid

    import boto3

    from yieldloop.client import Client
    from yieldloop_server.config import EnvOptions, StackConfig
    from yieldloop_server.stack import InProcessStack

    os.environ["AWS_ENDPOINT_URL"] = moto_endpoint
    bucket = f"yl-{uuid.uuid4().hex[:10]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    stack = InProcessStack(StackConfig(data_dir=data_dir, store=f"s3://{bucket}/yieldloop", env=EnvOptions(workers=0)))
    await stack.start()
    try:
        async with Client(**stack.addresses, api_key=stack.api_key, timeout=timeout) as client:
            yield stack, client, bucket
    finally:
        await stack.stop()
        os.environ.pop("AWS_ENDPOINT_URL")


@pytest.fixture
def s3_store(moto_endpoint: str):
    """An S3Store on a fresh bucket of the session's moto_server."""
    import uuid

    import boto3

    from yieldloop_server.store.s3 import S3Store

    bucket = f"yl-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket=bucket)
    return S3Store(bucket, "checkpoints-root", endpoint_url=moto_endpoint)


@pytest.fixture(params=["fs", "s3"])
def any_store(request: pytest.FixtureRequest, tmp_path: pathlib.Path):
    """Each object store implementation: the filesystem one and S3 against moto_server."""
    if request.param == "s3":
        return request.getfixturevalue("s3_store")
    from yieldloop_server.store.fs import FsStore

    return FsStore(tmp_path / "store")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A tiny HF model folder (tokenizer + Qwen2 weights) made offline, with random weights (no warm-up): it
    rambles on to max_tokens, which the engine tests rely on (long streams, reloads mid-stream)."""
    from yieldloop_server.common.tiny_model import TinyModelConfig, create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("tiny") / "model", TinyModelConfig(warmup_steps=0))


class CallRecorder:
    """A transport interceptor that records every call it wraps: (method, protocol, error type on exit or None).

    The session stack runs every test's calls through it, so every handler style is exercised with an
    interceptor installed; tests/test_transport.py checks what it saw.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str | None]] = []

    @contextlib.asynccontextmanager
    async def intercept(self, call):
        try:
            yield
        except BaseException as exc:
            self.calls.append((call.method, call.protocol, type(exc).__name__))
            raise
        self.calls.append((call.method, call.protocol, None))


@pytest.fixture(scope="session")
def call_recorder() -> CallRecorder:
    return CallRecorder()


@pytest_asyncio.fixture(scope="session")
async def stack(tmp_path_factory: pytest.TempPathFactory, call_recorder: CallRecorder) -> AsyncIterator[InProcessStack]:
    transport = TransportConfig(server_interceptors=(call_recorder,))
    stack = InProcessStack(StackConfig(data_dir=tmp_path_factory.mktemp("stack"), transport=transport))
    await stack.start()
    yield stack
    await stack.stop()


@pytest_asyncio.fixture(scope="session")
async def client(stack: InProcessStack) -> AsyncIterator[Client]:
    async with Client(**stack.addresses, api_key=stack.api_key, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def engine_folders(tiny_model_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """Two checkpoints of the tiny model: "v1" (as created) and "v2" (every weight perturbed)."""
    from engine_harness import perturbed_copy

    return {"v1": tiny_model_dir, "v2": perturbed_copy(tiny_model_dir, tmp_path_factory.mktemp("tiny-v2"))}


ENGINE_KINDS = ["torch", "torch-process", "vllm"]
"""torch-process: the torch engine decoding in a child process (what `yieldloop serve rollout` runs by default)."""


@pytest_asyncio.fixture(scope="session", params=ENGINE_KINDS)
async def served_engine(request: pytest.FixtureRequest, engine_folders):
    """Each engine (torch; vLLM when installed) loaded with "v1" and served over gRPC, once per session."""
    from engine_harness import serve_engine, stop_engine

    if request.param == "vllm":
        from yieldloop_server.rollout.engines.vllm_engine import vllm_available

        if not vllm_available():
            pytest.skip("vLLM is not installed (pip install 'yieldloop-server[vllm]')")
    served = await serve_engine(request.param, engine_folders)
    yield served
    await stop_engine(served)
