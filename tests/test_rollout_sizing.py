"""The rollout options of a model at size (tensor parallelism, GPU memory share, context length): validated where
they are given, and handed to vLLM's engine arguments as vLLM documents them."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from yieldloop.errors import InvalidArgumentError
from yieldloop_server.config import RolloutOptions


@pytest.mark.parametrize(
    ("options", "field"),
    [
        (RolloutOptions(tensor_parallel=0), "rollout.tensor_parallel"),
        (RolloutOptions(tensor_parallel=2), "rollout.tensor_parallel"),  # the torch engine: one device
        (RolloutOptions(engine="vllm", lora_engine="torch", tensor_parallel=2), "rollout.tensor_parallel"),
        (RolloutOptions(gpu_memory_utilization=1.5), "rollout.gpu_memory_utilization"),
        (RolloutOptions(gpu_memory_utilization=float("nan")), "rollout.gpu_memory_utilization"),
        (RolloutOptions(max_model_len=-1), "rollout.max_model_len"),
    ],
)
def test_rollout_options_out_of_range_are_refused_by_name(options: RolloutOptions, field: str) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        options.validate()
    assert raised.value.field == field


def test_vllm_gets_tensor_parallel_memory_share_and_context(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: pathlib.Path
) -> None:
    """The engine's arguments as vLLM takes them: ``tensor_parallel_size`` with its multiprocessing executor (one
    worker process per GPU) beyond one GPU, ``gpu_memory_utilization`` and ``max_model_len``."""
    pytest.importorskip("vllm")
    from vllm.v1.engine.async_llm import AsyncLLM

    from yieldloop_server.rollout.engines.vllm_engine import VllmEngine

    seen: list[Any] = []
    monkeypatch.setattr(AsyncLLM, "from_engine_args", classmethod(lambda cls, args: seen.append(args)))
    VllmEngine(tensor_parallel_size=4, memory_utilization=0.8, max_model_len=4096, device="cuda")._start(tiny_model_dir)
    VllmEngine(device="cpu")._start(tiny_model_dir)
    sharded, single = seen
    assert (sharded.tensor_parallel_size, sharded.distributed_executor_backend) == (4, "mp")
    assert (sharded.gpu_memory_utilization, sharded.max_model_len) == (0.8, 4096)
    assert (single.tensor_parallel_size, single.distributed_executor_backend) == (1, "uni")


async def test_the_client_spreads_calls_over_rollout_replicas(tmp_path: pathlib.Path) -> None:
    """Two RolloutService replicas of one model, given to the client as a list: calls go to each in turn."""
    import contextlib
    import dataclasses

    from yieldloop.client import Client, sampling_params
    from yieldloop.transport import TransportConfig
    from yieldloop_server.config import EnvOptions, ServeOptions, StackConfig
    from yieldloop_server.serve import build_service
    from yieldloop_server.stack import InProcessStack

    class Count:
        def __init__(self) -> None:
            self.generates = 0

        @contextlib.asynccontextmanager
        async def intercept(self, call: Any) -> Any:
            if call.method.endswith("RolloutService/Generate"):
                self.generates += 1
            yield

    first, second = Count(), Count()
    config = StackConfig(
        data_dir=tmp_path,
        store=str(tmp_path / "store"),
        env=EnvOptions(workers=0),
        hud=False,
        transport=TransportConfig(server_interceptors=(first,)),
    )
    stack = InProcessStack(config)
    await stack.start()
    options = ServeOptions.of(stack.config, "rollout", stack.addresses)
    replica = await build_service(
        dataclasses.replace(
            options,
            data_dir=tmp_path / "replica",
            transport=dataclasses.replace(options.transport, server_interceptors=(second,)),
        )
    )
    address = await replica.start()
    try:
        rollouts = [stack.addresses["rollout"], address]
        async with Client(rollout=rollouts, api_key=stack.api_key, timeout=120) as client:
            for _ in range(4):
                completion = await client.generate([1, 2, 3], sampling=sampling_params(max_tokens=2))
                assert len(completion.token_ids) == 2
        assert (first.generates, second.generates) == (2, 2)
    finally:
        await replica.stop(1.0)
        await stack.stop()
