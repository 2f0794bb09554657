"""The product API over the real services: Job / taskset.run / TrainingClient, the closed loop's
promotion gate and checkpoint tree, rollback, and export that reloads token for token."""

from __future__ import annotations

import json
import logging
import math
import pathlib

import pytest

from yieldloop import errors
from yieldloop.client import Client, sampling_params
from yieldloop.envs.letters import TASKS, heldout_tasks, tasks, train_tasks
from yieldloop.export import export_runs, read_export
from yieldloop.groups import stitch_turns
from yieldloop.loop import Baseline, LoopConfig, closed_loop
from yieldloop.proto.checkpoint.v1 import checkpoint_service_pb2 as ckpt_pb
from yieldloop.taskset import Taskset
from yieldloop.training import Job, TrainingClient, create_agent
from yieldloop.types import Run, RunStatus

MODEL = "tiny"


async def at_base(client: Client) -> None:
    await client.set_head(MODEL, "base")
    await client.get_serving_info(wait_for_checkpoint_id="base", timeout=60)


async def test_job_taskset_run_and_training_client(client: Client, caplog: pytest.LogCaptureFixture) -> None:
    await at_base(client)
    agent = create_agent(MODEL, max_tokens=10)
    job = await Job.start(MODEL, group=4, name="api-test", client=client)
    batch = await Taskset(tasks("abc")).run(agent, job=job, max_concurrent=6)
    assert len(batch) == len(job.runs) == 12
    assert {run.group_id for run in batch} and all(
        len({r.group_id for r in batch if r.task == run.task}) == 1 for run in batch
    )
    run = batch[0]
    assert run.prompt and run.trace_id and run.turns[0].completion_token_ids and run.turns[0].completion_logprobs

    trainer = TrainingClient(MODEL, client=client)
    assert set(await trainer.available_losses()) >= {"importance_sampling", "ppo", "cispo", "dro", "cross_entropy"}
    # Runs and trace ids interchangeably; a group without reward spread is reported before training.
    mixed = [*batch[:4], *[r.trace_id for r in batch[4:8]], *batch[8:]]
    caplog.set_level(logging.WARNING, logger="yieldloop")
    same = [Run(group_id="g-flat", reward=0.5, status=RunStatus.GRADED, turns=r.turns, task=r.task) for r in batch[:2]]
    value, _ = await trainer.forward_backward_custom(  # trace ids work for custom losses too
        [r.trace_id for r in batch if r.group_id == batch[0].group_id],
        lambda datums, logprobs: sum(lp.sum() for lp in logprobs) * 0.0,
        group_size=4,
    )
    assert value == 0.0
    with pytest.raises(errors.InvalidArgumentError):
        await trainer.forward_backward_custom(batch[:3], lambda datums, logprobs: logprobs[0].sum(), group_size=4)
    result = await trainer.step([*mixed, *same], learning_rate=1e-3, group_size=0)
    assert "without reward spread" in caplog.text and "teach nothing" in caplog.text
    assert result.groups_without_spread >= 1 and result.step >= 1
    assert {"kl_sampler_learner", "clip_fraction", "entropy"} <= set(result.metrics)
    head = await trainer.head()
    assert head.checkpoint_id == result.checkpoint_id
    assert [c.checkpoint_id for c in await trainer.checkpoints() if c.is_head] == [result.checkpoint_id]
    rolled = await trainer.set_head("base", expected=result.checkpoint_id)
    assert rolled.checkpoint_id == "base"
    info = await client.get_serving_info(wait_for_checkpoint_id="base", timeout=60)
    assert info.weight_version == "base"

    with pytest.raises(errors.NotFoundError) as err:
        await TrainingClient("no-such-model", client=client).step(batch, learning_rate=1e-3)
    assert err.value.reason == "MODEL_NOT_FOUND"
    with pytest.raises(errors.InvalidArgumentError):
        await Job.start(MODEL, group=0, client=client)

    # A job reads back with every run, in order.
    loaded = await Job.load(job.id, client=client)
    assert [r.trace_id for r in loaded.runs] == [r.trace_id for r in job.runs]
    assert loaded.group == 4 and loaded.model == MODEL


async def test_the_readme_loop_samples_each_batch_with_the_weights_of_the_last_step(client: Client) -> None:
    """``taskset.run`` -> ``trainer.step``, as in the README: step() returns once the new weights serve, so
    every run of the next batch is on-policy; the step reports where its time went."""
    await at_base(client)
    agent = create_agent(MODEL, max_tokens=8)
    job = await Job.start(MODEL, group=4, name="on-policy", client=client)
    trainer = TrainingClient(MODEL, client=client)
    previous = "base"
    for _ in range(3):
        batch = await Taskset(tasks("abcd")).run(agent, job=job, max_concurrent=16)
        assert {turn.weight_version for run in batch for turn in run.turns} == {previous}
        result = await trainer.step(batch, learning_rate=1e-3, group_size=4)
        assert result.parent_checkpoint_id == previous and result.off_policy_runs == 0
        assert {"forward_backward_s", "optim_step_s", "optimizer_s", "save_s", "commit_s", "weights_served_s"} <= set(
            result.timings
        )
        assert all(value >= 0 for value in result.timings.values())
        previous = result.checkpoint_id
    # Not waiting is allowed, and then said: the batch after it counts what older weights sampled.
    stale = await Taskset(tasks("ab")).run(agent, job=job, max_concurrent=16)
    unwaited = await trainer.step(stale, learning_rate=1e-3, group_size=4, wait_for_serving=False)
    assert "weights_served_s" not in unwaited.timings and unwaited.off_policy_runs == 0
    old = [Run(group_id=r.group_id, reward=r.reward, status=r.status, turns=r.turns, task=r.task) for r in stale]
    result = await trainer.step(old, learning_rate=1e-3, group_size=4)
    assert result.parent_checkpoint_id == unwaited.checkpoint_id and result.off_policy_runs == len(old)
    await at_base(client)


async def test_export_reloads_token_for_token(client: Client, tmp_path: pathlib.Path) -> None:
    job = await Job.start(MODEL, group=2, client=client)
    runs = await Taskset(tasks("xyz")).run(create_agent(max_tokens=6), job=job)
    for fmt, kind in [("jsonl", "tokens"), ("parquet", "tokens"), ("jsonl", "rft"), ("parquet", "rft")]:
        path = tmp_path / f"out.{kind}.{fmt}"
        assert export_runs(runs, path, fmt, kind) == 6
        rows = {row["trace_id"]: row for row in read_export(path)}
        assert set(rows) == {run.trace_id for run in runs}
        for run in runs:
            row = rows[run.trace_id]
            assert row["reward"] == run.reward and row["group_id"] == run.group_id
            if kind == "rft":
                assert row["prompt"] == run.prompt and row["completion"] == run.turns[0].completion_text
                continue
            tokens, logprobs, is_action = stitch_turns(run.turns)
            turn = run.turns[0]
            assert row["token_ids"] == tokens == [*turn.prompt_token_ids, *turn.completion_token_ids]
            assert row["mask"] == [int(a) for a in is_action]
            sampled = [lp for lp, m in zip(row["logprobs"], row["mask"], strict=True) if m]
            assert sampled == [float(lp) for lp in turn.completion_logprobs], "float32 logprobs survive exactly"
            assert row["weight_versions"] == [turn.weight_version]
    with pytest.raises(errors.InvalidArgumentError):
        export_runs(runs, tmp_path / "x.csv", "csv")


async def test_closed_loop_gate_tree_and_rollback(client: Client, tmp_path: pathlib.Path) -> None:
    await at_base(client)
    baseline: list[Baseline] = []
    config = LoopConfig(**TASKS, steps=2, group_size=4, tasks_per_step=8)
    reports = [r async for r in closed_loop(client, config, runs_dir=tmp_path, baseline=baseline)]
    assert baseline[0].checkpoint_id == "base" and baseline[0].heldout_reward <= 0.3
    good = tmp_path / reports[0].job_id
    recorded = [json.loads(line) for line in (good / "steps.jsonl").read_text().splitlines()]
    assert recorded[0]["checkpoint_id"] == "base" and [row["checkpoint_id"] for row in recorded[1:]] == [
        r.checkpoint_id for r in reports
    ]
    assert len(reports) == 2
    for report in reports:  # reward recorded per step
        assert report.num_runs == 32 and math.isfinite(report.train_reward) and math.isfinite(report.heldout_reward)
        assert report.rollout_s > 0 and report.heldout_s > 0 and math.isfinite(report.kl)
    # The checkpoints form a tree: each candidate's parent is the head it was trained from.
    assert reports[0].parent_checkpoint_id == "base"
    assert reports[1].parent_checkpoint_id == reports[0].head_checkpoint_id
    for report in reports:
        manifest = await client.get_checkpoint(MODEL, report.checkpoint_id)
        assert manifest.parent_checkpoint_id == report.parent_checkpoint_id
    decided = {c.checkpoint_id: c.promotion for c in (await client.list_checkpoints(MODEL))}
    for report in reports:
        state = ckpt_pb.PROMOTION_STATE_PROMOTED if report.promoted else ckpt_pb.PROMOTION_STATE_REJECTED
        assert decided[report.checkpoint_id].state == state and decided[report.checkpoint_id].reason == report.reason

    # A deliberately worse checkpoint (a learning rate that wrecks the weights) is not promoted.
    head = await client.get_head(MODEL)
    wrecking = LoopConfig(**TASKS, steps=1, group_size=4, tasks_per_step=4, learning_rate=0.5)
    [bad] = [r async for r in closed_loop(client, wrecking, runs_dir=tmp_path)]
    assert not bad.promoted, bad
    assert bad.heldout_reward < bad.head_heldout_reward - wrecking.promotion_tolerance
    assert "<" in bad.reason and bad.head_checkpoint_id == head.checkpoint_id
    assert (await client.get_head(MODEL)).checkpoint_id == head.checkpoint_id
    assert (await client.get_serving_info()).weight_version == head.checkpoint_id, "the fleet never served it"
    listed = {c.checkpoint_id: c for c in (await client.list_checkpoints(MODEL))}
    kept = listed[bad.checkpoint_id]
    assert not kept.is_head and kept.promotion.state == ckpt_pb.PROMOTION_STATE_REJECTED
    assert kept.promotion.reason == bad.reason and kept.promotion.baseline_checkpoint_id == head.checkpoint_id
    # It can still be evaluated explicitly (pinned), without moving HEAD.
    job = await Job.start(MODEL, group=1, client=client)
    pinned = await Taskset(heldout_tasks()[:2]).run(
        create_agent(max_tokens=4), job=job, checkpoint_id=bad.checkpoint_id
    )
    assert {r.turns[0].weight_version for r in pinned} == {bad.checkpoint_id}
    with pytest.raises(errors.NotFoundError) as err:
        await Taskset(train_tasks()[:1]).run(create_agent(), job=job, checkpoint_id="step-000000-missing")
    assert err.value.reason == "CHECKPOINT_NOT_FOUND"

    # The next step trains from HEAD again, not from the rejected candidate.
    step, _ = await client.train_step(
        [r async for r in client.stream_rollouts(tasks("ab"), group_size=2)], 1e-4, set_head=False
    )
    manifest = await client.get_checkpoint(MODEL, step.checkpoint.checkpoint_id)
    assert manifest.parent_checkpoint_id == head.checkpoint_id

    # Rollback: set_head to the base; the rollout service serves the rolled-back weights.
    await client.set_head(MODEL, "base", expected_checkpoint_id=head.checkpoint_id)
    info = await client.get_serving_info(wait_for_checkpoint_id="base", timeout=60)
    assert info.weight_version == "base"
    completion = await client.generate([1, 2, 3], sampling=sampling_params(max_tokens=3))
    assert completion.weight_version == "base"

    # The report of the good run.
    from yieldloop.report import write_report

    png, page = write_report(good)
    assert png.read_bytes()[:4] == b"\x89PNG" and reports[-1].checkpoint_id in page.read_text()


def test_loop_config_errors(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "c.json"
    path.write_text('{"train_tasks": "tasks.py", "steps": 3, "learning_rate": 1}')
    assert LoopConfig.from_file(path).learning_rate == 1.0
    assert LoopConfig.from_file(path).heldout_tasks == ""  # no hidden held-out default: no gate unless named
    for text in ["[1]", '{"steps": true}', '{"nope": 1}', '{"train_tasks": "t.py", "group_size": 0}', "{", "{}"]:
        path.write_text(text)
        with pytest.raises(errors.InvalidArgumentError) as err:
            LoopConfig.from_file(path)
        assert err.value.reason == "BAD_CONFIG"
