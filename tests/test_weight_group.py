"""Weights to the fleet by broadcast: rollout services in a trainer's weight group get each step once, over gloo.

A rollout service with ``--rollout-weights-from group`` subscribes to the trainer of the first pending checkpoint
it pulls (SubscribeWeights); from then on every checkpoint the trainer publishes is announced to the whole group
before it is committed and broadcast over a torch.distributed group of its own (gloo here; NCCL where every side
has CUDA), verified against the trainer's sha256 by every member. Members that come or go make the next
broadcast form a new group; a broadcast that fails ends the members' streams, they pull meanwhile and subscribe
again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import pathlib

import pytest
import pytest_asyncio
from test_training_safety import good_batch

from yieldloop import errors
from yieldloop.client import Client, sampling_params
from yieldloop.transport import TransportConfig
from yieldloop_server.config import EnvOptions, RolloutOptions, StackConfig, TrainerOptions
from yieldloop_server.stack import InProcessStack
from yieldloop_server.weights import collective
from yieldloop_server.weights.group import WeightSubscription

pytestmark = pytest.mark.asyncio(loop_scope="module")


class CountPulls:
    """Counts PullWeights calls (a checkpoint that came by broadcast is never pulled)."""

    def __init__(self) -> None:
        self.pulls = 0

    @contextlib.asynccontextmanager
    async def intercept(self, call):
        if call.method.endswith("/PullWeights"):
            self.pulls += 1
        yield


@contextlib.asynccontextmanager
async def group_stack(data_dir: pathlib.Path, trainer: TrainerOptions = TrainerOptions()):
    """A stack whose rollout service takes weights by broadcast, with a full fork "grp" it serves; yields the
    client and the PullWeights counter."""
    counter = CountPulls()
    config = StackConfig(
        data_dir=data_dir,
        env=EnvOptions(workers=0),
        rollout=RolloutOptions(weights_from="group"),
        trainer=trainer,
        transport=TransportConfig(server_interceptors=(counter,)),
    )
    stack = InProcessStack(config)
    await stack.start()
    try:
        async with Client(**stack.addresses, api_key=stack.api_key, timeout=120) as client:
            await client.fork_model("tiny", "grp")
            await client.generate([1, 2], sampling=sampling_params(max_tokens=1), model="grp")  # served from now on
            yield client, counter
    finally:
        await stack.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def grouped(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("group")
    async with group_stack(data_dir) as (client, counter):
        yield client, counter, data_dir


async def step(client: Client, seed: int) -> str:
    """One training step of "grp"; returns its checkpoint id once the rollout service serves it."""
    await client.forward_backward(datums=good_batch(seed), model="grp")
    checkpoint_id = (await client.optim_step(1e-2, model="grp")).checkpoint.checkpoint_id
    info = await client.get_serving_info(wait_for_checkpoint_id=checkpoint_id, model="grp")
    assert info.weight_version == checkpoint_id and not info.last_reload_error
    completion = await client.generate([1, 2, 3], sampling=sampling_params(max_tokens=2), model="grp")
    assert completion.weight_version == checkpoint_id
    return checkpoint_id


async def members(client: Client, count: int) -> None:
    for _ in range(400):
        if (await client.get_trainer_info("grp")).weight_group_members == count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the weight group never had {count} members")


async def same_as_manifest(client: Client, folder: pathlib.Path, checkpoint_id: str) -> None:
    manifest = await client.get_checkpoint("grp", checkpoint_id)
    for obj in manifest.sampler_objects:
        assert hashlib.sha256((folder / obj.name).read_bytes()).hexdigest() == obj.sha256, obj.name
    assert not any(p.name.startswith(".dl-") for p in folder.parent.iterdir())  # no staging left behind


async def test_a_step_reaches_every_member_by_one_broadcast(grouped, tmp_path) -> None:
    client, counter, data_dir = grouped
    # A second member beside the stack's rollout service: another rollout service's subscription, its own cache.
    other = WeightSubscription(client, "grp", tmp_path / "other")
    try:
        first = await step(client, 1)  # pulled: the rollout service was no member when it was published
        assert counter.pulls == 1
        await members(client, 2)
        pulls = counter.pulls
        for seed in (2, 3):
            checkpoint_id = await step(client, seed)
            assert counter.pulls == pulls  # came by broadcast, to both members
            await same_as_manifest(client, data_dir / "work" / "rollout" / "grp" / checkpoint_id, checkpoint_id)
            assert await other.arrival(checkpoint_id) == tmp_path / "other" / checkpoint_id
            await same_as_manifest(client, tmp_path / "other" / checkpoint_id, checkpoint_id)
        # It was a member before the first step (then alone in the group): it got all three.
        assert other.received == 3 and (tmp_path / "other" / first).is_dir()
        # A member leaves: the next step forms a group without it.
        await other.close()
        await members(client, 1)
        checkpoint_id = await step(client, 4)
        assert counter.pulls == pulls and not (tmp_path / "other" / checkpoint_id).exists()
    finally:
        await other.close()


async def test_a_member_that_never_joins_fails_the_broadcast_not_the_step(grouped, monkeypatch) -> None:
    client, counter, _ = grouped
    await members(client, 1)
    monkeypatch.setattr(collective, "GROUP_TIMEOUT_S", 2.0)
    seen: list = []

    async def stalled() -> None:  # subscribes, reads, never joins a group
        async for message in client.subscribe_weights("grp"):
            seen.append(type(message).__name__.removeprefix("Weight").lower())

    task = asyncio.create_task(stalled())
    try:
        await members(client, 2)
        pulls = counter.pulls
        await step(client, 5)  # the group is never complete: the broadcast fails, the rollout service pulls it
        assert counter.pulls == pulls + 1
        with pytest.raises(errors.UnavailableError) as err:
            await asyncio.wait_for(task, 30)
        assert err.value.reason == "WEIGHT_GROUP_UNAVAILABLE" and seen[:3] == ["subscribed", "group", "broadcast"]
        # The rollout service subscribed again: the next step comes by broadcast.
        await members(client, 1)
        await step(client, 6)
        assert counter.pulls == pulls + 1
    finally:
        task.cancel()


async def test_bytes_damaged_in_flight_are_refused_and_that_checkpoint_pulled(grouped, monkeypatch) -> None:
    import shutil

    from yieldloop_server.weights import group as broadcast

    client, counter, _ = grouped
    await members(client, 1)
    sent = broadcast.broadcast_files

    def damaged(group, backend, objects, chunk_bytes, source=None, target=None):
        """Sends other bytes than the announced ones (a copy of the folder with one byte flipped)."""
        copy = source.parent / f".damaged-{source.name}"
        shutil.copytree(source, copy)
        path = copy / "model.safetensors"
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
        try:
            return sent(group, backend, objects, chunk_bytes, source=copy)
        finally:
            shutil.rmtree(copy)

    monkeypatch.setattr(broadcast, "broadcast_files", damaged)
    pulls = counter.pulls
    await step(client, 7)  # the received bytes fail their sha256: pulled instead, still in the group
    assert counter.pulls == pulls + 1
    monkeypatch.setattr(broadcast, "broadcast_files", sent)
    await members(client, 1)
    await step(client, 8)
    assert counter.pulls == pulls + 1


async def test_a_member_told_of_a_group_during_a_long_broadcast_joins_once_it_opens(
    grouped, tmp_path, monkeypatch
) -> None:
    """A member that subscribes while a broadcast runs is told of the next group at once, but the trainer forms
    that group only after the broadcast ended, which for a large model takes longer than a join may
    (GROUP_TIMEOUT_S). The member waits for the trainer to open the group, then joins: the next step comes by
    broadcast to every member (it used to time out, and every member pulled that step and subscribed again)."""
    import time

    from yieldloop_server.weights import group as broadcast

    client, counter, _ = grouped
    await members(client, 1)
    monkeypatch.setattr(collective, "GROUP_TIMEOUT_S", 2.0)
    sent = broadcast.broadcast_files

    def long(group, backend, objects, chunk_bytes, source=None, target=None):
        """The trainer's side of a broadcast that lasts 4 s after its bytes went (twice a join's timeout)."""
        digests = sent(group, backend, objects, chunk_bytes, source=source, target=target)
        time.sleep(4.0)
        return digests

    monkeypatch.setattr(broadcast, "broadcast_files", long)
    pulls = counter.pulls
    await step(client, 9)  # served by broadcast; the trainer's side goes on for 4 s
    other = WeightSubscription(client, "grp", tmp_path / "other")
    try:
        await members(client, 2)
        checkpoint_id = await step(client, 10)  # a new group: opened once step 9's broadcast ended
        assert await other.arrival(checkpoint_id) == tmp_path / "other" / checkpoint_id
        assert counter.pulls == pulls and other.received == 1
    finally:
        await other.close()
        monkeypatch.setattr(broadcast, "broadcast_files", sent)


async def test_closing_a_member_that_waits_for_a_group_to_open_ends_its_wait() -> None:
    """A member waiting for its group to open stops when it closes, or when the trainer abandons the group."""
    import threading

    store = collective.open_store("127.0.0.1", 0, 5.0, master=True)
    stopped = threading.Event()
    waiting = asyncio.create_task(asyncio.to_thread(collective.wait_opened, store, "m/1/", stopped))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    stopped.set()
    with pytest.raises(RuntimeError, match="stopped"):
        await asyncio.wait_for(waiting, 5)
    collective.abandon_group(store, "m/2/")
    with pytest.raises(RuntimeError, match="abandoned"):
        await asyncio.to_thread(collective.wait_opened, store, "m/2/", threading.Event())
    collective.open_group(store, "m/3/")
    await asyncio.to_thread(collective.wait_opened, store, "m/3/", threading.Event())


async def test_a_member_of_a_trainer_that_does_not_open_groups_joins_at_once() -> None:
    """A WeightGroup without ``wait_until_open`` (a trainer from before groups were opened, during a rolling
    upgrade) is joined at once, as then; with it the member would wait for the group to open."""
    import threading

    from yieldloop.types import WeightGroup
    from yieldloop_server.weights import group as weights

    store = collective.open_store("127.0.0.1", 0, 10.0, master=True)
    spec = WeightGroup(address=f"127.0.0.1:{store.port}", name="old/1/", rank=1, size=2, backend="gloo")
    trainer = asyncio.create_task(asyncio.to_thread(collective.make_group, store, "old/1/", 0, 2, "gloo", 10.0))
    member = await asyncio.wait_for(asyncio.to_thread(weights._join, spec, threading.Event()), 20)
    collective.close_group(member)
    collective.close_group(await trainer)


async def test_the_cache_keeps_the_served_and_the_last_few_checkpoints(grouped) -> None:
    from yieldloop_server.weights.sink import KEEP_CACHED

    client, _, data_dir = grouped
    for seed in range(9, 9 + KEEP_CACHED):
        served = await step(client, seed)
    cache = data_dir / "work" / "rollout" / "grp"
    for _ in range(100):  # pruned behind the fetch
        kept = {p.name for p in cache.iterdir() if not p.name.startswith(".")}
        if len(kept) <= KEEP_CACHED:
            break
        await asyncio.sleep(0.05)
    assert served in kept and len(kept) == KEEP_CACHED  # after 10+ steps: not a copy of every step's weights


async def test_subscribe_weights_bad_input(grouped) -> None:
    client, _, _ = grouped
    for model, backend, field in (("grp", "mpi", "backend"), ("../x", "gloo", "model"), ("grp", "", "backend")):
        with pytest.raises(errors.InvalidArgumentError) as err:
            async for _ in client.subscribe_weights(model, backend):
                pass
        assert err.value.field == field
