"""The sharded trainer (FSDP2 over gloo on CPU, world sizes 2 and 4): each step equals the single process's."""

from __future__ import annotations

import pathlib

import pytest
import torch
from test_packing import LENGTHS, ragged_datums

from yieldloop_server.trainer.distributed import DistributedTrainer
from yieldloop_server.trainer.trainer import AdamConfig, AdapterSetup, Trainer, TrainerConfig

ADAM = AdamConfig(learning_rate=1e-3, weight_decay=0.01, max_grad_norm=1.0)
FP32 = TrainerConfig(micro_batch_tokens=48)


def weights(folder: pathlib.Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def assert_same_weights(sharded: DistributedTrainer, single: Trainer, tmp: pathlib.Path, rtol: float = 1e-5) -> None:
    """What the two trainers write as sampler weights agree: the difference's norm within ``rtol`` of the weights'
    norm, and no element off by more than ``rtol`` (fp32 round-off: the ranks sum their gradients in another
    order than one process does)."""
    ours, theirs = weights(sharded.save(tmp / "sharded", with_state=False)), weights(single.save(tmp / "single", False))
    assert ours.keys() == theirs.keys() and ours
    diff = torch.cat([(ours[n] - t).flatten() for n, t in theirs.items()])
    whole = torch.cat([t.flatten() for t in theirs.values()])
    assert float(diff.norm()) <= rtol * float(whole.norm())
    assert float(diff.abs().max()) <= rtol


def step_both(single: Trainer, sharded: DistributedTrainer, seed: int, loss: str = "ppo") -> None:
    """One step of each on the same ragged batch: the sharded step's gradient norm is the single process's."""
    datums = ragged_datums(single.vocab_size, LENGTHS, seed=seed)
    single.forward_backward(datums, loss, {})
    sharded.forward_backward(datums, loss, {})
    assert sharded.optim_step(ADAM) == pytest.approx(single.optim_step(ADAM), rel=1e-5)


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_loss_steps_as_one_process(tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path, world_size: int) -> None:
    """One step of each loss, then a custom loss's (logprobs, then the weighted cross-entropy backward): the
    metrics, gradient norm and weights of the sharded trainer equal one process's (fp32, 1e-5 relative), with and
    without activation checkpointing."""
    single = Trainer(tiny_model_dir, FP32)
    # at 4 ranks with activation checkpointing (each layer recomputed in the backward): the same step again
    config = TrainerConfig(micro_batch_tokens=48, shard="fsdp", activation_checkpointing=world_size == 4)
    sharded = DistributedTrainer(tiny_model_dir, config, world_size)
    try:
        for i, loss in enumerate(["importance_sampling", "ppo", "cispo", "dro", "cross_entropy"]):
            datums = ragged_datums(single.vocab_size, LENGTHS, seed=i)
            expected, got = single.forward_backward(datums, loss, {}), sharded.forward_backward(datums, loss, {})
            for key in ("loss_sum", "num_action_tokens", "mean_ratio", "entropy", "tokens_useful"):
                assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), (loss, key)
            norms = single.optim_step(ADAM), sharded.optim_step(ADAM)
            assert norms[1] == pytest.approx(norms[0], rel=1e-5), loss
        datums = ragged_datums(single.vocab_size, LENGTHS, seed=9)
        for a, b in zip(single.logprobs(datums), sharded.logprobs(datums), strict=True):
            torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=1e-5)
        custom = [d.__class__(**{**d.__dict__, "weights": [0.5 * a for a in d.advantages]}) for d in datums]
        single.forward_backward(custom, "cross_entropy", {})
        sharded.forward_backward(custom, "cross_entropy", {})
        assert sharded.optim_step(ADAM) == pytest.approx(single.optim_step(ADAM), rel=1e-5)
        assert sharded.step == single.step == 6
        assert_same_weights(sharded, single, tmp_path)
    finally:
        sharded.close()


def test_hsdp_steps_as_one_process(tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """HSDP over 4 ranks: 2 replicas, each sharded over a group of 2 (as 2 nodes of 2 GPUs would be): the step
    equals one process's, and its training state resumes on 2 ranks sharded plainly."""
    config = TrainerConfig(micro_batch_tokens=48, shard="hsdp", shard_group=2)
    single = Trainer(tiny_model_dir, FP32)
    sharded = DistributedTrainer(tiny_model_dir, config, 4)
    try:
        for seed in (5, 6):
            datums = ragged_datums(single.vocab_size, LENGTHS, seed=seed)
            expected, got = single.forward_backward(datums, "ppo", {}), sharded.forward_backward(datums, "ppo", {})
            assert got["loss_sum"] == pytest.approx(expected["loss_sum"], rel=1e-5)
            assert sharded.optim_step(ADAM) == pytest.approx(single.optim_step(ADAM), rel=1e-5)
        assert_same_weights(sharded, single, tmp_path)
        saved = sharded.save(tmp_path / "state", with_state=True)
    finally:
        sharded.close()
    resumed = DistributedTrainer(saved, TrainerConfig(micro_batch_tokens=48, shard="fsdp"), 2)
    try:
        step_both(single, resumed, 7)
        assert_same_weights(resumed, single, tmp_path / "resumed")
    finally:
        resumed.close()


def test_untied_output_layer_steps_as_one_process(tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """A model whose output layer is not its embedding (each then sharded as a group of its own)."""
    from yieldloop_server.common.hf import load_causal_lm

    model, tokenizer = load_causal_lm(tiny_model_dir, "float32", "cpu")
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone() * 0.5)
    model.save_pretrained(tmp_path / "untied")
    tokenizer.save_pretrained(tmp_path / "untied")
    single = Trainer(tmp_path / "untied", FP32)
    sharded = DistributedTrainer(tmp_path / "untied", TrainerConfig(micro_batch_tokens=48, shard="fsdp"), 2)
    try:
        step_both(single, sharded, 4)
        assert_same_weights(sharded, single, tmp_path)
        assert "lm_head.weight" in weights(tmp_path / "sharded")
    finally:
        sharded.close()


@pytest.mark.parametrize("world_size", [2, 4])
def test_lora_steps_as_one_process(tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path, world_size: int) -> None:
    """A LoRA fork under FSDP (the frozen base sharded too): the adapter trains as in one process."""
    import json

    from yieldloop.types import LoraConfig
    from yieldloop_server.common.lora import adapter_config

    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(adapter_config(LoraConfig(rank=4))))
    adapter = AdapterSetup(tmp_path / "adapter", 7)
    single = Trainer(tiny_model_dir, FP32, adapter)
    sharded = DistributedTrainer(
        tiny_model_dir, TrainerConfig(micro_batch_tokens=48, shard="fsdp"), world_size, adapter
    )
    try:
        for seed in (1, 2):
            step_both(single, sharded, seed, "importance_sampling")
        assert_same_weights(sharded, single, tmp_path)
    finally:
        sharded.close()


def test_sampler_files_are_byte_identical(tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """The same weights written by the sharded trainer (each tensor gathered in turn) and by save_pretrained in
    one process: the same files, byte for byte; split over several files, an index names them and transformers
    loads them as the same model."""
    from transformers import AutoModelForCausalLM

    from yieldloop_server.trainer import sharding

    single = Trainer(tiny_model_dir, FP32)
    sharded = DistributedTrainer(tiny_model_dir, TrainerConfig(shard="fsdp"), 2)
    try:
        a, b = sharded.save(tmp_path / "sharded", with_state=False), single.save(tmp_path / "single", False)
        names = sorted(p.name for p in b.iterdir())
        assert sorted(p.name for p in a.iterdir()) == names
        for name in names:
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
    finally:
        sharded.close()
    split = tmp_path / "split"
    split.mkdir()
    files = sharding.write_safetensors(sharding.unique_weights(single.model), split, max_shard_bytes=200_000)
    assert len(files) > 2 and (split / "model.safetensors.index.json").is_file()
    for name in ("config.json", "generation_config.json"):
        (split / name).write_bytes((b / name).read_bytes())
    loaded = AutoModelForCausalLM.from_pretrained(split)
    for name, param in single.model.named_parameters():
        assert torch.equal(loaded.get_parameter(name), param.detach()), name


def test_resume_at_another_world_size(tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """Training state written sharded over 2 ranks (every rank its shards of the AdamW moments), resumed on 4
    ranks and in one process: the next step equals the uninterrupted run's."""
    config = TrainerConfig(micro_batch_tokens=48, shard="fsdp")
    first = DistributedTrainer(tiny_model_dir, config, 2)
    try:
        for seed in (1, 2):
            first.forward_backward(ragged_datums(first.vocab_size, LENGTHS, seed=seed), "ppo", {})
            first.optim_step(ADAM)
        saved = first.save(tmp_path / "step2", with_state=True)
        assert any(p.name.startswith("optimizer-dcp-") for p in saved.iterdir())
        first.forward_backward(ragged_datums(first.vocab_size, LENGTHS, seed=3), "ppo", {})
        first.optim_step(ADAM)
        expected = weights(first.save(tmp_path / "uninterrupted", with_state=False))
    finally:
        first.close()
    for resumed in (DistributedTrainer(saved, config, 4), Trainer(saved, FP32)):  # resharded, and whole
        try:
            assert resumed.step == 2
            resumed.forward_backward(ragged_datums(resumed.vocab_size, LENGTHS, seed=3), "ppo", {})
            resumed.optim_step(ADAM)
            got = weights(resumed.save(tmp_path / f"resumed-{type(resumed).__name__}", with_state=False))
            for name, tensor in expected.items():
                torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-5 * float(tensor.abs().max()))
        finally:
            resumed.close()


async def test_a_rank_killed_mid_step_fails_it_typed_and_the_trainer_recovers(tmp_path: pathlib.Path) -> None:
    """`serve trainer --nproc 2 --trainer-shard fsdp`, rank 1 killed (SIGKILL) during a forward_backward: the call
    fails UNAVAILABLE/WORKER_DIED, HEAD and its weights stay as they were, and the next calls train again on
    fresh ranks, from the last checkpoint."""
    import asyncio
    import multiprocessing
    import os
    import signal

    from yieldloop.client import Client
    from yieldloop.errors import UnavailableError
    from yieldloop_server.config import ServeOptions, TrainerOptions
    from yieldloop_server.serve import build_service
    from yieldloop_server.stack import ensure_base_model, ensure_stack_keys
    from yieldloop_server.store import open_store

    ensure_base_model(open_store(str(tmp_path / "store")), "tiny")
    admin_key, _ = ensure_stack_keys(open_store(str(tmp_path / "store")), tmp_path)
    checkpoints = await build_service(ServeOptions(service="checkpoint", data_dir=tmp_path))
    checkpoint = await checkpoints.start()
    options = TrainerOptions(nproc=2, shard="fsdp", state_every=1, micro_batch_tokens=64)
    trainer = await build_service(
        ServeOptions(service="trainer", data_dir=tmp_path, checkpoint_address=checkpoint, trainer=options)
    )
    address = await trainer.start()
    try:
        async with Client(trainer=address, checkpoint=checkpoint, timeout=120, api_key=admin_key) as client:
            await client.forward_backward(datums=ragged_datums(384, LENGTHS, seed=1), loss_fn="importance_sampling")
            first = await client.optim_step(1e-3)
            head = await client.get_head("tiny")
            assert head.checkpoint_id == first.checkpoint.checkpoint_id

            big = [d for seed in range(12) for d in ragged_datums(384, LENGTHS, seed=seed)]  # many micro-batches
            call = asyncio.ensure_future(client.forward_backward(datums=big, loss_fn="importance_sampling"))
            await asyncio.sleep(0.3)
            (rank1,) = [p for p in multiprocessing.active_children() if p.name.startswith("SpawnProcess")]
            os.kill(rank1.pid, signal.SIGKILL)
            with pytest.raises(UnavailableError) as failed:
                await call
            assert failed.value.reason == "WORKER_DIED"
            assert (await client.get_head("tiny")) == head  # nothing committed

            await client.forward_backward(datums=ragged_datums(384, LENGTHS, seed=2), loss_fn="importance_sampling")
            second = await client.optim_step(1e-3)
            assert second.step == 2 and second.parent_checkpoint_id == head.checkpoint_id
    finally:
        await trainer.stop(1.0)
        await checkpoints.stop(1.0)


async def test_a_weight_group_fed_by_the_sharded_trainer(tmp_path: pathlib.Path) -> None:
    """`--nproc 2 --trainer-shard fsdp` beside a rollout service taking weights by broadcast: a step's files,
    written from the shards, reach the rollout service by the group (not pulled), the bytes of the manifest."""
    from test_weight_group import group_stack, members, same_as_manifest, step

    from yieldloop_server.config import TrainerOptions

    async with group_stack(tmp_path, TrainerOptions(nproc=2, shard="fsdp")) as (client, counter):
        await step(client, 1)  # pulled: the rollout service joins the group with it
        await members(client, 1)
        pulls = counter.pulls
        checkpoint_id = await step(client, 2)
        assert counter.pulls == pulls  # by broadcast
        await same_as_manifest(client, tmp_path / "work" / "rollout" / "grp" / checkpoint_id, checkpoint_id)


def test_a_sharded_run_resumes_an_unsharded_one(tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """Training state written by one process (optimizer.pt) resumed sharded over 2 ranks: each keeps its shards
    of the moments, and the next step equals the one process's."""
    single = Trainer(tiny_model_dir, FP32)
    for seed in (1, 2):
        single.forward_backward(ragged_datums(single.vocab_size, LENGTHS, seed=seed), "ppo", {})
        single.optim_step(ADAM)
    saved = single.save(tmp_path / "step2", with_state=True)
    resumed = DistributedTrainer(saved, TrainerConfig(micro_batch_tokens=48, shard="fsdp"), 2)
    try:
        assert resumed.step == 2
        step_both(single, resumed, 3)
        assert_same_weights(resumed, single, tmp_path)
    finally:
        resumed.close()
