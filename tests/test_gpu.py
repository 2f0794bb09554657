"""GPU paths: the closed loop with the torch engine and trainer on CUDA, and a bf16 trainer step.

Marked ``gpu``: skipped on machines without CUDA (CI), run on a lent GPU machine.
"""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from yieldloop.client import Client, sampling_params
from yieldloop.envs.letters import tasks
from yieldloop.loop import LoopConfig, closed_loop
from yieldloop_server.config import StackConfig, TrainerOptions
from yieldloop_server.stack import InProcessStack

pytestmark = pytest.mark.gpu


@pytest_asyncio.fixture(scope="module")
async def cuda_client(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Client]:
    # fp32 trainer on CUDA so the sampler/trainer check holds to 1e-4 (bf16 is tested on its own below).
    config = StackConfig(
        data_dir=tmp_path_factory.mktemp("cuda-stack"), device="cuda", trainer=TrainerOptions(dtype="float32")
    )
    stack = InProcessStack(config)
    await stack.start()
    async with Client(**stack.addresses, api_key=stack.api_key, timeout=120) as client:
        yield client
    await stack.stop()


async def test_closed_loop_on_cuda(cuda_client: Client) -> None:
    # On-policy (max_off_policy=0): the second batch is sampled by the first step's weights.
    config = LoopConfig(steps=2, group_size=4, max_off_policy=0)
    reports = [r async for r in closed_loop(cuda_client, config, train_tasks=tasks("abcd"))]
    assert [r.served_weight_version for r in reports] == [r.checkpoint_id for r in reports]
    assert reports[1].sampled_weight_versions == [reports[0].checkpoint_id]


async def test_cuda_sampler_matches_cuda_trainer(cuda_client: Client) -> None:
    from yieldloop.proto.common.v1 import common_pb2 as common_pb

    prompt = [1, 40, 41, 42]
    sampling = sampling_params(max_tokens=32, temperature=1.0, seed=7, ignore_eos=True)
    completion = await cuda_client.generate(prompt, sampling=sampling)
    assert len(completion.token_ids) == 32
    tokens = prompt + completion.token_ids
    [learner] = await cuda_client.forward(datums=[common_pb.Datum(input_tokens=tokens[:-1], target_tokens=tokens[1:])])
    worst = max(abs(a - b) for a, b in zip(learner[len(prompt) - 1 :], completion.logprobs, strict=True))
    assert worst < 1e-4, worst


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_bf16_trainer_step(tiny_model_dir: pathlib.Path, compile: bool) -> None:
    import math

    import torch

    from yieldloop.types import Datum
    from yieldloop_server.trainer.trainer import AdamConfig, Trainer, TrainerConfig

    trainer = Trainer(tiny_model_dir, TrainerConfig(device="cuda", dtype="bfloat16", compile=compile))
    assert next(trainer.model.parameters()).dtype == torch.bfloat16
    datum = Datum(list(range(1, 33)), list(range(2, 34)), [-5.0] * 32, [0.0] * 16 + [1.0] * 16, [0.0] * 32)
    metrics = trainer.forward_backward([datum], "importance_sampling", {})
    assert math.isfinite(metrics["loss_sum"]) and metrics["num_action_tokens"] == 16
    before = [p.detach().clone() for p in trainer.model.parameters()]
    assert math.isfinite(trainer.optim_step(AdamConfig(learning_rate=1e-3)))
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
