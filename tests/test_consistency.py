"""Sampler/trainer consistency: the logprobs RolloutService streams equal TrainerService's (fp32, 1e-4)."""

from __future__ import annotations

from yieldloop.client import Client, sampling_params
from yieldloop.envs.letters import tasks
from yieldloop.proto.common.v1 import common_pb2 as common_pb

TOLERANCE = 1e-4


async def test_generate_logprobs_match_trainer_forward(client: Client) -> None:
    info = await client.get_serving_info()
    trainer = await client.get_trainer_info()
    assert info.weight_version == trainer.checkpoint_id, "both must hold the same weights"
    prompt = [1, 40, 41, 42, 43, 44]
    # The stack's base model is warmed up and ends its answers within a few tokens; with ignore_eos every
    # completion runs its whole budget, so the comparison covers 3 x 24 sampled tokens.
    ended = [
        await client.generate(prompt, sampling=sampling_params(max_tokens=24, temperature=1.0, seed=seed))
        for seed in (1, 2, 3)
    ]
    assert any(c.stop_reason == common_pb.STOP_REASON_EOS for c in ended), "the model ends answers by itself"
    completions = [
        await client.generate(
            prompt, sampling=sampling_params(max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True)
        )
        for seed in (1, 2, 3)
    ]
    for short, full in zip(ended, completions, strict=True):
        assert len(full.token_ids) == 24 and full.stop_reason == common_pb.STOP_REASON_LENGTH
        assert full.token_ids[: len(short.token_ids)] == short.token_ids, "same seed, same tokens up to its end"
    datums = [
        common_pb.Datum(
            input_tokens=(prompt + c.token_ids)[:-1],
            target_tokens=(prompt + c.token_ids)[1:],
        )
        for c in completions
    ]
    learner = await client.forward(datums=datums)
    worst = 0.0
    for completion, logprobs in zip(completions, learner, strict=True):
        completion_part = logprobs[len(prompt) - 1 :]
        assert len(completion_part) == len(completion.logprobs)
        worst = max(worst, max(abs(a - b) for a, b in zip(completion_part, completion.logprobs, strict=True)))
    assert worst < TOLERANCE, worst


async def test_rollout_runs_match_trainer_forward(client: Client) -> None:
    runs = [run async for run in client.stream_rollouts(tasks("ab"), group_size=4)]
    learner = await client.forward(runs=runs)
    for run, logprobs in zip(runs, learner, strict=True):
        turn = run.turns[0]
        completion_part = logprobs[len(turn.prompt_token_ids) - 1 :]
        assert max(abs(a - b) for a, b in zip(completion_part, turn.completion_logprobs, strict=True)) < TOLERANCE
