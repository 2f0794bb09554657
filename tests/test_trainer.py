"""Trainer state: exact resume from a checkpoint, GRPO group handling, and validation."""

from __future__ import annotations

import pathlib
import random

import pytest
import torch

from yieldloop.errors import InvalidArgumentError
from yieldloop.groups import runs_to_datums
from yieldloop.types import Datum, Run, Turn
from yieldloop_server.trainer.trainer import AdamConfig, Trainer


def random_datums(rng: random.Random, lengths: tuple[int, ...], vocab_size: int, lowest: int = 0) -> list[Datum]:
    """Datums of random tokens with sampler logprobs and advantages on all but the first three positions."""
    datums = []
    for length in lengths:
        tokens = [rng.randrange(lowest, vocab_size) for _ in range(length + 1)]
        datums.append(
            Datum(
                tokens[:-1],
                tokens[1:],
                [-rng.uniform(4, 7) for _ in range(length)],
                [0.0] * 3 + [rng.uniform(-1, 1) for _ in range(length - 3)],
                [0.0] * length,
            )
        )
    return datums


def batch(seed: int, vocab_size: int) -> list[Datum]:
    return random_datums(random.Random(seed), (10, 14, 7), vocab_size)


def step(trainer: Trainer, seed: int) -> None:
    trainer.forward_backward(batch(seed, trainer.vocab_size), "ppo", {})
    trainer.optim_step(AdamConfig(learning_rate=1e-2, weight_decay=0.01, max_grad_norm=1.0))


def test_exact_resume(tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """Two steps in one process equal one step, a restart from the checkpoint, and one more step."""
    straight = Trainer(tiny_model_dir)
    step(straight, 1)
    step(straight, 2)

    first = Trainer(tiny_model_dir)
    step(first, 1)
    saved = first.save(tmp_path / "after-step-1")
    del first
    resumed = Trainer(saved)
    assert resumed.step == 1
    step(resumed, 2)

    assert resumed.step == straight.step == 2
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)
    state_a, state_b = straight.optimizer.state_dict(), resumed.optimizer.state_dict()
    assert state_a["param_groups"] == state_b["param_groups"]
    for key, entry in state_a["state"].items():
        for field, value in entry.items():
            torch.testing.assert_close(state_b["state"][key][field], value, rtol=0, atol=1e-6, msg=f"{key}.{field}")


def test_saves_write_what_transformers_writes(tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """After its first save (by transformers), a trainer writes its checkpoints directly: the model's files, byte
    for byte, as ``save_pretrained`` would write them after the same steps; the tokenizer's files as the folder it
    loaded holds them (a checkpoint's tokenizer is its parent's, not transformers' rewording of it)."""
    trainer = Trainer(tiny_model_dir)
    for seed in (1, 2):
        step(trainer, seed)
        ours = trainer.save(tmp_path / f"ours-{seed}", with_state=False)
        theirs = tmp_path / f"theirs-{seed}"
        trainer.model.save_pretrained(theirs, safe_serialization=True)
        tokenizer_files = {pathlib.Path(p).name for p in trainer.tokenizer.save_pretrained(theirs)}
        assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
        for path in theirs.iterdir():
            source = tiny_model_dir / path.name
            expected = source if path.name in tokenizer_files and source.is_file() else path
            assert (ours / path.name).read_bytes() == expected.read_bytes(), path.name
    assert trainer._direct_save is not None, "the second save was written directly"
    assert Trainer(ours).tokenizer("abc").input_ids == trainer.tokenizer("abc").input_ids


def run(group: str, reward: float) -> Run:
    return Run(group_id=group, reward=reward, turns=[Turn([1, 2, 3], [4, 5], [-1.0, -2.0])])


def test_reward_scale_and_incomplete_groups() -> None:
    runs = [run("g1", 1.0), run("g1", 0.0), run("g2", 0.25), run("g2", 0.75), run("g2", 0.5)]
    datums, stats = runs_to_datums(runs, reward_scale=2.0)
    assert [d.advantages[-1] for d in datums] == pytest.approx([1.0, -1.0, -0.5, 0.5, 0.0])
    assert stats.num_groups == 2 and stats.num_groups_without_signal == 0
    with pytest.raises(InvalidArgumentError, match="group 'g1' has 2 runs, not 3") as err:
        runs_to_datums(runs, group_size=3)
    assert err.value.reason == "GROUP_INCOMPLETE"
    assert len(runs_to_datums(runs, group_size=3, allow_incomplete_groups=True)[0]) == 5


@pytest.mark.parametrize(
    ("datum", "field", "reason"),
    [
        (Datum([1, 2], [2], [], [], []), "datum.target_tokens", "DATUM_INVALID"),
        (Datum([1, 2], [2, 3], [0.0], [], []), "datum.sampling_logprobs", "DATUM_INVALID"),
        (Datum([1, 2], [2, 3], [], [1.0, float("inf")], []), "datum.advantages", "DATUM_INVALID"),
        (Datum([1, 2], [2, 3], [float("nan"), 0.0], [], []), "datum.sampling_logprobs", "DATUM_INVALID"),
        (Datum([1, 2], [2, 3], [], [], [1.0, float("-inf")]), "datum.weights", "DATUM_INVALID"),
        (Datum([1, 999], [2, 3], [], [], []), "datum.input_tokens", "TOKEN_OUT_OF_VOCAB"),
        (Datum([1, 2], [2, -1], [], [], []), "datum.target_tokens", "TOKEN_OUT_OF_VOCAB"),
        (Datum([], [], [], [], []), "datum.input_tokens", "DATUM_INVALID"),
    ],
    ids=[
        "target-length",
        "logprob-length",
        "inf-advantage",
        "nan-logprob",
        "inf-weight",
        "input-vocab",
        "target-vocab",
        "empty",
    ],
)
def test_datum_validation(datum: Datum, field: str, reason: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        datum.validate(vocab_size=384)
    assert (err.value.field, err.value.reason) == (field, reason)


async def test_one_trainer_trains_several_slugs_apart(stack, client) -> None:
    """Each slug has its own session (weights, AdamW state, gradients): steps of one never move another's head;
    two slugs train concurrently; a busy trainer refuses a third slug rather than drop pending gradients."""
    import asyncio

    from yieldloop import errors
    from yieldloop.envs.letters import tasks

    for name in ("twin-a", "twin-b", "twin-c"):
        await client.fork_model("tiny", name)
    runs = [run async for run in client.stream_rollouts(tasks("ab"), group_size=2)]
    tiny_head = await client.get_head("tiny")

    async def train(slug: str) -> str:
        await client.forward_backward(runs=runs, model=slug)
        return (await client.optim_step(1e-3, model=slug)).checkpoint.checkpoint_id

    # The forks start at the step of tiny's head (other tests may have trained tiny before this one).
    base_step = (await client.get_checkpoint("tiny", tiny_head.checkpoint_id)).step
    a, b = await asyncio.gather(train("twin-a"), train("twin-b"))  # concurrently, from one client
    for slug, checkpoint in (("twin-a", a), ("twin-b", b)):
        head = await client.get_head(slug)
        assert head.checkpoint_id == checkpoint
        assert (await client.get_checkpoint(slug, checkpoint)).parent_checkpoint_id == tiny_head.checkpoint_id
        assert (await client.get_trainer_info(model=slug)).step == base_step + 1  # its own optimizer, one step
    assert (await client.get_head("tiny")).checkpoint_id == tiny_head.checkpoint_id
    a2 = await train("twin-a")
    assert (await client.get_checkpoint("twin-a", a2)).parent_checkpoint_id == a
    assert (await client.get_head("twin-b")).checkpoint_id == b

    # Two loaded sessions with pending gradients: a third slug is refused, nothing is dropped.
    await client.forward_backward(runs=runs, model="twin-a")
    await client.forward_backward(runs=runs, model="twin-b")
    with pytest.raises(errors.ResourceExhaustedError) as err:
        await client.forward_backward(runs=runs, model="twin-c")
    assert err.value.reason == "TOO_MANY_MODELS"
    for slug in ("twin-a", "twin-b"):
        assert (await client.get_trainer_info(model=slug)).num_pending_datums == len(runs)
        await client.optim_step(1e-3, model=slug)
    await client.forward_backward(runs=runs, model="twin-c")  # room again: an idle session is closed
    assert (await client.get_trainer_info(model="twin-c")).step == base_step
    await client.optim_step(1e-3, model="twin-c")
    with pytest.raises(errors.NotFoundError) as missing:
        await client.forward_backward(runs=runs, model="no-such-slug")
    assert missing.value.reason == "MODEL_NOT_FOUND"
