"""Shared fixtures: one in-process stack of all four services on port 0, driven by the real client.

The stack (and its tiny model, created offline) is built once per test session.
"""

from __future__ import annotations

import pathlib

from yieldloop.cli import quiet_libraries

quiet_libraries()

import pytest  # noqa: E402
import pytest_asyncio  # noqa: E402
import uvloop  # noqa: E402

from yieldloop.client import Client  # noqa: E402
from yieldloop.services.stack import InProcessStack, StackConfig  # noqa: E402


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
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A tiny HF model folder (tokenizer + Qwen2 weights) made offline."""
    from yieldloop.services.common.tiny_model import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest_asyncio.fixture(scope="session")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> InProcessStack:
    stack = InProcessStack(StackConfig(data_dir=tmp_path_factory.mktemp("stack")))
    await stack.start()
    yield stack
    await stack.stop()


@pytest_asyncio.fixture(scope="session")
async def client(stack: InProcessStack) -> Client:
    async with Client(**stack.addresses, timeout=120) as client:
        yield client
