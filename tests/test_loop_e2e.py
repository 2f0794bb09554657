"""End to end: all four services on port 0, driven by the client library."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from yieldloop.client import Client, sampling_params
from yieldloop.envs.letters import letter_reward, tasks
from yieldloop.loop import LoopConfig, closed_loop
from yieldloop.proto.common.v1 import common_pb2 as common_pb

MODEL = "tiny"
PROMPT = [1, 40, 41, 42, 43]


async def test_one_iteration_commits_moves_head_and_reloads(client: Client) -> None:
    head_before = await client.get_head(MODEL)
    config = LoopConfig(steps=1, group_size=4)  # no held-out gate: the trainer moves HEAD
    reports = [r async for r in closed_loop(client, config, train_tasks=tasks("abcd"))]
    report = reports[0]
    assert report.num_runs == 16
    assert report.sampled_weight_versions == [head_before.checkpoint_id]

    # The checkpoint is committed, with every object the rollout servers need (the training state goes with
    # every tenth step: see test_weight_sync).
    manifest = await client.get_checkpoint(MODEL, report.checkpoint_id)
    names = {o.name for o in manifest.sampler_objects}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= names
    assert manifest.parent_checkpoint_id == head_before.checkpoint_id
    assert all(o.sha256 and o.size > 0 for o in manifest.objects)

    # HEAD moved to it, one sequence further.
    head = await client.get_head(MODEL)
    assert head.checkpoint_id == report.checkpoint_id
    assert head.sequence == head_before.sequence + 1
    listed = await client.list_checkpoints(MODEL)
    assert [c.checkpoint_id for c in listed if c.is_head] == [report.checkpoint_id]

    # The next Generate reports that checkpoint as its weight version.
    completion = await client.generate([1, 2, 3], sampling=sampling_params(max_tokens=4, temperature=1.0))
    assert completion.weight_version == report.checkpoint_id
    assert len(completion.token_ids) == len(completion.logprobs) > 0
    info = await client.get_serving_info()
    assert info.weight_version == report.checkpoint_id and info.engine == "torch"


async def test_rollouts_are_scored_by_the_environment(client: Client) -> None:
    runs = [run async for run in client.stream_rollouts(tasks("xy"), group_size=3)]
    assert len(runs) == 6
    by_group: dict[str, list] = {}
    for run in runs:
        assert run.status == common_pb.RUN_STATUS_GRADED
        turn = run.turns[0]
        assert len(turn.completion_token_ids) == len(turn.completion_logprobs) > 0
        assert all(lp <= 0 for lp in turn.completion_logprobs)
        letter = json.loads(run.task.args_json)["letter"]
        assert run.reward == letter_reward(run.answer, letter)
        by_group.setdefault(run.group_id, []).append(run)
    assert sorted(len(g) for g in by_group.values()) == [3, 3]


async def test_corrupt_checkpoint_is_refused_and_old_weights_keep_serving(client: Client, stack) -> None:
    from yieldloop import errors
    from yieldloop_server.store import open_store

    store = open_store(stack.config.store_url)
    good = await client.get_head(MODEL)
    manifest = await client.get_checkpoint(MODEL, good.checkpoint_id)
    # A copy of the head under a new id, committed without moving HEAD ...
    manifest.checkpoint_id, manifest.parent_checkpoint_id = "corrupt-copy", good.checkpoint_id
    for obj in manifest.objects:
        data, _ = store.get_bytes(obj.key)
        obj.key = f"models/{MODEL}/checkpoints/corrupt-copy/{obj.name}"
        store.put_bytes(obj.key, data)
    await client.commit_checkpoint(manifest, set_head=False)
    # ... then one flipped byte in its weights, and HEAD moved to it.
    weights_key = next(o.key for o in manifest.objects if o.name == "model.safetensors")
    data = bytearray(store.get_bytes(weights_key)[0])
    data[len(data) // 2] ^= 0x01
    store.put_bytes(weights_key, bytes(data))
    await client.set_head(MODEL, "corrupt-copy")

    with pytest.raises(errors.FailedPreconditionError) as err:
        await client.get_serving_info(wait_for_checkpoint_id="corrupt-copy", timeout=60)
    assert err.value.reason == "CHECKPOINT_CORRUPT"
    info = await client.get_serving_info()
    assert info.weight_version == good.checkpoint_id and "checksum" in info.last_reload_error
    assert await weights_health(stack) == "NOT_SERVING", "the refusal is visible in gRPC health"
    completion = await client.generate([1, 2, 3], sampling=sampling_params(max_tokens=3))
    assert completion.weight_version == good.checkpoint_id

    # Rolling HEAD back keeps the good weights serving.
    await client.set_head(MODEL, good.checkpoint_id)
    info = await client.get_serving_info(wait_for_checkpoint_id=good.checkpoint_id, timeout=60)
    assert info.weight_version == good.checkpoint_id
    for _ in range(100):  # the rollback's reload finishes in the background
        if await weights_health(stack) == "SERVING":
            break
        await asyncio.sleep(0.05)
    assert await weights_health(stack) == "SERVING"


async def weights_health(stack) -> str:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from yieldloop_server.rollout.server import WEIGHTS_HEALTH

    async with grpc.aio.insecure_channel(stack.addresses["rollout"]) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=WEIGHTS_HEALTH)
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


async def test_runs_are_persisted_and_trainable_by_trace_id(client: Client) -> None:
    from yieldloop import errors

    runs = [run async for run in client.stream_rollouts(tasks("m"), group_size=3, job_id="trace-test")]
    assert all(run.trace_id for run in runs)
    stored = await client.get_runs([run.trace_id for run in runs])
    assert stored == runs
    # Runs and trace ids are interchangeable for training: the same batch gives the same loss.
    by_id = await client.forward_backward(runs=[run.trace_id for run in runs])
    inline = await client.forward_backward(runs=runs)
    assert by_id.loss_sum == pytest.approx(inline.loss_sum) and by_id.num_datums == inline.num_datums == 3
    step = await client.optim_step(1e-4)
    await client.get_serving_info(wait_for_checkpoint_id=step.checkpoint.checkpoint_id, timeout=60)
    with pytest.raises(errors.NotFoundError) as err:
        await client.get_runs(["0" * 32])
    assert err.value.reason == "TRACE_NOT_FOUND"
    with pytest.raises(errors.InvalidArgumentError):
        await client.forward_backward(runs=["../etc/passwd"])


async def test_train_step_with_substeps(client: Client) -> None:
    before = await client.get_trainer_info()
    runs = [run async for run in client.stream_rollouts(tasks("pq"), group_size=2)]
    step, metrics = await client.train_step(runs, 1e-4, num_substeps=2)
    assert [m.num_datums for m in metrics] == [2, 2], "each substep trains whole groups"
    assert step.step == before.step + 2
    head = await client.get_head(MODEL)
    assert head.checkpoint_id == step.checkpoint.checkpoint_id
    assert (await client.get_checkpoint(MODEL, step.checkpoint.checkpoint_id)).step == before.step + 2
    await client.get_serving_info(wait_for_checkpoint_id=step.checkpoint.checkpoint_id, timeout=60)


async def test_hot_reloads_under_generation_load_fail_no_request(client: Client) -> None:
    """10 head moves while generation never stops: no request fails, each is sampled by one weight version."""
    import asyncio

    original = await client.get_head(MODEL)
    targets = ["base", original.checkpoint_id] * 5
    stop = asyncio.Event()
    failures: list[BaseException] = []
    versions_seen: set[str] = set()
    completed = 0

    async def generate_forever(seed: int) -> None:
        nonlocal completed
        while not stop.is_set():
            try:
                versions = set()
                # ignore_eos: every request runs 8 tokens, so head moves land while requests are in flight.
                sampling = sampling_params(max_tokens=8, temperature=1.0, ignore_eos=True)
                stream = client.generate_stream([1, 2, 3, seed], sampling=sampling)
                async for delta in stream:
                    versions.add(delta.weight_version)
                assert len(versions) == 1, f"one request, several weight versions: {versions}"
                versions_seen.update(versions)
                completed += 1
            except Exception as exc:  # counted: the assertion below says what failed
                failures.append(exc)

    loaders = [asyncio.create_task(generate_forever(seed)) for seed in range(4)]
    try:
        for target in targets:
            await client.set_head(MODEL, target)
            info = await client.get_serving_info(wait_for_checkpoint_id=target, timeout=60)
            assert info.weight_version == target
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.gather(*loaders)
    assert failures == [], failures[:3]
    assert completed > 20 and versions_seen == {"base", original.checkpoint_id}
    assert (await client.get_head(MODEL)).checkpoint_id == original.checkpoint_id


async def test_one_rollout_service_serves_every_slug_by_name(stack, client: Client) -> None:
    """A fork is sampled by its slug (gRPC and the OpenAI endpoint), follows its own head, and is trained by its
    slug; the source's head and weights are untouched; beyond the engine limit an idle engine is unloaded."""
    import aiohttp

    from yieldloop import errors

    tiny_head = await client.get_head(MODEL)
    await client.fork_model(MODEL, "served-fork")
    completion = await client.generate(PROMPT, model="served-fork", sampling=sampling_params(max_tokens=4))
    assert completion.weight_version == tiny_head.checkpoint_id  # the fork's head: shared objects, same node
    runs = [run async for run in client.stream_rollouts(tasks("ab"), group_size=2, model="served-fork")]
    assert {run.model for run in runs} == {"served-fork"}

    await client.forward_backward(runs=runs, model="served-fork")
    step = await client.optim_step(1e-3, model="served-fork")
    new = step.checkpoint.checkpoint_id
    info = await client.get_serving_info(wait_for_checkpoint_id=new, model="served-fork")
    assert info.model == "served-fork" and info.weight_version == new
    after = await client.generate(PROMPT, model="served-fork", sampling=sampling_params(max_tokens=4))
    assert after.weight_version == new
    assert (await client.get_head(MODEL)).checkpoint_id == tiny_head.checkpoint_id
    assert (await client.get_serving_info()).weight_version == tiny_head.checkpoint_id

    base_url = info.openai_base_url
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {client.transport.api_key}"}) as http:
        body = {"model": "served-fork", "prompt": PROMPT, "max_tokens": 3}
        async with http.post(f"{base_url}/completions", json=body) as response:
            assert response.status == 200 and (await response.json())["choices"][0]["weight_version"] == new
        async with http.post(f"{base_url}/completions", json={**body, "model": "no-such-slug"}) as response:
            assert response.status == 404 and (await response.json())["error"]["code"] == "model_not_found"

    # Two engines at most (the default): a third slug unloads the least recently used idle one.
    await client.fork_model(MODEL, "served-fork-2")
    third = await client.generate(PROMPT, model="served-fork-2", sampling=sampling_params(max_tokens=2))
    assert third.weight_version == tiny_head.checkpoint_id
    assert (await client.generate(PROMPT, sampling=sampling_params(max_tokens=2))).weight_version
    with pytest.raises(errors.NotFoundError) as err:
        await client.generate(PROMPT, model="no-such-slug")
    assert err.value.reason == "MODEL_NOT_FOUND"


async def test_overlap_bounds_and_reports_how_stale_each_batch_was(client: Client) -> None:
    await client.fork_model(MODEL, "overlap")
    for off_policy in (0, 1):
        config = LoopConfig(model="overlap", steps=3, group_size=2, max_off_policy=off_policy)
        reports = [r async for r in closed_loop(client, config, train_tasks=tasks("abcd"))]
        assert len(reports) == 3
        parents = [r.parent_checkpoint_id for r in reports]
        for i, report in enumerate(reports):
            assert report.max_staleness <= off_policy and report.completion_tokens > 0
            # Sampled by the weights it trains, or (overlap) by those one step older, never anything else.
            allowed = {parents[i]} | ({parents[i - 1]} if off_policy and i else set())
            assert set(report.sampled_weight_versions) <= allowed, (off_policy, i, report.sampled_weight_versions)
            stale = set(report.sampled_weight_versions) - {parents[i]}
            assert (report.off_policy_runs > 0) == bool(stale) and (report.max_staleness == 1) == bool(stale)


async def test_an_on_policy_batch_samples_the_candidate_while_the_gate_evaluates_it(tmp_path) -> None:
    """On-policy with a held-out gate, the next batch is sampled by the candidate while the gate evaluates it
    (where candidates get an engine like the head's: a torch engine in the service's process). Promoted, the
    batch was sampled by the head it trains from; rejected, it is dropped and the next batch is sampled by the head,
    as if the loop had waited."""
    from yieldloop.envs.letters import TASKS
    from yieldloop_server.config import RolloutOptions, StackConfig
    from yieldloop_server.stack import InProcessStack

    stack = InProcessStack(StackConfig(data_dir=tmp_path, rollout=RolloutOptions(engine_process=False)))
    await stack.start()
    try:
        async with Client(**stack.addresses, api_key=stack.api_key, timeout=120) as client:
            assert (await client.get_serving_info()).candidate_engine_like_head
            base = LoopConfig(**TASKS, steps=2, group_size=2, tasks_per_step=4, max_off_policy=0)
            kept = [r async for r in closed_loop(client, dataclasses.replace(base, promotion_tolerance=1.0))]
            assert [r.promoted for r in kept] == [True, True]
            assert kept[1].parent_checkpoint_id == kept[0].checkpoint_id
            assert kept[1].sampled_weight_versions == [kept[0].checkpoint_id] and kept[1].max_staleness == 0
            assert kept[1].served_weight_version == kept[1].checkpoint_id
            head = await client.get_head(MODEL)
            wrecked = [r async for r in closed_loop(client, dataclasses.replace(base, learning_rate=0.5))]
            assert not wrecked[0].promoted, wrecked[0]  # a learning rate that wrecks the weights
            assert wrecked[1].parent_checkpoint_id == head.checkpoint_id
            assert wrecked[1].sampled_weight_versions == [head.checkpoint_id] and wrecked[1].max_staleness == 0
    finally:
        await stack.stop()
