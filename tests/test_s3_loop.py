"""The closed loop with checkpoints in S3 (moto_server): commit, head, hot reload, fork, rollback, watch."""

from __future__ import annotations

import asyncio

import pytest_asyncio

from yieldloop.envs.letters import tasks
from yieldloop.loop import LoopConfig, closed_loop


@pytest_asyncio.fixture(scope="module")
async def s3_client(moto_endpoint, tmp_path_factory):
    from conftest import s3_stack

    async with s3_stack(moto_endpoint, tmp_path_factory.mktemp("s3-stack")) as (_, client, bucket):
        yield client, bucket


async def test_closed_loop_over_s3(s3_client) -> None:
    import boto3

    client, bucket = s3_client
    [report] = [r async for r in closed_loop(client, LoopConfig(steps=1, group_size=2), train_tasks=tasks("ab"))]
    assert report.served_weight_version == report.checkpoint_id
    # Served from the trainer directly; in S3 once its background upload ended (weights only: the training
    # state goes every tenth step; a file equal to the parent's, e.g. weights a step without signal left as they
    # were, is the parent's object).
    for _ in range(600):
        if not (manifest := await client.get_checkpoint("tiny", report.checkpoint_id)).pending:
            break
        await asyncio.sleep(0.05)
    keys = {o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=bucket)["Contents"]}
    prefix = f"yieldloop/models/tiny/checkpoints/{report.checkpoint_id}/"
    weights = next(o.key for o in manifest.objects if o.name == "model.safetensors")
    assert {prefix + "manifest.json", "yieldloop/" + weights} <= keys
    assert "yieldloop/models/tiny/HEAD" in keys

    # Rollback: HEAD back to the base, the rollout follows; fork shares the objects.
    head = await client.set_head("tiny", "base", expected_checkpoint_id=report.checkpoint_id)
    info = await client.get_serving_info(wait_for_checkpoint_id="base", timeout=60)
    assert info.weight_version == "base" and info.head_sequence == head.sequence
    forked = await client.fork_model("tiny", "tiny-fork")
    assert forked.head.checkpoint_id == "base"
    manifest = await client.get_checkpoint("tiny-fork", "base")
    assert all(o.key.startswith("models/tiny/") for o in manifest.objects)
    listed = await client.list_checkpoints("tiny")
    assert [c.checkpoint_id for c in listed] == ["base", report.checkpoint_id]
    assert [c.is_head for c in listed] == [True, False]

    # The rollback is a branch point: the trainer's next commit extends the tree from "base".
    runs = [run async for run in client.stream_rollouts(tasks("c"), group_size=2)]
    await client.forward_backward(runs=runs)
    step = await client.optim_step(1e-3)
    branched = await client.get_checkpoint("tiny", step.checkpoint.checkpoint_id)
    assert branched.parent_checkpoint_id == "base" and branched.step == 1
