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
