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


def batch(seed: int, vocab_size: int) -> list[Datum]:
    rng = random.Random(seed)
    datums = []
    for length in (10, 14, 7):
        tokens = [rng.randrange(vocab_size) for _ in range(length + 1)]
        datums.append(
            Datum(
                tokens[:-1], tokens[1:], [-rng.uniform(4, 7) for _ in range(length)],
                [0.0] * 3 + [rng.uniform(-1, 1) for _ in range(length - 3)], [0.0] * length,
            )
        )
    return datums


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
    ids=["target-length", "logprob-length", "inf-advantage", "nan-logprob", "inf-weight", "input-vocab",
         "target-vocab", "empty"],
)
def test_datum_validation(datum: Datum, field: str, reason: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        datum.validate(vocab_size=384)
    assert (err.value.field, err.value.reason) == (field, reason)
