"""Packed micro-batches (datums concatenated in one row, position ids restarting per datum, attention kept
within each datum) against the padded layout: the same logprobs, losses and gradients on ragged batches."""

from __future__ import annotations

import pathlib
import random

import pytest
import torch

from yieldloop.types import Datum
from yieldloop_server.trainer.trainer import Trainer, TrainerConfig, computed_tokens, micro_batches


def ragged_datums(vocab_size: int, lengths: list[int], seed: int = 0) -> list[Datum]:
    """Datums of the given lengths, actions from a random position on, ratios spread around 1."""
    rng = random.Random(seed)
    datums = []
    for length in lengths:
        prompt = rng.randrange(1, length)
        tokens = [rng.randrange(vocab_size) for _ in range(length + 1)]
        datums.append(
            Datum(
                input_tokens=tokens[:-1],
                target_tokens=tokens[1:],
                sampling_logprobs=[-rng.uniform(3.0, 8.0) for _ in range(length)],
                advantages=[0.0] * prompt + [rng.uniform(-1.5, 1.5) for _ in range(length - prompt)],
                weights=[0.0] * prompt + [rng.uniform(0.5, 1.5) for _ in range(length - prompt)],
            )
        )
    return datums


LENGTHS = [3, 41, 7, 19, 2, 30, 11, 5]
"""A long-tailed mix: padding would compute 8 x 41 positions for 118 real ones."""


@pytest.mark.parametrize("loss", ["importance_sampling", "cross_entropy", "ppo", "cispo", "dro"])
@pytest.mark.parametrize("budget", [64, 4096])
def test_packed_equals_padded(tiny_model_dir: pathlib.Path, loss: str, budget: int) -> None:
    padded = Trainer(tiny_model_dir, TrainerConfig(dtype="float64", packed=False, micro_batch_tokens=budget))
    packed = Trainer(tiny_model_dir, TrainerConfig(dtype="float64", packed=True, micro_batch_tokens=budget))
    datums = ragged_datums(padded.vocab_size, LENGTHS)

    for a, b in zip(padded.logprobs(datums), packed.logprobs(datums), strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-10)
    ours, theirs = packed.forward_backward(datums, loss, {}), padded.forward_backward(datums, loss, {})
    for key in ("loss_sum", "num_action_tokens", "mean_ratio", "kl_sampler_learner", "entropy", "clip_fraction"):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-10, abs=1e-12), key
    for (name, p), (_, q) in zip(packed.model.named_parameters(), padded.model.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=name)
    assert ours["tokens_useful"] == theirs["tokens_useful"] == sum(LENGTHS)
    assert sum(LENGTHS) <= ours["tokens_computed"] < theirs["tokens_computed"]


def test_micro_batches_fill_rows_first_fit_decreasing() -> None:
    """Packed: longest first, each micro-batch as wide as its longest datum, rows filled first-fit, within the
    budget; padded: consecutive datums one per row. Every datum exactly once either way."""
    lengths = [3, 41, 7, 19, 2, 30, 11, 5]
    packed = micro_batches(lengths, 100, packed=True)
    # 41 | 30 (+ nothing else fits 41 wide in 100); then 19 wide: 19 | 11 + 7 | 5 + 3 + 2
    assert packed == [[[1], [5]], [[3], [6, 2], [7, 0, 4]]]
    for batch in packed:
        width = max(sum(lengths[i] for i in row) for row in batch)
        assert width == lengths[batch[0][0]] and computed_tokens(batch, lengths) <= 100
    assert sorted(i for batch in packed for row in batch for i in row) == list(range(len(lengths)))
    assert sum(computed_tokens(b, lengths) for b in packed) < sum(
        computed_tokens(b, lengths) for b in micro_batches(lengths, 100, packed=False)
    )
    assert micro_batches(lengths, 100, packed=False) == [[[0], [1]], [[2], [3], [4]], [[5], [6], [7]]]
    assert micro_batches([50, 200], 100, packed=True) == [[[1]], [[0]]]  # over the budget: alone


def test_rows_and_positions_reach_the_model(tiny_model_dir: pathlib.Path) -> None:
    """Packed, the model sees rows holding several datums, the position ids restarting at 0 at each datum, and
    the output layer only the action positions."""
    trainer = Trainer(tiny_model_dir, TrainerConfig(micro_batch_tokens=48))
    datums = ragged_datums(trainer.vocab_size, LENGTHS, seed=3)
    seen: list[tuple[torch.Size, list[list[int]]]] = []
    trainer.model.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append((kw["input_ids"].shape, kw["position_ids"].tolist())), with_kwargs=True
    )
    trainer.forward_backward(datums, "cross_entropy", {})
    lengths = [len(d.input_tokens) for d in datums]
    batches = micro_batches(lengths, 48, packed=True)
    assert [shape for shape, _ in seen] == [
        torch.Size([len(b), max(sum(lengths[i] for i in row) for row in b)]) for b in batches
    ]
    assert sum(row.count(0) for _, rows in seen for row in rows) == len(datums)  # each datum once, from 0
    assert any(row.count(0) > 1 for _, rows in seen for row in rows)  # some row holds several
