"""kill -9 of the trainer process at any point of an optimizer step, over the filesystem store and S3.

The trainer runs as ``yieldloop up`` runs it: its own process, supervised (started again on the same address
when it dies). The checkpoint service runs here, with an interceptor that kills the trainer exactly before or
after one of its commits (the pending one that moves HEAD, the one that makes the step durable); the other kills
land at points spread over the whole step. Whatever the point:

- no acknowledged step is lost: a step answers OK only once its checkpoint is durable, and every acknowledged
  checkpoint stays on HEAD's lineage (recovery never goes below it);
- HEAD is loadable by every reader at every moment: a reader polling GetHead throughout only ever gets a durable
  checkpoint, or a pending one its live trainer serves; right after a kill GetHead settles a pending head
  itself (sealed, or gone back to the nearest durable checkpoint), without waiting for the trainer;
- nothing is orphaned: at the end no manifest is pending and every object in the store belongs to a manifest.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import uuid

import pytest
import pytest_asyncio
from test_training_safety import fingerprint, good_batch

from yieldloop import errors
from yieldloop.client import Client
from yieldloop.transport import TransportConfig
from yieldloop_server.config import ServeOptions, StackConfig
from yieldloop_server.serve import build_service
from yieldloop_server.stack import ServiceProcess, ensure_model, ensure_stack_keys
from yieldloop_server.store import open_store
from yieldloop_server.weights.files import download_verified

pytestmark = pytest.mark.asyncio(loop_scope="module")

TIMED_KILLS = 23
"""Kills at points spread over a step's duration (plus 4 at the commits): 27 per store, 54 in all."""


class KillTrainer:
    """A checkpoint-service interceptor that kill -9s the trainer around its n-th CommitCheckpoint once armed."""

    def __init__(self) -> None:
        self.trainer: ServiceProcess | None = None
        self.plan: tuple[int, str] | None = None
        self.commits = 0
        self.kills: list[float] = []
        """When each kill happened (time.monotonic)."""

    def arm(self, nth: int, when: str) -> None:
        self.plan, self.commits = (nth, when), 0

    def kill(self) -> None:
        assert self.trainer is not None and self.trainer.process is not None
        self.kills.append(time.monotonic())
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.trainer.process.pid, signal.SIGKILL)

    @contextlib.asynccontextmanager
    async def intercept(self, call):
        mode = ""
        if self.plan is not None and call.method.endswith("/CommitCheckpoint"):
            self.commits += 1
            if self.commits == self.plan[0]:
                mode, self.plan = self.plan[1], None
        if mode == "before":  # died before this commit reached the store
            self.kill()
            raise errors.UnavailableError("the trainer died", reason="INTERNAL")
        yield
        if mode == "after":  # the commit went through; the trainer dies before it hears so
            self.kill()
            await asyncio.sleep(0.2)
            raise errors.UnavailableError("the trainer died", reason="INTERNAL")


class Reader:
    """Reads HEAD throughout, as a rollout service would, and records every answer it could not load: a pending
    checkpoint whose trainer did not serve it (unless a kill landed after the answer), or a durable one with an
    object missing from the store."""

    def __init__(self, client: Client, store, killer: KillTrainer) -> None:
        self.client, self.store, self.killer = client, store, killer
        self.reads = 0
        self.violations: list[str] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            asked = time.monotonic()
            with contextlib.suppress(errors.UnavailableError, errors.DeadlineExceededError):
                head = await self.client.get_head("tiny")
                manifest = await self.client.get_checkpoint("tiny", head.checkpoint_id)
                if manifest.pending:
                    if not await self._served(manifest) and not any(k >= asked for k in self.killer.kills):
                        self.violations.append(f"{head.checkpoint_id}: pending and not served by its trainer")
                else:
                    missing = [
                        o.key for o in manifest.objects if await asyncio.to_thread(self.store.size, o.key) != o.size
                    ]
                    if missing:
                        self.violations.append(f"{head.checkpoint_id}: durable with {missing} missing")
                self.reads += 1
            await asyncio.sleep(0.01)

    async def _served(self, manifest) -> bool:
        from yieldloop_server.checkpoint.server import trainer_probe

        return await trainer_probe(self.client.transport)(manifest)

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


@contextlib.asynccontextmanager
async def crashing_stack(data_dir, store_url: str):
    killer = KillTrainer()
    config = StackConfig(data_dir=data_dir, store=store_url, transport=TransportConfig(server_interceptors=(killer,)))
    store = open_store(config.store_url)
    await asyncio.to_thread(ensure_model, store, "tiny")
    admin_key, service_key = ensure_stack_keys(store, data_dir)
    built = await build_service(ServeOptions.of(config, "checkpoint", {}))
    start, stop = built.start, built.stop
    checkpoint = await start()
    options = ServeOptions.of(StackConfig(data_dir=data_dir, store=store_url), "trainer", {"checkpoint": checkpoint})
    options.ready_file = data_dir / "run" / "trainer.json"
    options.ready_file.parent.mkdir(parents=True, exist_ok=True)
    killer.trainer = trainer = ServiceProcess(options, data_dir / "logs", service_key=service_key)
    await trainer.start()
    try:
        async with Client(trainer=trainer.address, checkpoint=checkpoint, timeout=120, api_key=admin_key) as client:
            yield client, killer, trainer, store
    finally:
        await trainer.stop()
        await stop(1.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["fs", "s3"])
async def crashing(request, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp(f"crash-{request.param}")
    if request.param == "fs":
        async with crashing_stack(data_dir, "") as stack:
            yield stack
        return
    import boto3

    endpoint = request.getfixturevalue("moto_endpoint")
    os.environ["AWS_ENDPOINT_URL"] = endpoint  # the trainer process inherits it, as users configure boto3
    bucket = f"yl-crash-{uuid.uuid4().hex[:8]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    try:
        async with crashing_stack(data_dir, f"s3://{bucket}/yieldloop") as stack:
            yield stack
    finally:
        os.environ.pop("AWS_ENDPOINT_URL", None)


async def committed_with(client: Client, key: str) -> list[str]:
    """The checkpoints whose metadata carries idempotency key ``key``."""
    found = []
    for summary in await client.list_checkpoints("tiny"):
        manifest = await client.get_checkpoint("tiny", summary.checkpoint_id)
        if json.loads(manifest.metadata_json or "{}").get("idempotency_key") == key:
            found.append(manifest.checkpoint_id)
    return found


async def lineage(client: Client, checkpoint_id: str) -> list[str]:
    chain = [checkpoint_id]
    while parent := (await client.get_checkpoint("tiny", chain[-1])).parent_checkpoint_id:
        chain.append(parent)
    return chain


async def trainer_back(client: Client, trainer: ServiceProcess, restarts: int) -> None:
    while trainer.restarts == restarts:  # a kill that landed after the answer: the trainer is still restarting
        await asyncio.sleep(0.05)
    for _ in range(200):  # the channel reconnects; the restarted trainer loaded HEAD
        with contextlib.suppress(errors.UnavailableError):
            await client.get_trainer_info(model="tiny")
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the trainer did not come back")


async def killed_step(
    client: Client,
    killer: KillTrainer,
    trainer: ServiceProcess,
    kill: tuple[int, str] | float,
    seed: int,
    acknowledged: list[str],
) -> str:
    """One step whose trainer is killed at ``kill`` (before/after its n-th commit, or seconds into the call).
    Returns what the caller heard ("ok" or the error's reason)."""
    await client.forward_backward(datums=good_batch(seed), model="tiny")
    head = await client.get_head("tiny")
    restarts = trainer.restarts
    key = uuid.uuid4().hex
    if isinstance(kill, tuple):
        killer.arm(*kill)
    step = asyncio.create_task(client.optim_step(1e-2, model="tiny", idempotency_key=key))
    if not isinstance(kill, tuple):
        await asyncio.sleep(kill)
        killer.kill()
    try:
        outcome = await step  # retried with its key while the trainer restarts
    except errors.FailedPreconditionError as err:
        outcome = err
    if killer.plan is not None:  # the planned commit never came (the step failed before it)
        killer.plan = None
        killer.kill()
    # Right after the kill, before the trainer is back, the head answered is durable (settled if it was not).
    now = await client.get_head("tiny")
    assert not (await client.get_checkpoint("tiny", now.checkpoint_id)).pending, "GetHead answered a pending head"
    await trainer_back(client, trainer, restarts)
    after = await client.get_head("tiny")
    assert not (await client.get_checkpoint("tiny", after.checkpoint_id)).pending, "HEAD names a durable checkpoint"
    committed = await committed_with(client, key)
    assert len(committed) <= 1, "a key committed more than once"
    if isinstance(outcome, Exception):  # not acknowledged: it was not committed, or was abandoned before durable
        assert outcome.reason == "NO_GRADIENTS" and "was not committed" in outcome.message, outcome
        assert not committed or after.checkpoint_id == committed[0], "an unacknowledged step is kept only as HEAD"
        assert after.checkpoint_id in (head.checkpoint_id, *committed)
    else:  # acknowledged: durable, and HEAD (nothing else moves it here)
        assert outcome.durable and committed == [outcome.checkpoint.checkpoint_id]
        assert after.checkpoint_id == outcome.checkpoint.checkpoint_id
        acknowledged.append(outcome.checkpoint.checkpoint_id)
    chain = await lineage(client, after.checkpoint_id)
    lost = [cid for cid in acknowledged if cid not in chain]
    assert not lost, f"acknowledged steps rolled back: {lost}"
    return "ok" if not isinstance(outcome, Exception) else outcome.reason


async def test_kill_9_anywhere_in_a_step_loses_no_acknowledged_step(crashing) -> None:
    client, killer, trainer, store = crashing
    acknowledged: list[str] = []
    # How long an undisturbed step takes here: the timed kills spread over it.
    durations = []
    for seed in (1, 2):
        await client.forward_backward(datums=good_batch(seed), model="tiny")
        started = time.monotonic()
        acknowledged.append((await client.optim_step(1e-2, model="tiny")).checkpoint.checkpoint_id)
        durations.append(time.monotonic() - started)
    span = max(durations) * 1.3
    reader = Reader(client, store, killer)
    heard = []
    try:
        points: list[tuple[int, str] | float] = [(1, "before"), (1, "after"), (2, "before"), (2, "after")]
        points += [span * i / (TIMED_KILLS - 1) for i in range(TIMED_KILLS)]
        for seed, point in enumerate(points, start=10):
            heard.append(await killed_step(client, killer, trainer, point, seed, acknowledged))
    finally:
        await reader.stop()
    assert not reader.violations, reader.violations
    assert reader.reads > 50
    assert "ok" in heard and "NO_GRADIENTS" in heard, heard  # both sides of the commit point were hit
    # The head the restarted trainer loaded is the one it trains on: a normal step still works.
    before = await fingerprint(client, "tiny")
    await client.forward_backward(datums=good_batch(99), model="tiny")
    step = await client.optim_step(1e-2, model="tiny")
    assert (await client.get_head("tiny")).checkpoint_id == step.checkpoint.checkpoint_id
    assert await fingerprint(client, "tiny") != before
    # Nothing orphaned: no manifest pending, every object under checkpoints/ belongs to a manifest, and the
    # final head downloads and verifies.
    manifests = {
        m.checkpoint_id: m
        for m in [await client.get_checkpoint("tiny", s.checkpoint_id) for s in (await client.list_checkpoints("tiny"))]
    }
    assert not [cid for cid, m in manifests.items() if m.pending]
    referenced = {o.key for m in manifests.values() for o in m.objects}
    stray = [
        key
        for key in await asyncio.to_thread(lambda: list(store.list("models/tiny/checkpoints/")))
        if not key.endswith("/manifest.json") and key not in referenced
    ]
    assert not stray, stray
    assert all(cid in manifests for cid in acknowledged)
    final = manifests[step.checkpoint.checkpoint_id]
    folder = trainer.log_path.parent.parent / "verify" / final.checkpoint_id
    await asyncio.to_thread(download_verified, store, final, folder)


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


async def test_every_published_address_survives_a_supervised_restart(tmp_path) -> None:
    """``yieldloop up``'s stack: the rollout service is killed; it comes back with the same gRPC address and the
    same OpenAI endpoint (it was a free port the first time), and the HUD front, which forwards chat completions
    there, answers again without a restart of its own."""
    import aiohttp

    from yieldloop_server.config import EnvOptions
    from yieldloop_server.stack import ProcessStack

    stack = ProcessStack(StackConfig(data_dir=tmp_path, env=EnvOptions(workers=0)))
    addresses = await stack.start()
    rollout = stack.services["rollout"]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Say a."}], "max_tokens": 2}
    headers = {"Authorization": f"Bearer {stack.api_key}"}

    async def chat() -> int:
        async with aiohttp.ClientSession(headers=headers) as http:
            async with http.post(stack.hud_url + "/v1/chat/completions", json=body) as response:
                return response.status

    try:
        async with Client(**addresses, timeout=60, api_key=stack.api_key) as client:
            before = (await client.get_serving_info()).openai_base_url
            assert await chat() == 200
            os.kill(rollout.process.pid, signal.SIGKILL)
            while rollout.restarts == 0:
                await asyncio.sleep(0.1)
            assert rollout.address == addresses["rollout"]
            for _ in range(300):
                with contextlib.suppress(errors.UnavailableError):
                    after = (await client.get_serving_info()).openai_base_url
                    break
                await asyncio.sleep(0.1)
            assert after == before, "the OpenAI endpoint moved"
            statuses = []
            for _ in range(100):
                statuses.append(await chat())
                if statuses[-1] == 200:
                    break
                await asyncio.sleep(0.2)
            assert statuses[-1] == 200, statuses
    finally:
        await stack.stop()
