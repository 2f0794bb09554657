"""The importance_sampling loss: value and gradient against an independent float64 reference."""

from __future__ import annotations

import asyncio
import pathlib
import random

import pytest
import torch

from yieldloop.client import Client
from yieldloop.groups import group_advantages, runs_to_datums
from yieldloop.proto.common.v1 import common_pb2 as common_pb
from yieldloop.types import Datum, Run, Turn
from yieldloop_server.common.hf import load_causal_lm
from yieldloop_server.trainer.trainer import Trainer


def random_datums(vocab_size: int, seed: int = 0) -> list[Datum]:
    """Sequences with a prompt part (A = 0) and an action part (A != 0), ratios spread around 1."""
    rng = random.Random(seed)
    datums = []
    for length, prompt_len in ((12, 5), (20, 3), (7, 6)):
        tokens = [rng.randrange(vocab_size) for _ in range(length + 1)]
        advantages = [0.0] * prompt_len + [rng.uniform(-1.5, 1.5) for _ in range(length - prompt_len)]
        datums.append(
            Datum(
                input_tokens=tokens[:-1],
                target_tokens=tokens[1:],
                sampling_logprobs=[-rng.uniform(3.0, 8.0) for _ in range(length)],
                advantages=advantages,
                weights=[0.0] * prompt_len + [rng.uniform(0.5, 1.5) for _ in range(length - prompt_len)],
            )
        )
    return datums


def reference_loss(model: torch.nn.Module, datums: list[Datum], name: str = "importance_sampling") -> torch.Tensor:
    """LOSSES.md with default knobs, float64, one datum at a time, written independently of the trainer."""
    total = torch.zeros((), dtype=torch.float64)
    for d in datums:
        logits = model(input_ids=torch.tensor([d.input_tokens])).logits[0].to(torch.float64)
        lp = torch.log_softmax(logits, dim=-1)[torch.arange(len(d.target_tokens)), torch.tensor(d.target_tokens)]
        q = torch.tensor(d.sampling_logprobs, dtype=torch.float64)
        A = torch.tensor(d.advantages, dtype=torch.float64)
        w = torch.tensor(d.weights, dtype=torch.float64)
        r = torch.exp(lp - q)
        if name == "importance_sampling":
            total = total - (r * A).sum()
        elif name == "cross_entropy":
            total = total - (lp * w).sum()
        elif name == "ppo":
            total = total - torch.where(r * A < r.clamp(0.8, 1.2) * A, r * A, r.clamp(0.8, 1.2) * A).sum()
        elif name == "cispo":
            total = total - (r.clamp(0.0, 4.0).detach() * lp * A).sum()
        elif name == "dro":
            total = total - (lp * A - 0.5 * 0.05 * (lp - q) ** 2 * (A != 0)).sum()
    return total


@pytest.mark.parametrize("loss", ["importance_sampling", "cross_entropy", "ppo", "cispo", "dro"])
def test_loss_value_and_gradient_through_the_model(tiny_model_dir: pathlib.Path, loss: str) -> None:
    trainer = Trainer(tiny_model_dir)
    datums = random_datums(trainer.vocab_size)
    metrics = trainer.forward_backward(datums, loss, {})

    reference, _ = load_causal_lm(tiny_model_dir, "float64", "cpu")
    expected = reference_loss(reference, datums, loss)
    expected.backward()

    torch.testing.assert_close(
        torch.tensor(metrics["loss_sum"], dtype=torch.float64), expected.detach(), rtol=1e-5, atol=1e-6
    )
    ours = dict(trainer.model.named_parameters())
    checked = 0
    for name, param in reference.named_parameters():
        assert ours[name].grad is not None, name
        # fp32 learner against the fp64 oracle: relative 1e-4, and for near-zero entries 1e-5 of the
        # tensor's largest gradient (fp32 round-off scales with the magnitudes summed).
        scale = float(param.grad.abs().max())
        torch.testing.assert_close(ours[name].grad.to(torch.float64), param.grad, rtol=1e-4, atol=1e-5 * scale + 1e-9)
        checked += 1
    assert checked > 10
    counted = (
        (lambda d: sum(1 for w in d.weights if w))
        if loss == "cross_entropy"
        else (lambda d: sum(1 for a in d.advantages if a))
    )
    assert metrics["num_action_tokens"] == sum(counted(d) for d in datums)


def test_micro_batching_does_not_change_the_gradient(tiny_model_dir: pathlib.Path) -> None:
    from yieldloop_server.trainer.trainer import TrainerConfig

    whole, split = Trainer(tiny_model_dir), Trainer(tiny_model_dir, TrainerConfig(micro_batch_tokens=16))
    datums = random_datums(whole.vocab_size, seed=1)
    a = whole.forward_backward(datums, "importance_sampling", {})
    b = split.forward_backward(datums, "importance_sampling", {})
    assert a["loss_sum"] == pytest.approx(b["loss_sum"], rel=1e-5)
    for (name, p), (_, q) in zip(whole.model.named_parameters(), split.model.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("packed", [False, True])
def test_only_action_tokens_are_computed(
    tiny_model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch, packed: bool
) -> None:
    """Every loss and its gradient are 0 off action tokens: a datum without one is not run through the model,
    and the output layer sees each datum's positions from the micro-batch's first action token on. The loss and
    gradient are those of the whole sequences' logits (no output-layer hook: every position, picked after)."""
    from yieldloop_server.trainer.trainer import TrainerConfig

    trainer = Trainer(tiny_model_dir, TrainerConfig(packed=packed))
    datums = random_datums(trainer.vocab_size, seed=2)  # 12, 20 and 7 tokens; actions from 5, 3 and 6
    idle = Datum(
        input_tokens=datums[0].input_tokens,
        target_tokens=datums[0].target_tokens,
        sampling_logprobs=datums[0].sampling_logprobs,
        advantages=[0.0] * 12,
        weights=[1.0] * 12,
    )
    batches: list[torch.Size] = []
    rows: list[int] = []
    trainer.model.register_forward_pre_hook(
        lambda _m, _a, kwargs: batches.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    trainer.model.lm_head.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[:-1].numel()))
    metrics = trainer.forward_backward([idle, *datums], "importance_sampling", {})
    # the idle datum left out; the output layer sees positions 3.. of each datum (9 + 17 + 4), nothing else
    assert rows == [(12 - 3) + (20 - 3) + (7 - 3)]
    if packed:  # rows as wide as the longest datum: 20, then 12 + 7
        assert batches == [torch.Size([2, 20])]
    else:
        assert batches == [torch.Size([3, 20])]

    whole = Trainer(tiny_model_dir, TrainerConfig(packed=packed))
    whole._kept.hooked = False  # every position's logits, then picked
    expected = whole.forward_backward(datums, "importance_sampling", {})
    assert metrics["loss_sum"] == pytest.approx(expected["loss_sum"], rel=1e-5)
    assert metrics["num_action_tokens"] == expected["num_action_tokens"]
    for (name, p), (_, q) in zip(trainer.model.named_parameters(), whole.model.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("chunk_rows", [1, 5, 1000])
def test_target_logprobs_chunk_by_chunk_match_log_softmax(monkeypatch: pytest.MonkeyPatch, chunk_rows: int) -> None:
    """The trainer's logprob/entropy function (fp32 chunks, softmax recomputed in backward) against a plain
    float64 log_softmax: values, entropies and the gradient of the logits, whatever the chunking."""
    from yieldloop_server.trainer import trainer as trainer_module

    monkeypatch.setattr(trainer_module, "_chunk_rows", lambda vocab_size: chunk_rows)
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(23, 50, generator=generator, dtype=torch.float64) * 4).requires_grad_()
    targets = torch.randint(0, 50, (23,), generator=generator)
    weights = torch.randn(23, generator=generator, dtype=torch.float64)

    logprobs, entropy = trainer_module.target_logprobs().apply(logits, targets, True)
    (logprobs * weights).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    log_softmax = torch.log_softmax(logits, dim=-1)
    expected = log_softmax[torch.arange(23), targets]
    (expected * weights).sum().backward()

    torch.testing.assert_close(logprobs, expected.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy, -(log_softmax.exp() * log_softmax).sum(-1).detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(ours, logits.grad, rtol=0, atol=1e-12)
    assert not entropy.requires_grad
    with torch.no_grad():
        values, none = trainer_module.target_logprobs().apply(logits, targets, False)
    assert none is None and torch.equal(values, logprobs.detach())


def test_grpo_advantages_and_groups_without_signal() -> None:
    assert group_advantages([1.0, 0.0, 0.5], normalize_by_std=False) == pytest.approx([0.5, -0.5, 0.0])
    normed = group_advantages([1.0, 0.0], normalize_by_std=True)
    assert normed == pytest.approx([1.0, -1.0], abs=1e-5)

    def run(group: str, reward: float) -> Run:
        return Run(group_id=group, reward=reward, turns=[Turn([1, 2, 3], [4, 5], [-1.0, -2.0])])

    runs = [run("g1", 1.0), run("g1", 0.0), run("g2", 0.5), run("g2", 0.5)]
    datums, stats = runs_to_datums(runs)
    assert (stats.num_groups, stats.num_groups_without_signal, len(datums)) == (2, 1, 4)
    # Prompt positions carry no advantage; the two completion tokens carry the run's.
    assert datums[0].input_tokens == [1, 2, 3, 4] and datums[0].target_tokens == [2, 3, 4, 5]
    assert datums[0].advantages == [0.0, 0.0, 0.5, 0.5]
    assert datums[1].advantages == [0.0, 0.0, -0.5, -0.5]
    assert datums[0].sampling_logprobs == [0.0, 0.0, -1.0, -2.0]
    dropped, stats = runs_to_datums(runs, drop_groups_without_signal=True)
    assert len(dropped) == 2 and stats.num_groups_without_signal == 1


def test_multi_turn_runs_must_extend_the_previous_turn() -> None:
    from yieldloop.errors import InvalidArgumentError
    from yieldloop.groups import run_to_datum

    good = Run(group_id="g", reward=1.0, turns=[Turn([1, 2], [3], [-0.1]), Turn([1, 2, 3, 9, 9], [4, 5], [-0.2, -0.3])])
    datum = run_to_datum(good, 1.0, "run")
    assert datum.target_tokens == [2, 3, 9, 9, 4, 5]
    assert datum.advantages == [0.0, 1.0, 0.0, 0.0, 1.0, 1.0]  # tool-output tokens 9, 9 are not actions
    drifted = Run(group_id="g", reward=1.0, turns=[Turn([1, 2], [3], [-0.1]), Turn([1, 2, 7], [4], [-0.2])])
    with pytest.raises(InvalidArgumentError) as err:
        run_to_datum(drifted, 1.0, "run")
    assert err.value.reason == "DATUM_INVALID"


async def test_service_loss_equals_reference(client: Client, stack, tiny_model_dir: pathlib.Path) -> None:
    """Through the service: ForwardBackward's loss:sum equals the float64 formula on the served weights."""
    info = await client.get_serving_info()
    folder = stack.config.data_dir / "work" / "rollout" / "tiny" / info.weight_version
    reference, _ = await asyncio.to_thread(load_causal_lm, folder, "float64", "cpu")
    datums = random_datums(reference.config.vocab_size, seed=2)
    result = await client.forward_backward(
        datums=[common_pb.Datum(**vars(d)) for d in datums], loss_fn="importance_sampling"
    )
    with torch.no_grad():
        expected = float(reference_loss(reference, datums))
    assert result.loss_sum == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert result.num_datums == 3
    # Apply the step so the session's trainer and rollout stay on the same weights.
    step = await client.optim_step(1e-4, set_head=True)
    await client.get_serving_info(wait_for_checkpoint_id=step.checkpoint.checkpoint_id, timeout=60)


def test_concurrent_loads_do_not_interfere(tiny_model_dir: pathlib.Path) -> None:
    """The trainer, the engine and hot reloads load models from several threads of one process."""
    from concurrent.futures import ThreadPoolExecutor

    dtypes = ["float32", "float64"] * 4
    with ThreadPoolExecutor(len(dtypes)) as pool:
        models = list(pool.map(lambda d: load_causal_lm(tiny_model_dir, d, "cpu")[0], dtypes))
    for dtype, model in zip(dtypes, models, strict=True):
        for param in model.parameters():
            assert param.device.type == "cpu" and param.dtype == getattr(torch, dtype)
            assert torch.isfinite(param).all()
