"""Weights in flight: a step's weights reach the fleet from the trainer directly, the store write runs behind.

An optimizer step commits its checkpoint *pending* (the head moves at once); rollout services pull the sampler
weights from the trainer (the files in place on the same host, a chunked stream from another host), verified
against the sha256 the trainer computed, while the objects are written to the store; the step answers once the
checkpoint is durable.
Unchanged files are shared with the parent, the training state is written every ``state_every`` steps and when
a session closes, and a checkpoint without one resumes with its nearest ancestor's optimizer moments.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib

import pytest
import pytest_asyncio
from test_training_safety import fingerprint, good_batch

from yieldloop import errors
from yieldloop.client import Client, sampling_params
from yieldloop.transport import TransportConfig
from yieldloop_server.config import EnvOptions, StackConfig, TrainerOptions
from yieldloop_server.stack import InProcessStack

pytestmark = pytest.mark.asyncio(loop_scope="module")


class HoldDurability:
    """Holds every CheckpointService commit after the first while ``held``: a step's pending commit goes
    through, the commit that makes it durable waits."""

    def __init__(self) -> None:
        self.held = False
        self.release = asyncio.Event()
        self.commits = 0

    @contextlib.asynccontextmanager
    async def intercept(self, call):
        if call.method.endswith("/CommitCheckpoint") and self.held:
            self.commits += 1
            if self.commits > 1:
                await self.release.wait()
        yield


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def synced(tmp_path_factory):
    hold = HoldDurability()
    data_dir = tmp_path_factory.mktemp("sync")
    config = StackConfig(
        data_dir=data_dir,
        env=EnvOptions(workers=0),
        trainer=TrainerOptions(state_every=2),
        transport=TransportConfig(server_interceptors=(hold,)),
    )
    stack = InProcessStack(config)
    await stack.start()
    try:
        async with Client(**stack.addresses, api_key=stack.api_key, timeout=120) as client:
            yield client, hold, data_dir
    finally:
        await stack.stop()


async def durable(client: Client, model: str, checkpoint_id: str):
    for _ in range(400):
        if not (manifest := await client.get_checkpoint(model, checkpoint_id)).pending:
            return manifest
        await asyncio.sleep(0.05)
    raise AssertionError(f"{checkpoint_id} never became durable")


def stored(data_dir: pathlib.Path, model: str, checkpoint_id: str) -> set[str]:
    folder = data_dir / "store" / "models" / model / "checkpoints" / checkpoint_id
    return {p.name for p in folder.iterdir()} - {"manifest.json"} if folder.is_dir() else set()


async def test_the_fleet_serves_a_step_before_the_store_has_it(synced) -> None:
    client, hold, data_dir = synced
    await client.fork_model("tiny", "sync")
    await client.forward_backward(datums=good_batch(1), model="sync")
    before = await client.get_head("sync")
    hold.held, hold.commits = True, 0
    stepping = asyncio.create_task(client.optim_step(1e-2, model="sync"))
    while (head := await client.get_head("sync")) == before:  # the head moves at once (committed pending)
        await asyncio.sleep(0.02)
    checkpoint_id = head.checkpoint_id
    manifest = await client.get_checkpoint("sync", checkpoint_id)
    assert manifest.pending and manifest.weights_source
    # Served (pulled from the trainer, verified) while the checkpoint is still pending.
    info = await client.get_serving_info(wait_for_checkpoint_id=checkpoint_id, model="sync")
    assert info.weight_version == checkpoint_id and not info.last_reload_error
    completion = await client.generate([1, 2, 3], sampling=sampling_params(max_tokens=2), model="sync")
    assert completion.weight_version == checkpoint_id
    assert (await client.get_checkpoint("sync", checkpoint_id)).pending
    with pytest.raises(errors.FailedPreconditionError) as err:  # nothing is built on a pending checkpoint
        await client.fork_model(f"sync@{checkpoint_id}", "sync-fork")
    assert err.value.reason == "CHECKPOINT_PENDING"
    assert not stepping.done(), "the step answers only once its checkpoint is durable"
    hold.held = False
    hold.release.set()
    step = await stepping
    assert step.durable and not step.has_state and step.head_sequence == head.sequence
    assert step.checkpoint.checkpoint_id == checkpoint_id and "upload_s" in step.timings
    manifest = await client.get_checkpoint("sync", checkpoint_id)
    assert not manifest.pending and not manifest.weights_source
    # No training state on this step (state_every=2), and the rollout never fetched any.
    assert not manifest.has_state and "optimizer.pt" not in stored(data_dir, "sync", checkpoint_id)
    cached = data_dir / "work" / "rollout" / "sync" / checkpoint_id
    assert cached.is_dir() and "optimizer.pt" not in {p.name for p in cached.iterdir()}
    # The second step holds the training state.
    await client.forward_backward(datums=good_batch(2), model="sync")
    second = await client.optim_step(1e-2, model="sync", wait_durable=True)
    assert second.durable and second.has_state and "upload_s" in second.timings
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= stored(
        data_dir, "sync", second.checkpoint.checkpoint_id
    )


async def test_pull_weights_in_place_or_streamed(synced, monkeypatch) -> None:
    from yieldloop_server.weights import sink as weights
    from yieldloop_server.weights import source as trainer_servicer
    from yieldloop_server.weights.files import host_id

    client, _, data_dir = synced
    await client.forward_backward(datums=good_batch(3), model="sync")
    step = await client.optim_step(1e-2, model="sync")
    checkpoint_id = step.checkpoint.checkpoint_id
    manifest = await client.get_checkpoint("sync", checkpoint_id)
    local = [m async for m in client.pull_weights("sync", checkpoint_id, host_id())]
    assert len(local) == 1 and pathlib.Path(local[0].local_folder).is_dir()
    monkeypatch.setattr(trainer_servicer, "PULL_CHUNK_BYTES", 4096)  # objects span many chunks
    streamed: dict[str, bytes] = {}
    chunks = 0
    async for message in client.pull_weights("sync", checkpoint_id, "another-host"):
        chunks += 1
        streamed[message.name] = streamed.get(message.name, b"") + message.data
    assert sorted(streamed) == sorted(o.name for o in manifest.sampler_objects)
    assert chunks > 2 * len(streamed)
    folder = pathlib.Path(local[0].local_folder)
    assert all(streamed[name] == (folder / name).read_bytes() for name in streamed)
    with pytest.raises(errors.NotFoundError):
        [m async for m in client.pull_weights("sync", "no-such-checkpoint", "another-host")]
    # A rollout on another host gets the stream, and verifies it.
    monkeypatch.setattr(weights, "host_id", lambda: "another-host")
    await client.forward_backward(datums=good_batch(4), model="sync")
    step = await client.optim_step(1e-2, model="sync")
    info = await client.get_serving_info(wait_for_checkpoint_id=step.checkpoint.checkpoint_id, model="sync")
    assert info.weight_version == step.checkpoint.checkpoint_id and not info.last_reload_error
    # Only what changed was written: the weights; config and tokenizer are the parent's objects.
    manifest = await durable(client, "sync", step.checkpoint.checkpoint_id)
    training_state = {"optimizer.pt", "trainer_state.json"}
    assert stored(data_dir, "sync", step.checkpoint.checkpoint_id) - training_state == {"model.safetensors"}
    shared = [o for o in manifest.sampler_objects if o.name != "model.safetensors"]
    assert shared and all(f"/checkpoints/{step.checkpoint.checkpoint_id}/" not in o.key for o in shared)


async def test_a_checkpoint_without_state_resumes_with_its_ancestors_moments(synced) -> None:
    client, _, _ = synced
    summaries = await client.list_checkpoints("sync")
    stateless = [s for s in summaries if not s.has_state and not s.pending and s.step > 0]
    assert stateless and any(s.has_state for s in summaries)
    target = stateless[-1]
    await client.set_head("sync", target.checkpoint_id)  # a rollback: the trainer reloads there
    before = await fingerprint(client, "sync")
    info = await client.get_trainer_info("sync")
    assert info.checkpoint_id == target.checkpoint_id and info.step == target.step
    await client.forward_backward(datums=good_batch(5), model="sync")
    step = await client.optim_step(1e-2, model="sync", save_state=True)
    assert step.has_state and step.step == target.step + 1
    assert await fingerprint(client, "sync") != before


async def test_state_added_on_close_is_what_the_next_session_resumes_from(synced) -> None:
    client, _, _ = synced
    summaries = await client.list_checkpoints("sync")
    target = [s for s in summaries if not s.has_state and not s.pending and s.step > 0][-1]
    await client.set_head("sync", target.checkpoint_id)
    await fingerprint(client, "sync")  # the trainer reloads there (its weights cached without state)
    for other in ("sync-x", "sync-y"):  # two more slugs: the trainer (2 sessions) closes the idle "sync"
        await client.fork_model("tiny", other)
        await fingerprint(client, other)
    manifest = await client.get_checkpoint("sync", target.checkpoint_id)
    assert manifest.has_state, "closing the session saved the training state of the checkpoint it was at"
    await fingerprint(client, "sync")  # a new session resumes there, with that state and step
    info = await client.get_trainer_info("sync")
    assert info.checkpoint_id == target.checkpoint_id and info.step == target.step
