"""The multi-turn agent loop: token-exact turn stitching, tool calls, stop reasons, infrastructure retries.

A scripted policy writes the model turns (the tiny random model does not call tools on its own), on top
of each real engine's tokenizer and chat template; everything else is real: EnvService in worker
processes over gRPC, the SDK environment's tools, the rollout code that records the Run.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import AsyncIterator, Sequence

import pytest
import pytest_asyncio
from engine_harness import ServedEngine

from yieldloop.client import Client
from yieldloop.proto.common.v1 import common_pb2 as common_pb
from yieldloop_server.env.hosts import HostConfig, create_host
from yieldloop_server.env.server import make_server as build
from yieldloop_server.rollout.agent import MalformedToolCall, parse_tool_calls, tools_for_template
from yieldloop_server.rollout.engines import Engine, SamplingConfig, TokenDelta
from yieldloop_server.rollout.rollouts import AgentConfig, run_episode, stream_rollouts

SDK_ENV = f"{pathlib.Path(__file__).parent / 'envs' / 'sdk_env.py'}:env"
SAMPLING = SamplingConfig(max_tokens=64, temperature=1.0)


class ScriptedEngine(Engine):
    """Writes scripted turns through a real engine's tokenizer (completion ids end with end-of-turn)."""

    name = "scripted"

    def __init__(self, inner: Engine, turns: Sequence[str], fail_first: int = 0) -> None:
        self.inner, self.turns, self.fail_first = inner, list(turns), fail_first
        self.tokenizer = inner.tokenizer
        self.prompts: list[list[int]] = []

    weight_version = property(lambda self: self.inner.weight_version)
    vocab_size = property(lambda self: self.inner.vocab_size)
    max_model_len = property(lambda self: self.inner.max_model_len)

    async def load_weights(self, folder, version) -> None:
        raise NotImplementedError

    def num_unfinished(self) -> int:
        return 0

    async def generate(self, prompt_ids, sampling) -> AsyncIterator[TokenDelta]:
        self.validate_prompt(prompt_ids)
        if self.fail_first > 0:
            self.fail_first -= 1
            raise RuntimeError("engine blew up")
        self.prompts.append(list(prompt_ids))
        ids = self.encode(self.turns[min(len(self.prompts) - 1, len(self.turns) - 1)]) + [self.eos_token_id]
        yield TokenDelta(ids, [-0.5] * len(ids), self.weight_version, finished=True, stop_reason="eos")


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def count_task(target: int, tag: str = "") -> common_pb.Task:
    return common_pb.Task(env="sdk", scenario="count_to", args_json=json.dumps({"target": target, "tag": tag}))


@pytest_asyncio.fixture(scope="module")
async def env_client():
    server = await build(create_host((SDK_ENV,), HostConfig("workers", num_workers=2, hang_timeout_s=5.0)))
    await server.start()
    client = Client(env=server.address, timeout=60)
    yield client
    await client.close()
    await server.stop(1.0)


async def test_five_turn_episode_stitches_token_ids_exactly(served_engine: ServedEngine, env_client: Client) -> None:
    turns = [call("increment", by=1)] * 3 + [f"Almost. {call('increment', by=1)}", "4"]
    engine = ScriptedEngine(served_engine.engine, turns)
    run = await run_episode(engine, env_client, count_task(4), "g", SAMPLING, "tiny", AgentConfig(max_steps=8))
    assert run.status == common_pb.RUN_STATUS_GRADED, run.error
    assert len(run.turns) == 5 and run.agent_stop_reason == common_pb.AGENT_STOP_REASON_ANSWER
    assert run.answer == "4" and run.reward == 1.0, "four tool calls reached the counter, the answer graded 1"
    for previous, turn in zip(run.turns, run.turns[1:]):
        prefix = [*previous.prompt_token_ids, *previous.completion_token_ids]
        assert list(turn.prompt_token_ids[: len(prefix)]) == prefix, "each prompt extends the last turn exactly"
        assert len(turn.prompt_token_ids) > len(prefix), "with the tool result appended"
    # What the model saw is what the chat template renders for the whole conversation: no drift.
    messages = [
        {"role": "system", "content": "Use the increment tool."},
        {"role": "user", "content": "Bring the counter to 4."},
    ]
    for i, text in enumerate(turns[:4]):
        messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": str(i + 1)}]
    last = run.turns[-1]
    tools = tools_for_template((await env_client.list_scenarios()).tools)
    rendered = engine.render_chat_text(messages, tools, add_generation_prompt=True)
    assert engine.decode(last.prompt_token_ids, skip_special_tokens=False) == rendered
    assert engine.prompts == [list(t.prompt_token_ids) for t in run.turns]


async def test_a_turn_that_stopped_early_is_closed_by_the_template(served_engine: ServedEngine, env_client) -> None:
    class NoEos(ScriptedEngine):
        async def generate(self, prompt_ids, sampling):
            async for delta in super().generate(prompt_ids, sampling):
                yield TokenDelta(delta.token_ids[:-1], delta.logprobs[:-1], delta.weight_version, True, "length")

    engine = NoEos(served_engine.engine, [call("increment", by=2), "2"])
    run = await run_episode(engine, env_client, count_task(2), "g", SAMPLING, "tiny")
    first, second = run.turns
    prefix = [*first.prompt_token_ids, *first.completion_token_ids]
    assert list(second.prompt_token_ids[: len(prefix)]) == prefix
    assert second.prompt_token_ids[len(prefix)] == engine.eos_token_id, "the template's end-of-turn is appended"
    assert run.reward == 1.0


async def test_malformed_tool_call_is_a_stop_reason(served_engine: ServedEngine, env_client: Client) -> None:
    engine = ScriptedEngine(served_engine.engine, ["<tool_call>{not json}</tool_call>"])
    run = await run_episode(engine, env_client, count_task(1), "g", SAMPLING, "tiny")
    assert run.status == common_pb.RUN_STATUS_GRADED and run.reward == 0.0
    assert run.agent_stop_reason == common_pb.AGENT_STOP_REASON_MALFORMED_TOOL_CALL
    assert len(run.turns) == 1


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": "x"}',
        "<tool_call>[1, 2]</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "x", "arguments": 3}</tool_call>',
    ],
)
def test_malformed_tool_calls_are_recognised(text: str) -> None:
    with pytest.raises(MalformedToolCall):
        parse_tool_calls(text)


def test_tool_calls_parse() -> None:
    text = f"thinking {call('a', x=1)} and {call('b')}"
    assert [(c.name, c.arguments) for c in parse_tool_calls(text)] == [("a", {"x": 1}), ("b", {})]
    assert parse_tool_calls('<tool_call>{"name": "s", "arguments": "{\\"k\\": 2}"}</tool_call>')[0].arguments == {
        "k": 2
    }


async def test_max_steps_and_bad_tool_names(served_engine: ServedEngine, env_client: Client) -> None:
    engine = ScriptedEngine(
        served_engine.engine, [call("no_such_tool"), call("increment", by="x"), call("increment", by=1)]
    )
    run = await run_episode(engine, env_client, count_task(1), "g", SAMPLING, "tiny", AgentConfig(max_steps=3))
    assert run.agent_stop_reason == common_pb.AGENT_STOP_REASON_MAX_STEPS and len(run.turns) == 3
    assert run.status == common_pb.RUN_STATUS_GRADED
    # The model saw the errors of its bad calls as tool results.
    assert "TOOL_NOT_FOUND" in engine.decode(run.turns[1].prompt_token_ids, skip_special_tokens=False)
    assert "TOOL_ARGS_INVALID" in engine.decode(run.turns[2].prompt_token_ids, skip_special_tokens=False)


async def test_episode_deadline_is_a_stop_reason(served_engine: ServedEngine, env_client: Client) -> None:
    engine = ScriptedEngine(served_engine.engine, [call("sleep", seconds=0.5)] * 5)
    run = await run_episode(
        engine, env_client, count_task(1), "g", SAMPLING, "tiny", AgentConfig(max_steps=8, episode_timeout_s=0.8)
    )
    assert run.agent_stop_reason == common_pb.AGENT_STOP_REASON_DEADLINE
    assert run.status == common_pb.RUN_STATUS_GRADED and 1 <= len(run.turns) <= 3


async def test_infrastructure_failures_are_retried_not_scored(
    served_engine: ServedEngine, env_client: Client, tmp_path: pathlib.Path
) -> None:
    # An env worker that dies at the start of the episode: retried on a replacement worker.
    engine = ScriptedEngine(served_engine.engine, ["done"])
    flaky = common_pb.Task(env="sdk", scenario="flaky_start", args_json=json.dumps({"marker": str(tmp_path / "m")}))
    run = await run_episode(engine, env_client, flaky, "g", SAMPLING, "tiny")
    assert run.status == common_pb.RUN_STATUS_GRADED and run.reward == 1.0 and run.attempts == 2
    # An engine error: retried too.
    engine = ScriptedEngine(served_engine.engine, ["4"], fail_first=1)
    runs = [
        r
        async for r in stream_rollouts(
            engine, env_client, [count_task(0)], group_size=1, max_concurrent=1, sampling=SAMPLING, model="tiny"
        )
    ]
    assert [(r.status, r.attempts) for r in runs] == [(common_pb.RUN_STATUS_GRADED, 2)]
    # Failing every attempt: the run says INFRA_ERROR and carries no reward, it is never a 0.
    engine = ScriptedEngine(served_engine.engine, ["4"], fail_first=10)
    run = await run_episode(engine, env_client, count_task(0), "g", SAMPLING, "tiny", AgentConfig(max_attempts=3))
    assert run.status == common_pb.RUN_STATUS_INFRA_ERROR and run.attempts == 3 and "ENGINE_ERROR" in run.error


async def test_a_seeded_request_repeats_exactly_and_its_group_members_differ(client) -> None:
    """Seeds reach every episode (through Agent(seed=...) and SamplingParams.seed) without making a group alike."""
    from yieldloop.envs.letters import tasks
    from yieldloop.training import Agent

    sampling = Agent(seed=7, max_tokens=8).sampling()
    sampling.ignore_eos = True

    async def completions() -> tuple[dict[str, list[tuple[int, ...]]], set[str]]:
        by_task: dict[str, list[tuple[int, ...]]] = {}
        versions = set()
        async for run in client.stream_rollouts(tasks("ab"), group_size=4, sampling=sampling):
            by_task.setdefault(run.task.task_id, []).append(tuple(run.turns[0].completion_token_ids))
            versions.add(run.turns[0].weight_version)
        return {task: sorted(tokens) for task, tokens in by_task.items()}, versions

    for _ in range(3):  # a head moved by an earlier test may reload in between: compare on the same weights
        (first, before), (second, after) = await completions(), await completions()
        if before == after and len(before) == 1:
            break
    assert first == second, "the same seed on the same weights gives the same runs"
    assert all(len(set(tokens)) > 1 for tokens in first.values()), "a group's members sample differently"


async def test_a_raw_text_prompt_is_one_completion_without_the_chat_template(
    served_engine: ServedEngine, env_client: Client
) -> None:
    from yieldloop.types import AgentStopReason, PromptFormat, RunStatus

    engine = ScriptedEngine(served_engine.engine, ["42"])
    task = common_pb.Task(env="sdk", scenario="complete", args_json=json.dumps({"text": "40 + 2 =", "expected": "42"}))
    run = await run_episode(engine, env_client, task, "g", SamplingConfig(max_tokens=8), "tiny")
    assert run.status == RunStatus.GRADED and run.reward == 1.0, run.error
    assert run.prompt_format == PromptFormat.RAW and run.agent_stop_reason == AgentStopReason.ANSWER
    assert engine.prompts == [engine.render_raw("40 + 2 =")] and len(run.turns) == 1
    chat = await run_episode(engine, env_client, count_task(1), "g", SamplingConfig(max_tokens=8), "tiny")
    assert chat.prompt_format == PromptFormat.CHAT


async def test_the_grader_sees_the_stop_reason_and_the_token_ids(
    served_engine: ServedEngine, env_client: Client
) -> None:
    """The agent submits its final turn's stop reason and token ids with the answer; the scenario sees them
    (`ctx.completion`), so "63" cut at the token limit or spelled with other tokens is told apart."""
    task = common_pb.Task(env="sdk", scenario="exact_digits", args_json=json.dumps({"number": "63"}))
    engine = ScriptedEngine(served_engine.engine, ["63"])  # the scripted turn ends with EOS
    run = await run_episode(engine, env_client, task, "g", SAMPLING, "tiny")
    seen = json.loads(run.info_json)
    assert run.reward == 1.0 and seen["stop_reason"] == "eos"
    assert seen["token_ids"] == list(run.turns[-1].completion_token_ids)

    async with env_client.episode(task) as episode:  # an agent cut at the token limit
        graded = await episode.submit("63", stop_reason=common_pb.STOP_REASON_LENGTH, completion_token_ids=[6, 3])
    assert graded.reward == 0.0 and json.loads(graded.info_json) == {"stop_reason": "length", "token_ids": [6, 3]}
    async with env_client.episode(task) as episode:  # an agent with text only
        graded = await episode.submit("63")
    assert graded.reward == 0.0 and json.loads(graded.info_json) == {"completion": None}


async def test_text_too_long_for_the_context_ends_the_episode_not_the_request(
    served_engine: ServedEngine, env_client: Client
) -> None:
    """A prompt or tool result too long for the model's context is a CONTEXT stop of that episode (graded),
    whether it is too long to be worth tokenizing or is found so by tokenizing it."""
    from yieldloop_server.rollout.engines.base import MAX_CHARS_PER_TOKEN

    limit = served_engine.engine.max_model_len

    def echo(word: str) -> common_pb.Task:
        return common_pb.Task(env="sdk", scenario="echo", args_json=json.dumps({"word": word}))

    for word in ("w" * (limit * MAX_CHARS_PER_TOKEN + 1), "ab " * limit):  # not tokenized; tokenized
        engine = ScriptedEngine(served_engine.engine, ["never sampled"])
        run = await run_episode(engine, env_client, echo(word), "g", SAMPLING, "tiny")
        assert run.status == common_pb.RUN_STATUS_GRADED, run.error
        assert run.agent_stop_reason == common_pb.AGENT_STOP_REASON_CONTEXT and not run.turns
        assert run.reward == 0.0 and engine.prompts == []

    for times in (limit * MAX_CHARS_PER_TOKEN + 1, limit):  # a tool result: not tokenized; tokenized
        engine = ScriptedEngine(served_engine.engine, [call("repeat", text="ab ", times=times), "ab"])
        run = await run_episode(engine, env_client, count_task(1), "g", SAMPLING, "tiny", AgentConfig(max_steps=4))
        assert run.status == common_pb.RUN_STATUS_GRADED, run.error
        assert run.agent_stop_reason == common_pb.AGENT_STOP_REASON_CONTEXT and len(run.turns) == 1


async def test_runs_are_recorded_in_batches_before_they_are_streamed(
    served_engine: ServedEngine, env_client: Client
) -> None:
    """Group commit: every run that finished while a batch was being recorded goes into the next one, and no
    run is yielded before the batch holding it was recorded."""
    import asyncio

    recorded: list[list[int]] = []

    async def record(runs) -> None:
        await asyncio.sleep(0.05)  # a slow store: runs finishing meanwhile queue up for the next batch
        recorded.append([id(run) for run in runs])

    engine = ScriptedEngine(served_engine.engine, ["2"])
    seen = []
    async for run in stream_rollouts(
        engine,
        env_client,
        [count_task(0, tag=str(i)) for i in range(6)],
        group_size=4,
        max_concurrent=0,
        sampling=SAMPLING,
        model="tiny",
        record=record,
    ):
        assert any(id(run) in batch for batch in recorded), "streamed before it was recorded"
        seen.append(run)
    assert len(seen) == 24 and sum(map(len, recorded)) == 24
    assert len(recorded) < 12, f"runs recorded in {len(recorded)} batches"


def test_chat_renders_are_remembered_per_tokenizer(engine_folders) -> None:
    """A group's episodes share a prompt: it is rendered once. What is rendered is what the template renders; a
    template that writes today's date is rendered every time."""
    from transformers import AutoTokenizer

    from yieldloop_server.rollout.engines.base import RENDER_CACHE_SIZE, ChatRenders

    tokenizer = AutoTokenizer.from_pretrained(engine_folders["v1"])
    calls = []
    render = tokenizer.apply_chat_template
    tokenizer.apply_chat_template = lambda *args, **kwargs: calls.append(1) or render(*args, **kwargs)
    renders = ChatRenders(tokenizer)
    chat = [{"role": "user", "content": "Write the letter q."}]
    expected = render(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    first = renders.render(chat, None, True)
    first.append(-1)  # the caller's list is its own
    assert renders.render(chat, None, True) == expected and len(calls) == 1
    assert renders.render(chat, None, False) != expected and len(calls) == 2  # another conversation
    for i in range(RENDER_CACHE_SIZE):
        renders.render([{"role": "user", "content": f"{i}"}], None, True)
    assert renders.render(chat, None, True) == expected and len(calls) == 3 + RENDER_CACHE_SIZE  # forgotten (LRU)

    tokenizer.chat_template = "{{ strftime_now('%d %b %Y') }}" + tokenizer.chat_template
    dated = ChatRenders(tokenizer)
    dated.render(chat, None, True), dated.render(chat, None, True)
    assert len(calls) == 5 + RENDER_CACHE_SIZE
