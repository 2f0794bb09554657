"""Episodes against EnvService: the multi-turn agent loop and grouped rollouts with retries.

An episode starts on EnvService, renders the prompt and the environment's
tools with the model's chat template, and samples turns from the engine:
a turn with tool calls gets the results appended and another turn, until
the model answers, ``max_steps`` turns were taken, the episode deadline
passes or the context is full (see :mod:`.agent`). The answer is submitted
and the Run records every turn token-exact. Environment failures become
runs with status ENV_ERROR and infrastructure failures (a dead env worker,
an engine error) are retried, then recorded as INFRA_ERROR, never reward 0;
a bad task (unknown scenario, arguments that do not bind) fails the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from yieldloop.client import Client
from yieldloop.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
    YieldloopError,
)
from yieldloop.retry import Backoff
from yieldloop.types import AgentStopReason, PromptFormat, Run, RunStatus, StopReason, TaskRef, Turn
from yieldloop_server.common import telemetry
from yieldloop_server.rollout.agent import (
    MalformedToolCall,
    continuation_ids,
    parse_tool_calls,
    strip_tool_calls,
    tools_for_template,
)
from yieldloop_server.rollout.engines import Engine, SamplingConfig, whole_completion
from yieldloop_server.rollout.engines.base import chat_chars

STOP_REASONS = {
    "eos": StopReason.EOS,
    "length": StopReason.LENGTH,
    "stop_string": StopReason.STOP_STRING,
    "cancelled": StopReason.CANCELLED,
    "context": StopReason.CONTEXT,
}


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """How the agent loop drives one episode."""

    max_steps: int = 8
    """Model turns at most."""
    episode_timeout_s: float = 0.0
    """Wall-clock budget of an episode (0: none beyond the environment's own)."""
    max_attempts: int = 4
    """Attempts per episode when infrastructure fails (waits of about 0.2, 0.4, 0.8 s between them: a service
    restarting within a second loses no episode)."""
    backoff: Backoff = Backoff(initial_s=0.2, max_s=5.0)
    """Wait between attempts (exponential, with jitter)."""


@dataclasses.dataclass(frozen=True)
class RolloutLimits:
    """Server-side bounds on what one StreamRollouts request may ask (errors name them)."""

    max_runs: int = 8192
    """Episodes (tasks x group size) per request."""
    max_episodes: int = 1024
    """Episodes running at once on this rollout service, over all requests (a request's default concurrency)."""
    max_attempts: int = 10
    max_steps: int = 256


class RetryBudget:
    """Retries a request may still spend: infrastructure failures are retried while it lasts (an outage does not
    multiply a batch's load), then recorded as they are."""

    def __init__(self, retries: int) -> None:
        self.left = retries

    def take(self) -> bool:
        if self.left <= 0:
            return False
        self.left -= 1
        return True


def seeded(sampling: SamplingConfig, *path: int) -> SamplingConfig:
    """``sampling`` with a seed derived from its own and ``path`` (an episode, a turn); unseeded stays unseeded."""
    if not sampling.seed:
        return sampling
    digest = hashlib.blake2b(repr((sampling.seed, *path)).encode(), digest_size=8).digest()
    return dataclasses.replace(sampling, seed=int.from_bytes(digest, "big") >> 2 or 1)


async def sample_turn(engine: Engine, prompt_ids: list[int], sampling: SamplingConfig) -> Turn:
    """Samples one completion and returns it as a token-exact Turn."""
    turn = Turn(prompt_token_ids=list(prompt_ids))
    try:
        async for delta in engine.generate(prompt_ids, whole_completion(sampling)):
            turn.completion_token_ids.extend(delta.token_ids)
            turn.completion_logprobs.extend(delta.logprobs)
            turn.weight_version = delta.weight_version
            if delta.finished:
                turn.stop_reason = STOP_REASONS[delta.stop_reason]
    except YieldloopError:
        raise
    except Exception as exc:  # an engine failure is infrastructure: retried, never scored
        raise UnavailableError(f"engine error: {type(exc).__name__}: {exc}", reason="ENGINE_ERROR") from exc
    turn.completion_text = engine.decode(turn.completion_token_ids)
    telemetry.count(
        "yieldloop.rollout.tokens",
        len(turn.completion_token_ids),
        {"kind": "completion"},
        description="tokens sampled (rate: tokens/s)",
    )
    return turn


async def agent_loop(engine: Engine, episode, started, run: Run, sampling: SamplingConfig, config: AgentConfig) -> str:
    """Drives the model through one started episode; fills ``run.turns``; returns the answer to submit.

    Raw text (the scenario yielded RawText, or the model has no chat template) is one completion: no chat
    template, no tools, the completion is the answer.
    """
    deadline = time.monotonic() + config.episode_timeout_s if config.episode_timeout_s > 0 else None
    raw = started.raw_text or not engine.has_chat_template
    run.prompt_format = PromptFormat.RAW if raw else PromptFormat.CHAT
    tools = None if raw else tools_for_template(started.tools) or None
    messages = [{"role": m.role, "content": m.content} for m in started.messages]
    chars = len(started.prompt) if raw else chat_chars(messages, tools)
    if not engine.fits_text(chars):  # too long to fit whatever its tokens: not worth tokenizing
        run.agent_stop_reason = AgentStopReason.CONTEXT
        return ""
    prompt_ids = await (
        engine.off_loop(chars, engine.render_raw, started.prompt)
        if raw
        else engine.off_loop(chars, engine.render_chat, messages, tools)
    )
    answer = ""
    for step in range(1 if raw else config.max_steps):
        if len(prompt_ids) >= engine.max_model_len:
            run.agent_stop_reason = AgentStopReason.CONTEXT
            return answer
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            run.agent_stop_reason = AgentStopReason.DEADLINE
            return answer
        try:
            with telemetry.span("generate", {"yieldloop.turn": step, "yieldloop.prompt_tokens": len(prompt_ids)}):
                turn_sampled = sample_turn(engine, prompt_ids, seeded(sampling, step))
                turn = await (turn_sampled if remaining is None else asyncio.wait_for(turn_sampled, remaining))
        except TimeoutError:
            run.agent_stop_reason = AgentStopReason.DEADLINE
            return answer
        run.turns.append(turn)
        text = turn.completion_text
        if raw:
            run.agent_stop_reason = AgentStopReason.ANSWER
            return text
        answer = strip_tool_calls(text)
        try:
            calls = parse_tool_calls(text)
        except MalformedToolCall:
            run.agent_stop_reason = AgentStopReason.MALFORMED_TOOL_CALL
            return text
        if not calls:
            run.agent_stop_reason = AgentStopReason.ANSWER
            return answer
        if step == config.max_steps - 1:
            break
        # A bad call (unknown tool, invalid arguments) is part of the trajectory: the model sees the error.
        results = []
        for c in calls:
            with telemetry.tool_call(c.name, "yieldloop.rollout.tool_call.duration"):
                result = await episode.call_tool(c.name, json.dumps(c.arguments), errors_as_results=True)
            results.append({"role": "tool", "content": result.content})
        added = sum(len(result["content"]) for result in results)
        if not engine.fits_text(added):
            run.agent_stop_reason = AgentStopReason.CONTEXT
            return answer
        prompt_ids = [
            *turn.prompt_token_ids,
            *turn.completion_token_ids,
            *await engine.off_loop(
                added, continuation_ids, engine, messages, tools, turn.completion_token_ids, results
            ),
        ]
        messages += [{"role": "assistant", "content": text}, *results]
    run.agent_stop_reason = AgentStopReason.MAX_STEPS
    return answer


async def run_episode(
    engine: Engine,
    env: Client,
    task: TaskRef,
    group_id: str,
    sampling: SamplingConfig,
    model: str,
    config: AgentConfig = AgentConfig(),
    budget: RetryBudget | None = None,
    trace_id: str = "",
) -> Run:
    """One episode: start, the agent loop, submit; a graded (or failed) Run.

    An infrastructure failure is tried again, ``config.max_attempts`` times at most (``Run.attempts``), after a
    backoff, while the request's retry ``budget`` lasts. The episode is one trace, ``trace_id`` (default: a new
    one), which is also the Run's.
    """
    trace_id = trace_id or uuid.uuid4().hex
    attributes = {
        "yieldloop.env": task.env,
        "yieldloop.scenario": task.scenario,
        "yieldloop.group_id": group_id,
        "yieldloop.model": model,
    }
    with (
        telemetry.episode_span(trace_id, attributes) as span,
        telemetry.in_flight("yieldloop.rollout.episodes", {"model": model}, "episodes running"),
    ):
        for attempt in range(1, config.max_attempts + 1):
            run = Run(
                run_id=uuid.uuid4().hex, task=task, group_id=group_id, model=model, attempts=attempt, trace_id=trace_id
            )
            with telemetry.span("attempt", {"yieldloop.attempt": attempt}):
                await _attempt(engine, env, run, sampling, config)
            if run.status != RunStatus.INFRA_ERROR or attempt == config.max_attempts:
                break
            if budget is not None and not budget.take():
                run.error += " (the request's retry budget is spent)"
                break
            await asyncio.sleep(config.backoff.delay(attempt - 1))
        if span is not None:
            span.set_attribute("yieldloop.status", run.status.name)
            span.set_attribute("yieldloop.reward", run.reward)
    return run


async def _attempt(engine: Engine, env: Client, run: Run, sampling: SamplingConfig, config: AgentConfig) -> None:
    episode = env.episode(run.task)
    try:
        with engine.expect():  # a batch about to start waits for this episode's first turn (ends once submitted)
            started = await episode.start()
            run.prompt = started.prompt
            run.answer = await agent_loop(engine, episode, started, run, sampling, config)
        last = run.turns[-1] if run.turns else Turn()
        with telemetry.span("grade"):
            graded = await episode.submit(
                run.answer, stop_reason=last.stop_reason, completion_token_ids=last.completion_token_ids
            )
        run.reward, run.info_json, run.status = graded.reward, graded.info_json, RunStatus.GRADED
    except (NotFoundError, InvalidArgumentError):
        raise  # the task itself is bad: fail the request, do not record a run
    except FailedPreconditionError as err:
        if err.reason != "ENVIRONMENT_ERROR":
            raise
        run.status, run.error = RunStatus.ENV_ERROR, str(err)
    except YieldloopError as err:
        run.status, run.error = RunStatus.INFRA_ERROR, str(err)
    finally:
        await episode.close()


async def stream_rollouts(*args: Any, **kwargs: Any) -> AsyncIterator[Run]:
    """Runs as they finish: :func:`stream_rollout_batches`' runs one at a time."""
    async with contextlib.aclosing(stream_rollout_batches(*args, **kwargs)) as batches:
        async for batch in batches:
            for run in batch:
                yield run


async def stream_rollout_batches(
    engine: Engine,
    env: Client,
    tasks: Sequence[TaskRef],
    *,
    group_size: int,
    max_concurrent: int,
    sampling: SamplingConfig,
    model: str,
    config: AgentConfig = AgentConfig(),
    shared_limit: asyncio.Semaphore | None = None,
    record: Callable[[list[Run]], Awaitable[Any]] | None = None,
) -> AsyncIterator[list[Run]]:
    """Runs every task ``group_size`` times, at most ``max_concurrent`` at once (0: no bound of its own) and
    within ``shared_limit`` (the service's episodes over all requests); yields Runs as they finish, those that
    finished together in one list. Retries after infrastructure failures share a budget of a tenth of the runs (at
    least 8).

    With ``record``, runs are yielded only once ``record`` made them durable, in batches (group commit): every
    run that finished while the previous batch was being recorded goes into the next one.
    """
    limit = asyncio.Semaphore(max_concurrent or len(tasks) * group_size)
    shared = shared_limit or contextlib.nullcontext()
    budget = RetryBudget(max(8, len(tasks) * group_size // 10))
    finished: asyncio.Queue = asyncio.Queue()
    nonce = uuid.uuid4().hex[:8]
    prefix = uuid.uuid4().hex[:16]
    """Every episode of the request is a trace whose id starts with it (the trace store keeps them together)."""

    async def one(task: TaskRef, group_id: str, episode_sampling: SamplingConfig) -> None:
        async with limit, shared:
            try:
                await finished.put(
                    await run_episode(
                        engine,
                        env,
                        task,
                        group_id,
                        episode_sampling,
                        model,
                        config,
                        budget,
                        trace_id=prefix + uuid.uuid4().hex[16:],
                    )
                )
            except Exception as exc:  # handed to the consumer, which re-raises it
                await finished.put(exc)

    # A seeded request repeats exactly: episode k of the request samples with its own seed derived from the
    # request's (the members of a group still differ), whatever order the episodes finish in.
    workers = [
        asyncio.create_task(one(task, f"{task.task_id or i}-{nonce}", seeded(sampling, i * group_size + member)))
        for i, task in enumerate(tasks)
        for member in range(group_size)
    ]
    try:
        remaining = len(workers)
        while remaining:
            batch = [await finished.get()]
            while not finished.empty():
                batch.append(finished.get_nowait())
            remaining -= len(batch)
            runs = [item for item in batch if not isinstance(item, Exception)]
            if runs and record is not None:
                await record(runs)
            if runs:
                yield runs
            for item in batch:
                if isinstance(item, Exception):
                    raise item
    finally:
        for worker in workers:
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
