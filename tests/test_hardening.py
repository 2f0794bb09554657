"""The last untyped answers (issue 37, item 6): unknown enum values, huge labels, bodies past the limit, a full
disk. Each is refused where it enters, typed, and fails only itself. (Nesting past any bound is in the property
test of bad input, tests/test_bad_input.py, with every RPC and route.)"""

from __future__ import annotations

import errno

import aiohttp
import pytest
from test_training_safety import good_batch

from yieldloop import errors
from yieldloop.client import Client
from yieldloop.transport import MAX_MESSAGE_BYTES
from yieldloop.types import Promotion, Run, RunStatus, TaskRef


async def test_unknown_enum_values_are_invalid_arguments(client: Client) -> None:
    promotion = Promotion(state=99, reason="from the future")
    with pytest.raises(errors.InvalidArgumentError) as err:
        await client.record_promotion("tiny", "base", promotion)
    assert err.value.field == "promotion.state"
    run = Run(task=TaskRef(env="letters", scenario="repeat"), group_id="g", reward=1.0, status=RunStatus.GRADED)
    from yieldloop.convert import run_to_pb

    wire = run_to_pb(run)
    wire.status = 99
    with pytest.raises(errors.InvalidArgumentError) as err:
        await client.forward_backward(runs=[wire], model="tiny")
    assert err.value.field == "run.status" and "99" in err.value.message


async def test_labels_are_bounded(client: Client) -> None:
    with pytest.raises(errors.InvalidArgumentError) as err:
        await client.create_job("tiny", name="j" * (16 << 20))
    assert err.value.field == "name" and len(err.value.message) < 300
    with pytest.raises(errors.InvalidArgumentError):
        await client.create_job("tiny", name="two\nlines")
    assert (await client.create_job("tiny", name="a fine name")).name == "a fine name"


async def test_bodies_past_the_limit_answer_413_with_the_limit(stack, client: Client) -> None:
    info = await client.get_serving_info()
    body = b'{"model": "tiny", "prompt": "' + b"x" * (MAX_MESSAGE_BYTES + 1024) + b'"}'
    headers = {"Authorization": f"Bearer {stack.api_key}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession(headers=headers) as http:
        for url in (info.openai_base_url + "/completions", stack.hud_url + "/v1/models/tiny/train/forward-backward"):
            async with http.post(url, data=body) as response:
                answer = await response.json(content_type=None)
                assert response.status == 413, (url, answer)
                assert (
                    answer["error"]["code"] == "request_too_large"
                    and str(MAX_MESSAGE_BYTES) in answer["error"]["message"]
                )
        async with http.post(
            info.openai_base_url + "/completions",  # and the endpoint serves on
            json={"model": "tiny", "prompt": [1, 40, 41], "max_tokens": 2},
        ) as response:
            assert response.status == 200


async def test_a_full_disk_is_resource_exhausted_and_retryable(tmp_path, monkeypatch) -> None:
    """ENOSPC from the store's disk while forking, moving a head, creating a job, recording rollouts and making a
    step durable: RESOURCE_EXHAUSTED (NO_SPACE), nothing half-written; once space is freed the same calls work,
    and the step retried with its idempotency key is the step that was stalled (durable, acknowledged once)."""
    from yieldloop.envs.letters import tasks
    from yieldloop_server.config import EnvOptions, StackConfig
    from yieldloop_server.stack import InProcessStack
    from yieldloop_server.store import fs

    full = {"on": ""}  # "all": every write to the store fails; "objects": checkpoint objects only
    write_atomic, adopt_file = fs.FsStore._write_atomic, fs.FsStore.adopt_file

    def refuse(path) -> None:
        refused = full["on"] == "all" or (
            full["on"] == "objects" and "checkpoints" in path.parts and path.name != "manifest.json"
        )
        if refused and "store" in path.parts:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

    def guarded(self, path, write):
        refuse(path)
        return write_atomic(self, path, write)

    def guarded_adopt(self, key, path):  # a trainer's files are linked into the store, not written again
        refuse(self._path(key))
        return adopt_file(self, key, path)

    monkeypatch.setattr(fs.FsStore, "_write_atomic", guarded)
    monkeypatch.setattr(fs.FsStore, "adopt_file", guarded_adopt)
    stack = InProcessStack(StackConfig(data_dir=tmp_path, env=EnvOptions(workers=0)))
    await stack.start()
    try:
        async with Client(**stack.addresses, api_key=stack.api_key, timeout=60, retry_within_s=0) as client:
            await client.fork_model("tiny", "disk")
            await client.forward_backward(datums=good_batch(1), model="disk")
            full["on"] = "all"
            calls = {
                "ForkModel": lambda: client.fork_model("tiny", "disk-2"),
                "SetHead": lambda: client.set_head("disk", "base"),
                "CreateJob": lambda: client.create_job("tiny", name="full"),
                "StreamRollouts": lambda: _drain(client.stream_rollouts(tasks("a"), group_size=1)),
                "OptimStep": lambda: client.optim_step(1e-2, model="disk", idempotency_key="refused-step"),
            }
            for name, call in calls.items():
                with pytest.raises(errors.ResourceExhaustedError) as err:
                    await call()
                assert err.value.reason == "NO_SPACE", (name, err.value)
            assert [m.slug for m in (await client.list_models())].count("disk-2") == 0
            # The step's commit went through (HEAD moved, the fleet pulls from the trainer) but its objects cannot
            # be written: it answers NO_SPACE while its upload keeps trying.
            full["on"] = "objects"
            with pytest.raises(errors.ResourceExhaustedError) as err:
                await client.optim_step(1e-2, model="disk", idempotency_key="stalled-step")
            assert err.value.reason == "NO_SPACE"
            full["on"] = ""
            step = await client.optim_step(1e-2, model="disk", idempotency_key="stalled-step")
            assert step.durable and (await client.get_head("disk")).checkpoint_id == step.checkpoint.checkpoint_id
            assert [c.step for c in (await client.list_checkpoints("disk"))] == [0, 1]
            await client.fork_model("tiny", "disk-2")
            assert (await client.create_job("tiny", name="space again")).name == "space again"
    finally:
        await stack.stop()


async def _drain(stream) -> None:
    async for _ in stream:
        pass
