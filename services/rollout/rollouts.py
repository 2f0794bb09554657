"""Episodes against EnvService: the single-turn agent loop and grouped rollouts.

An episode starts on EnvService, renders the prompt with the model's chat
template, samples a completion from the engine, submits the decoded answer
and records a token-exact Run. Environment failures become runs with status
ENV_ERROR and infrastructure failures INFRA_ERROR, never reward 0; a bad
task (unknown scenario, arguments that do not bind) fails the whole request.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence

from yieldloop.client import Client
from yieldloop.common.v1 import common_pb2 as common_pb
from yieldloop.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError, YieldloopError
from yieldloop.services.rollout.engines import Engine, SamplingConfig

STOP_REASONS = {
    "eos": common_pb.STOP_REASON_EOS,
    "length": common_pb.STOP_REASON_LENGTH,
    "stop_string": common_pb.STOP_REASON_STOP_STRING,
    "cancelled": common_pb.STOP_REASON_CANCELLED,
    "context": common_pb.STOP_REASON_CONTEXT,
}


async def sample_turn(engine: Engine, prompt_ids: list[int], sampling: SamplingConfig) -> common_pb.Turn:
    """Samples one completion and returns it as a token-exact Turn."""
    turn = common_pb.Turn(prompt_token_ids=prompt_ids)
    async for delta in engine.generate(prompt_ids, sampling):
        turn.completion_token_ids.extend(delta.token_ids)
        turn.completion_logprobs.extend(delta.logprobs)
        turn.weight_version = delta.weight_version
        if delta.finished:
            turn.stop_reason = STOP_REASONS[delta.stop_reason]
    turn.completion_text = engine.decode(turn.completion_token_ids)
    return turn


async def run_episode(
    engine: Engine, env: Client, task: common_pb.Task, group_id: str, sampling: SamplingConfig, model: str
) -> common_pb.Run:
    """One episode: start, one model turn, submit, graded Run."""
    run = common_pb.Run(run_id=uuid.uuid4().hex, task=task, group_id=group_id, model=model)
    episode = env.episode(task)
    try:
        started = await episode.start()
        run.prompt = started.prompt
        messages = [{"role": m.role, "content": m.content} for m in started.messages]
        turn = await sample_turn(engine, engine.render_chat(messages), sampling)
        run.turns.append(turn)
        run.answer = turn.completion_text
        graded = await episode.submit(run.answer)
        run.reward, run.info_json, run.status = graded.reward, graded.info_json, common_pb.RUN_STATUS_GRADED
    except (NotFoundError, InvalidArgumentError):
        raise  # the task itself is bad: fail the request, do not record a run
    except FailedPreconditionError as err:
        if err.reason != "ENVIRONMENT_ERROR":
            raise
        run.status, run.error = common_pb.RUN_STATUS_ENV_ERROR, str(err)
    except YieldloopError as err:
        run.status, run.error = common_pb.RUN_STATUS_INFRA_ERROR, str(err)
    finally:
        await episode.close()
    return run


async def stream_rollouts(
    engine: Engine,
    env: Client,
    tasks: Sequence[common_pb.Task],
    *,
    group_size: int,
    max_concurrent: int,
    sampling: SamplingConfig,
    model: str,
) -> AsyncIterator[common_pb.Run]:
    """Runs every task ``group_size`` times, at most ``max_concurrent`` at once; yields Runs as they finish."""
    limit = asyncio.Semaphore(max_concurrent or len(tasks) * group_size)
    finished: asyncio.Queue = asyncio.Queue()
    nonce = uuid.uuid4().hex[:8]

    async def one(task: common_pb.Task, group_id: str) -> None:
        async with limit:
            try:
                await finished.put(await run_episode(engine, env, task, group_id, sampling, model))
            except Exception as exc:  # handed to the consumer, which re-raises it
                await finished.put(exc)

    workers = [
        asyncio.create_task(one(task, f"{task.task_id or i}-{nonce}"))
        for i, task in enumerate(tasks)
        for _ in range(group_size)
    ]
    try:
        for _ in workers:
            item = await finished.get()
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        for worker in workers:
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
