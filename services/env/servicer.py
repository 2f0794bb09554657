"""EnvService servicer: protobuf <-> environment SDK translation only."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

import grpc

from yieldloop.common.v1 import common_pb2 as common_pb
from yieldloop.env.v1 import env_service_pb2 as pb
from yieldloop.env.v1 import env_service_pb2_grpc as pb_grpc
from yieldloop.environment import Environment, Episode
from yieldloop.errors import InvalidArgumentError
from yieldloop.services.common.grpc_server import rpc
from yieldloop.services.env.loader import EnvironmentSet


def _protocol_error(message: str) -> InvalidArgumentError:
    return InvalidArgumentError(message, reason="EPISODE_PROTOCOL")


def _json_object(text: str, reason: str, what: str) -> dict:
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"{what} is not valid JSON: {exc}", reason=reason) from None
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"{what} must be a JSON object", reason=reason)
    return value


def tool_specs(env: Environment) -> list[common_pb.ToolSpec]:
    return [
        common_pb.ToolSpec(name=t.name, description=t.description, parameters_json_schema=json.dumps(t.parameters))
        for t in env.tools.values()
    ]


def prompt_messages(prompt: str | list[dict[str, str]]) -> tuple[str, list[common_pb.ChatMessage]]:
    """Text and chat forms of a scenario prompt."""
    if isinstance(prompt, str):
        return prompt, [common_pb.ChatMessage(role="user", content=prompt)]
    messages = [common_pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt]
    return "\n".join(m.content for m in messages), messages


class EnvServicer(pb_grpc.EnvServiceServicer):
    def __init__(self, envs: EnvironmentSet) -> None:
        self.envs = envs

    @rpc
    async def ListScenarios(self, request: pb.ListScenariosRequest, context: grpc.aio.ServicerContext) -> pb.ListScenariosResponse:
        response = pb.ListScenariosResponse()
        for env in self.envs.select(request.env):
            for scenario in env.scenarios.values():
                response.scenarios.add(
                    env=env.name,
                    name=scenario.name,
                    description=scenario.description,
                    args_json_schema=json.dumps(scenario.args_schema),
                )
            response.tools.extend(tool_specs(env))
        return response

    @rpc
    async def StreamEpisode(
        self, request_iterator: AsyncIterator[pb.StreamEpisodeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StreamEpisodeResponse]:
        episode: Episode | None = None
        try:
            async for request in request_iterator:
                action = request.WhichOneof("action")
                if action == "start":
                    if episode is not None:
                        raise _protocol_error("the episode was already started")
                    task = request.start.task
                    env = self.envs.get(task.env)
                    episode = env.episode(task.scenario, _json_object(task.args_json, "SCENARIO_ARGS_INVALID", "args_json"))
                    text, messages = prompt_messages(await episode.start())
                    yield pb.StreamEpisodeResponse(
                        started=pb.EpisodeStarted(
                            episode_id=request.start.episode_id or uuid.uuid4().hex,
                            prompt=text,
                            messages=messages,
                            tools=tool_specs(env),
                        )
                    )
                elif episode is None:
                    raise _protocol_error(f"{action or 'an empty message'} before start")
                elif action == "call_tool":
                    call = request.call_tool
                    args = _json_object(call.arguments_json, "EPISODE_PROTOCOL", "arguments_json")
                    content, is_error = await episode.call_tool(call.name, args)
                    yield pb.StreamEpisodeResponse(
                        tool_result=pb.ToolResult(call_id=call.call_id, content=content, is_error=is_error)
                    )
                elif action == "submit":
                    grade = await episode.submit(request.submit.answer)
                    info = {"subscores": grade.subscores, **grade.info} if grade.subscores else grade.info
                    yield pb.StreamEpisodeResponse(
                        graded=pb.EpisodeGraded(reward=grade.reward, info_json=json.dumps(info))
                    )
                    return
                else:
                    raise _protocol_error("empty request")
        finally:
            if episode is not None:
                await episode.close()
