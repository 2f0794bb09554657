"""EnvService servicer: protobuf <-> EpisodeHost translation, episode deadlines."""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import grpc

from yieldloop.common.v1 import common_pb2 as common_pb
from yieldloop.env.v1 import env_service_pb2 as pb
from yieldloop.env.v1 import env_service_pb2_grpc as pb_grpc
from yieldloop.episode import protocol_error
from yieldloop.errors import DeadlineExceededError, InvalidArgumentError
from yieldloop.services.common.grpc_server import rpc
from yieldloop.services.env.host import EnvInfo, EpisodeHost, resolve_env


def _json_object(text: str, reason: str, field: str) -> dict[str, Any]:
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"{field} is not valid JSON: {exc}", reason=reason, field=field) from None
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"{field} must be a JSON object", reason=reason, field=field)
    return value


def tool_specs(info: EnvInfo) -> list[common_pb.ToolSpec]:
    return [
        common_pb.ToolSpec(name=t["name"], description=t["description"], parameters_json_schema=json.dumps(t["parameters"]))
        for t in info.tools
    ]


def prompt_messages(prompt: str | list[dict[str, str]]) -> tuple[str, list[common_pb.ChatMessage]]:
    """Text and chat forms of a scenario prompt."""
    if isinstance(prompt, str):
        return prompt, [common_pb.ChatMessage(role="user", content=prompt)]
    messages = [common_pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt]
    return "\n".join(m.content for m in messages), messages


async def _before(deadline: float, awaitable: Awaitable[Any], what: str, reason: str) -> Any:
    """Awaits ``awaitable`` until the loop time ``deadline`` (inf: none); past it, DEADLINE_EXCEEDED."""
    if deadline == math.inf:
        return await awaitable
    try:
        async with asyncio.timeout_at(deadline):
            return await awaitable
    except TimeoutError:
        raise DeadlineExceededError(f"{what} exceeded its deadline", reason=reason) from None


class EnvServicer(pb_grpc.EnvServiceServicer):
    def __init__(self, host: EpisodeHost) -> None:
        self.host = host

    @rpc
    async def ListScenarios(self, request: pb.ListScenariosRequest, context: grpc.aio.ServicerContext) -> pb.ListScenariosResponse:
        infos = [resolve_env(self.host.envs, request.env)] if request.env else list(self.host.envs.values())
        response = pb.ListScenariosResponse()
        for info in infos:
            for scenario in info.scenarios:
                response.scenarios.add(
                    env=info.name,
                    name=scenario["name"],
                    description=scenario["description"],
                    args_json_schema=json.dumps(scenario["args_schema"]),
                )
            response.tools.extend(tool_specs(info))
        return response

    @rpc
    async def StreamEpisode(
        self, request_iterator: AsyncIterator[pb.StreamEpisodeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StreamEpisodeResponse]:
        loop = asyncio.get_running_loop()
        remaining = context.time_remaining()
        deadline = loop.time() + (remaining if remaining is not None else math.inf)
        requests = aiter(request_iterator)
        # The host key is ours, so two streams that send the same episode_id never collide.
        key = uuid.uuid4().hex
        info: EnvInfo | None = None
        graded = False
        try:
            while True:
                try:
                    request = await _before(deadline, anext(requests), "the episode", "EPISODE_DEADLINE")
                except StopAsyncIteration:
                    return
                action = request.WhichOneof("action")
                if action == "start":
                    if info is not None:
                        raise protocol_error("the episode was already started")
                    task = request.start.task
                    info = resolve_env(self.host.envs, task.env)
                    deadline = min(deadline, loop.time() + info.episode_timeout_s)
                    args = _json_object(task.args_json, "SCENARIO_ARGS_INVALID", "start.task.args_json")
                    prompt = await _before(
                        deadline, self.host.open(info.name, task.scenario, args, key), "the episode", "EPISODE_DEADLINE"
                    )
                    text, messages = prompt_messages(prompt)
                    yield pb.StreamEpisodeResponse(
                        started=pb.EpisodeStarted(
                            episode_id=request.start.episode_id or key, prompt=text, messages=messages,
                            tools=tool_specs(info),
                        )
                    )
                elif info is None:
                    raise protocol_error(f"{action or 'an empty message'} before start")
                elif action == "call_tool":
                    call = request.call_tool
                    if graded:
                        raise protocol_error("tool call after submit")
                    arguments = _json_object(call.arguments_json, "TOOL_ARGS_INVALID", "call_tool.arguments_json")
                    tool_deadline = min(deadline, loop.time() + info.tool_timeout_s)
                    content, is_error = await _before(
                        tool_deadline, self.host.call_tool(key, call.name, arguments), f"tool {call.name!r}",
                        "TOOL_DEADLINE",
                    )
                    yield pb.StreamEpisodeResponse(
                        tool_result=pb.ToolResult(call_id=call.call_id, content=content, is_error=is_error)
                    )
                elif action == "submit":
                    if graded:
                        raise protocol_error("the answer was already submitted")
                    grade = await _before(deadline, self.host.submit(key, request.submit.answer), "the episode", "EPISODE_DEADLINE")
                    graded = True
                    info_json = {"subscores": grade.subscores, **grade.info} if grade.subscores else grade.info
                    yield pb.StreamEpisodeResponse(
                        graded=pb.EpisodeGraded(reward=grade.reward, info_json=json.dumps(info_json, default=str))
                    )
                else:
                    raise protocol_error("empty request")
        finally:
            # Teardown runs however the stream ends: done, error, deadline or a vanished client.
            await asyncio.shield(self.host.close(key))
