"""Data parallel on CPU (gloo, world_size=2): the update equals the single-process update on the same batch."""

from __future__ import annotations

import pathlib

import torch

from yieldloop_server.trainer.distributed import DistributedTrainer
from yieldloop_server.trainer.trainer import AdamConfig, Trainer, TrainerConfig
from test_trainer import batch


def test_world_size_2_equals_single_process(tiny_model_dir: pathlib.Path) -> None:
    """In float64: in float32 the two shards' sum differs from one pass by round-off, and AdamW's first steps
    turn round-off in near-zero (cancelling) gradient entries into differences of order the learning rate."""
    adam = AdamConfig(learning_rate=1e-2, weight_decay=0.01, max_grad_norm=1.0)
    config = TrainerConfig(dtype="float64")
    single = Trainer(tiny_model_dir, config)
    parallel = DistributedTrainer(tiny_model_dir, config, world_size=2)
    try:
        for seed in (1, 2):
            datums = batch(seed, single.vocab_size) + batch(seed + 10, single.vocab_size)
            expected = single.forward_backward(datums, "ppo", {})
            got = parallel.forward_backward(datums, "ppo", {})
            for key in ("loss_sum", "num_action_tokens", "mean_ratio", "clip_fraction", "entropy"):
                assert abs(got[key] - expected[key]) <= 1e-5 * max(1.0, abs(expected[key])), key
            norms = single.optim_step(adam), parallel.optim_step(adam)
            assert abs(norms[0] - norms[1]) <= 1e-5 * norms[0]
        for (name, a), (_, b) in zip(single.model.named_parameters(), parallel.model.named_parameters(), strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)
        assert parallel.step == single.step == 2
    finally:
        parallel.close()


async def test_trainer_service_with_two_ranks(tmp_path: pathlib.Path) -> None:
    """`yieldloop serve trainer --nproc 2`: the service trains data-parallel and commits checkpoints."""
    from yieldloop.client import Client
    from yieldloop.proto.common.v1 import common_pb2 as common_pb
    from yieldloop_server.config import ServeOptions, TrainerOptions
    from yieldloop_server.serve import build_service
    from yieldloop_server.stack import ensure_base_model, ensure_stack_keys
    from yieldloop_server.store import open_store

    ensure_base_model(open_store(str(tmp_path / "store")), "tiny")
    admin_key, _ = ensure_stack_keys(open_store(str(tmp_path / "store")), tmp_path)
    start_checkpoint, stop_checkpoint = await build_service(ServeOptions(service="checkpoint", data_dir=tmp_path))
    checkpoint = await start_checkpoint()
    start_trainer, stop_trainer = await build_service(
        ServeOptions(service="trainer", data_dir=tmp_path, checkpoint_address=checkpoint,
                     trainer=TrainerOptions(nproc=2))
    )
    trainer = await start_trainer()
    try:
        async with Client(trainer=trainer, checkpoint=checkpoint, timeout=120, api_key=admin_key) as client:
            datums = [common_pb.Datum(input_tokens=d.input_tokens, target_tokens=d.target_tokens,
                                      sampling_logprobs=d.sampling_logprobs, advantages=d.advantages)
                      for d in batch(3, 384)]
            result = await client.forward_backward(datums=datums, loss_fn="importance_sampling")
            assert result.num_datums == 3 and result.num_action_tokens > 0
            step = await client.optim_step(1e-3)
            assert step.step == 1 and (await client.get_head("tiny")).checkpoint_id == step.checkpoint.checkpoint_id
    finally:
        await stop_trainer(1.0)
        await stop_checkpoint(1.0)
