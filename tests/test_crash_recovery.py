"""kill -9 of the trainer process at any point of an optimizer step.

The trainer runs as ``yieldloop up`` runs it: its own process, supervised (started again on the same address
when it dies). The checkpoint service runs here, with an interceptor that kills the trainer exactly before
or after a commit went through; other kills land at timed points of the step. Whatever the point, a client
retrying with its idempotency key (the Python client does so by itself) never hears an error for a step that
committed durably, each key commits at most once, and HEAD always names a durable checkpoint the restarted
trainer loads: a step committed pending (its weights served from the trainer, its upload still running) whose
trainer died is rolled back from, and its caller had heard ``durable`` false.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import uuid

import pytest
import pytest_asyncio

from yieldloop import errors
from yieldloop.client import Client
from yieldloop.transport import TransportConfig
from yieldloop_server.config import ServeOptions, StackConfig
from yieldloop_server.serve import build_service
from yieldloop_server.stack import ServiceProcess, ensure_model, ensure_stack_keys
from yieldloop_server.store import open_store

from test_training_safety import fingerprint, good_batch

pytestmark = pytest.mark.asyncio(loop_scope="module")


class KillTrainer:
    """A checkpoint-service interceptor that kill -9s the trainer around its next CommitCheckpoint."""

    def __init__(self) -> None:
        self.trainer: ServiceProcess | None = None
        self.plan: list[str] = []

    def kill(self) -> None:
        assert self.trainer is not None and self.trainer.process is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.trainer.process.pid, signal.SIGKILL)

    @contextlib.asynccontextmanager
    async def intercept(self, call):
        mode = self.plan.pop(0) if self.plan and call.method.endswith("/CommitCheckpoint") else ""
        if mode == "before":  # died before its commit reached the store
            self.kill()
            raise errors.UnavailableError("the trainer died", reason="INTERNAL")
        yield
        if mode == "after":  # committed (HEAD moved); the trainer dies before it hears so
            self.kill()
            await asyncio.sleep(0.2)
            raise errors.UnavailableError("the trainer died", reason="INTERNAL")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def crashing(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("crash")
    killer = KillTrainer()
    config = StackConfig(data_dir=data_dir, transport=TransportConfig(server_interceptors=(killer,)))
    await asyncio.to_thread(ensure_model, open_store(config.store_url), "tiny")
    admin_key, service_key = ensure_stack_keys(open_store(config.store_url), data_dir)
    start, stop = await build_service(ServeOptions.of(config, "checkpoint", {}))
    checkpoint = await start()
    options = ServeOptions.of(StackConfig(data_dir=data_dir), "trainer", {"checkpoint": checkpoint})
    options.ready_file = data_dir / "run" / "trainer.json"
    options.ready_file.parent.mkdir(parents=True, exist_ok=True)
    killer.trainer = trainer = ServiceProcess(options, data_dir / "logs", service_key=service_key)
    await trainer.start()
    async with Client(trainer=trainer.address, checkpoint=checkpoint, timeout=120, api_key=admin_key) as client:
        yield client, killer, trainer
    await trainer.stop()
    await stop(1.0)


async def committed_with(client: Client, key: str) -> list[str]:
    """The checkpoints whose metadata carries idempotency key ``key``."""
    found = []
    for summary in (await client.list_checkpoints("tiny")).checkpoints:
        manifest = await client.get_checkpoint("tiny", summary.checkpoint_id)
        if json.loads(manifest.metadata_json or "{}").get("idempotency_key") == key:
            found.append(manifest.checkpoint_id)
    return found


async def killed_step(
    client: Client, killer: KillTrainer, trainer: ServiceProcess, kill: str | float, seed: int, durable: bool,
) -> bool:
    """One step whose trainer is killed at ``kill`` ("before"/"after" its commit, or seconds into the call);
    returns whether it committed (``durable``: the step answers once its checkpoint is in the store)."""
    await client.forward_backward(datums=good_batch(seed), model="tiny")
    head = await client.get_head("tiny")
    restarts = trainer.restarts
    key = uuid.uuid4().hex
    if isinstance(kill, str):
        killer.plan.append(kill)
    step = asyncio.create_task(client.optim_step(1e-2, model="tiny", idempotency_key=key, wait_durable=durable))
    if not isinstance(kill, str):
        await asyncio.sleep(kill)
        killer.kill()
    try:
        outcome = await step  # retried with its key while the trainer restarts
    except errors.FailedPreconditionError as err:
        outcome = err
    while trainer.restarts == restarts:  # a kill that landed after the answer: the trainer is still restarting
        await asyncio.sleep(0.1)
    for _ in range(100):  # the channel reconnects (grpc's backoff, at most 5 s here); the trainer loaded HEAD
        with contextlib.suppress(errors.UnavailableError):
            await client.get_trainer_info(model="tiny")
            break
        await asyncio.sleep(0.1)
    after = await client.get_head("tiny")
    assert not (await client.get_checkpoint("tiny", after.checkpoint_id)).pending, "HEAD names a durable checkpoint"
    committed = await committed_with(client, key)
    assert len(committed) <= 1, "a key committed more than once"
    durable_commit = committed and not (await client.get_checkpoint("tiny", committed[0])).pending
    if durable_commit:  # the step committed: its caller must hear it, whatever happened to the trainer
        assert not isinstance(outcome, Exception), f"a committed step answered {outcome!r}"
        assert outcome.checkpoint.checkpoint_id == committed[0]
        assert after.checkpoint_id == committed[0] or not outcome.durable
    elif isinstance(outcome, Exception):  # not committed, or lost before it was durable: the error says so
        assert outcome.reason == "NO_GRADIENTS" and "was not committed" in outcome.message, outcome
        assert after == head or committed, "HEAD moved back only from a step that never became durable"
    else:  # answered before it was durable (as it said), then its trainer died: HEAD went back from it
        assert not outcome.durable and after.checkpoint_id != outcome.checkpoint.checkpoint_id
    if after.checkpoint_id not in (head.checkpoint_id, *committed):  # went back: to where training resumes exactly
        manifest = await client.get_checkpoint("tiny", after.checkpoint_id)
        assert manifest.has_state or not manifest.parent_checkpoint_id
    return bool(durable_commit)


@pytest.mark.parametrize("durable", [True, False], ids=["wait_durable", "pending"])
async def test_kill_9_during_a_step_never_fails_a_committed_step(crashing, durable: bool) -> None:
    client, killer, trainer = crashing
    assert await killed_step(client, killer, trainer, "after", 1, durable) == durable
    assert not await killed_step(client, killer, trainer, "before", 2, durable)
    for i, delay in enumerate((0.0, 0.02, 0.05)):  # wherever the step happens to be
        await killed_step(client, killer, trainer, delay, 3 + i, durable)
    # The head the restarted trainer loaded is the one it trains on: a normal step still works.
    before = await fingerprint(client, "tiny")
    await client.forward_backward(datums=good_batch(20), model="tiny")
    step = await client.optim_step(1e-2, model="tiny")
    assert (await client.get_head("tiny")).checkpoint_id == step.checkpoint.checkpoint_id
    assert await fingerprint(client, "tiny") != before


async def test_kill_9_of_the_rollout_loses_no_acknowledged_run(tmp_path) -> None:
    """``yieldloop up``'s stack: the rollout service is killed while it streams a batch; every run the client
    had received is in the trace store (a run is streamed only once its batch is durable), and the restarted
    service serves them and samples again on the same address."""
    from yieldloop.envs.letters import tasks
    from yieldloop.types import RunStatus
    from yieldloop_server.config import EnvOptions
    from yieldloop_server.stack import ProcessStack

    stack = ProcessStack(StackConfig(data_dir=tmp_path, env=EnvOptions(workers=0)))
    addresses = await stack.start()
    rollout = stack.services["rollout"]
    try:
        async with Client(**addresses, timeout=60, api_key=stack.api_key) as client:
            received = []
            with pytest.raises(errors.UnavailableError):
                async for run in client.stream_rollouts(tasks(), group_size=8, max_concurrent=16):
                    received.append(run.trace_id)
                    if len(received) == 40:
                        os.kill(rollout.process.pid, signal.SIGKILL)
            assert len(received) >= 40
            while rollout.restarts == 0:
                await asyncio.sleep(0.1)
            for _ in range(100):
                with contextlib.suppress(errors.UnavailableError):
                    stored = await client.get_runs(received)
                    break
                await asyncio.sleep(0.1)
            assert [run.trace_id for run in stored] == received
            again = [run async for run in client.stream_rollouts(tasks("ab"), group_size=2)]
            assert {run.status for run in again} == {RunStatus.GRADED}
    finally:
        await stack.stop()
