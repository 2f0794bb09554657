"""EnvService servicer: protobuf <-> EpisodeHost translation, episode deadlines.

The episode state machine (start once, tools until the submit, one submit) belongs to
:class:`yieldloop.episode.Episode` (and the host's one-episode-per-id); the servicer only knows whether
its stream opened an episode yet, since nothing can be forwarded before it has.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from yieldloop.environment import FinalCompletion, RawText
from yieldloop.episode import protocol_error
from yieldloop.errors import DeadlineExceededError, InvalidArgumentError, YieldloopError, as_yieldloop_error, parse_json
from yieldloop.proto.common.v1 import common_pb2 as common_pb
from yieldloop.proto.env.v1 import env_service_pb2 as pb
from yieldloop.proto.env.v1 import env_service_pb2_grpc as pb_grpc
from yieldloop.types import StopReason
from yieldloop_server.common import telemetry
from yieldloop_server.common.grpc_server import Undecodable, rpc
from yieldloop_server.env.host import EnvInfo, EpisodeHost, resolve_env

log = logging.getLogger(__name__)


def _json_object(text: str, reason: str, field: str) -> dict[str, Any]:
    value = parse_json(text or "{}", field, reason)
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"{field} must be a JSON object", reason=reason, field=field)
    return value


def tool_specs(info: EnvInfo) -> list[common_pb.ToolSpec]:
    return [
        common_pb.ToolSpec(
            name=t["name"], description=t["description"], parameters_json_schema=json.dumps(t["parameters"])
        )
        for t in info.tools
    ]


def fill_prompt(started: pb.EpisodeStarted, prompt: str | list[dict[str, str]]) -> None:
    """Puts a scenario prompt's text and chat forms in ``started`` (raw text: no chat form)."""
    if isinstance(prompt, RawText):
        started.prompt, started.raw_text = str(prompt), True
    elif isinstance(prompt, str):
        started.prompt = prompt
        started.messages.add(role="user", content=prompt)
    else:
        for m in prompt:
            started.messages.add(role=m["role"], content=m["content"])
        started.prompt = "\n".join(m["content"] for m in prompt)


class Deadlines:
    """Cancels the streams whose current deadline passed; one timer serves every stream.

    A per-call ``asyncio.timeout`` costs a timer per message, measurable at thousands
    of calls per second; here each stream only updates a dict entry, and one sweep every
    ``tick_s`` seconds cancels what expired (deadlines are honoured within ``tick_s``).
    """

    def __init__(self, tick_s: float = 0.05) -> None:
        self.tick_s = tick_s
        self._watched: dict[asyncio.Task, tuple[float, str, str, str]] = {}
        self._fired: dict[asyncio.Task, tuple[str, str]] = {}
        self._sweeper: asyncio.Task | None = None

    def watch(self, task: asyncio.Task, when: float, what: str, reason: str, subject: str = "") -> None:
        """(Re)arms ``task``'s deadline at loop time ``when`` (inf: none); the error says ``what`` (formatted with
        ``subject`` only if the deadline passes: this runs twice per tool call)."""
        if when == math.inf:
            self._watched.pop(task, None)
            return
        self._watched[task] = (when, what, reason, subject)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    def forget(self, task: asyncio.Task) -> None:
        self._watched.pop(task, None)
        self._fired.pop(task, None)

    def expired(self, task: asyncio.Task) -> DeadlineExceededError | None:
        """The deadline error when this task's cancellation came from a deadline (and un-cancels it)."""
        fired = self._fired.pop(task, None)
        if fired is None:
            return None
        task.uncancel()
        what, reason = fired
        return DeadlineExceededError(f"{what} exceeded its deadline", reason=reason)

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.tick_s)
            now = loop.time()
            for task, (when, what, reason, subject) in list(self._watched.items()):
                if now >= when:
                    del self._watched[task]
                    self._fired[task] = (what.format(subject), reason)
                    task.cancel()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()


_AFTER_SUBMIT = {
    "call_tool": "tool call after submit",
    "submit": "the answer was already submitted",
    "start": "the episode was already started",
}
"""Why a request after the submit is refused (the words of an episode's own checks)."""


class _Frames:
    """The response frames of one StreamEpisodes stream: frames that are ready together leave in one message."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self.context = context
        self.episodes: dict[int, _TaggedEpisode] = {}
        self.ending = False
        self._out: list[pb.EpisodeResponseFrame] = []
        self._ready = asyncio.Event()
        self._finished = False

    def send(self, frame: pb.EpisodeResponseFrame) -> None:
        self._out.append(frame)
        self._ready.set()

    def finish(self) -> None:
        """The write loop sends what is queued, then returns."""
        self._finished = True
        self._ready.set()

    async def write_loop(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            if self._out:
                frames, self._out = self._out, []
                await self.context.write(pb.StreamEpisodesResponse(frames=frames))
            # Frames sent during that write set the event again; finish() may have come with the frames just
            # written, its wake-up consumed by them: check here, not only when woken with nothing to write.
            if self._finished and not self._out:
                return


class _TaggedEpisode:
    """One episode of a StreamEpisodes stream, as :meth:`EnvServicer._episode` sees a stream of its own: its
    requests are read from the frames of its tag, its responses written as frames of its tag."""

    def __init__(self, tag: int, frames: _Frames, trace_context: dict[str, str]) -> None:
        self.tag, self.frames, self.trace_context = tag, frames, trace_context
        self.task: asyncio.Task | None = None
        self._inbox: collections.deque[Any] = collections.deque()
        self._waiter: asyncio.Future | None = None

    def time_remaining(self) -> float | None:
        return self.frames.context.time_remaining()

    async def read(self) -> Any:
        if self._inbox:
            return self._inbox.popleft()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            return await self._waiter
        finally:
            self._waiter = None

    async def write(self, response: pb.StreamEpisodeResponse) -> None:
        self.frames.send(pb.EpisodeResponseFrame(tag=self.tag, response=response))

    def feed(self, request: Any) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(request)
        else:
            self._inbox.append(request)

    def close(self) -> None:
        """The client is done: a half-close when the episode waits for its next request (or has requests
        queued: they come first), else (a tool call or the grading in progress) a cancellation."""
        if self._waiter is not None or self._inbox:
            self.feed(grpc.aio.EOF)
        elif self.task is not None:
            self.task.cancel()


class EnvServicer(pb_grpc.EnvServiceServicer):
    def __init__(self, host: EpisodeHost) -> None:
        self.host = host
        self.deadlines = Deadlines()
        self._started: dict[str, tuple[EnvInfo, pb.EpisodeStarted]] = {}

    def started(self, info: EnvInfo) -> pb.EpisodeStarted:
        """What every EpisodeStarted of ``info`` holds (its tools): built once per environment, not per episode."""
        cached = self._started.get(info.name)
        if cached is None or cached[0] is not info:
            cached = self._started[info.name] = (info, pb.EpisodeStarted(tools=tool_specs(info)))
        return cached[1]

    @rpc
    async def ListScenarios(
        self, request: pb.ListScenariosRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListScenariosResponse:
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
            response.tools.extend(self.started(info).tools)
        return response

    @rpc
    async def StreamEpisode(
        self, request_iterator: AsyncIterator[pb.StreamEpisodeRequest], context: grpc.aio.ServicerContext
    ) -> None:
        # The reader/writer API (context.read/write), not an async generator: at thousands
        # of messages per second every generator layer a message passes through shows.
        me = asyncio.current_task()
        try:
            with telemetry.in_flight("yieldloop.env.episodes", description="episodes open on EnvService"):
                await self._episode(context, me)
        except asyncio.CancelledError:
            error = self.deadlines.expired(me)
            if error is None:
                raise  # the client went away
            raise error from None
        finally:
            self.deadlines.forget(me)

    @rpc
    async def StreamEpisodes(
        self, request_iterator: AsyncIterator[pb.StreamEpisodesRequest], context: grpc.aio.ServicerContext
    ) -> None:
        frames = _Frames(context)
        writer = asyncio.create_task(frames.write_loop())
        half_closed = False
        try:
            while (request := await context.read()) is not grpc.aio.EOF:
                if type(request) is Undecodable:
                    raise request.refusal()
                for frame in request.frames:
                    if not frame.tag:
                        raise protocol_error("a frame without a tag (tags are not 0)")
                    episode = frames.episodes.get(frame.tag)
                    if episode is None:
                        if not frame.HasField("request"):
                            continue  # the close of an episode that already ended
                        episode = frames.episodes[frame.tag] = _TaggedEpisode(
                            frame.tag, frames, dict(frame.trace_context)
                        )
                        episode.task = asyncio.create_task(self._tagged_episode(episode))
                    if frame.HasField("request"):
                        episode.feed(frame.request)
                    if frame.close:
                        episode.close()
            # Every open episode reads the half-close as its own (as on a stream of its own: what it was sent is
            # answered first), and the stream ends once they all have.
            for episode in list(frames.episodes.values()):
                episode.feed(grpc.aio.EOF)
            await asyncio.gather(*(episode.task for episode in list(frames.episodes.values())))
            half_closed = True
        finally:
            # The client went away, or broke the protocol: what is still open is cancelled (its teardown runs).
            frames.ending = True
            open_episodes = [episode.task for episode in frames.episodes.values()]
            for task in open_episodes:
                task.cancel()
            try:
                await asyncio.gather(*open_episodes, return_exceptions=True)
            finally:  # even when cancelled again while the episodes' teardown runs: no write loop outlives us
                if half_closed:
                    frames.finish()
                else:
                    writer.cancel()
        await writer

    async def _tagged_episode(self, episode: _TaggedEpisode) -> None:
        """Runs one episode of a StreamEpisodes stream, in its caller's trace; its outcome is its closing frame."""
        me = asyncio.current_task()
        closing = pb.EpisodeResponseFrame(tag=episode.tag, closed=True)
        with telemetry.continued(
            episode.trace_context, "yieldloop.env.v1.EnvService/StreamEpisodes", {"yieldloop.episode.tag": episode.tag}
        ) as span:
            error: YieldloopError | None = None
            try:
                with telemetry.in_flight("yieldloop.env.episodes", description="episodes open on EnvService"):
                    await self._episode(episode, me)
            except asyncio.CancelledError:
                error = self.deadlines.expired(me)
                if error is None and episode.frames.ending:
                    raise  # the stream is going: nobody to tell
            except Exception as exc:  # the episode's failure, told in its closing frame; the stream goes on
                if not isinstance(exc, YieldloopError):
                    log.exception("unexpected error in an episode of StreamEpisodes")
                error = as_yieldloop_error(exc)
            finally:
                self.deadlines.forget(me)
                episode.frames.episodes.pop(episode.tag, None)
            if error is not None:
                if span is not None:
                    telemetry.record_error(error.code, error.reason, error.message)
                closing.error.CopyFrom(pb.EpisodeError(**error.to_wire()))
        episode.frames.send(closing)

    async def _episode(self, context: grpc.aio.ServicerContext | _TaggedEpisode, me: asyncio.Task) -> None:
        loop = asyncio.get_running_loop()
        remaining = context.time_remaining()
        deadline = loop.time() + (remaining if remaining is not None else math.inf)
        watch, read, write = self.deadlines.watch, context.read, context.write
        # The host key is ours, so two streams that send the same episode_id never collide.
        key = uuid.uuid4().hex
        info: EnvInfo | None = None
        graded = False
        try:
            watch(me, deadline, "the episode", "EPISODE_DEADLINE")
            while (request := await read()) is not grpc.aio.EOF:
                if type(request) is Undecodable:  # the reader API bypasses the request-iterator check
                    raise request.refusal()
                action = request.WhichOneof("action")
                if graded and action in ("call_tool", "submit", "start"):  # the host closed it with its grade
                    raise protocol_error(_AFTER_SUBMIT[action])
                if action == "call_tool" and info is not None:
                    call = request.call_tool
                    name = call.name
                    watch(me, min(deadline, loop.time() + info.tool_timeout_s), "tool {!r}", "TOOL_DEADLINE", name)
                    try:
                        arguments = _json_object(call.arguments_json, "TOOL_ARGS_INVALID", "call_tool.arguments_json")
                        with telemetry.tool_call(name, "yieldloop.env.tool_call.duration"):
                            content, is_error = await self.host.call_tool(key, name, arguments)
                    except InvalidArgumentError as err:
                        if not call.errors_as_results or err.reason not in ("TOOL_NOT_FOUND", "TOOL_ARGS_INVALID"):
                            raise
                        content, is_error = f"{err.reason}: {err.message}", True
                    watch(me, deadline, "the episode", "EPISODE_DEADLINE")
                    response = pb.StreamEpisodeResponse()  # filled in place: a nested message built apart is copied
                    result = response.tool_result
                    result.call_id, result.content, result.is_error = call.call_id, content, is_error
                    await write(response)
                elif action == "start":
                    task = request.start.task
                    info = resolve_env(self.host.envs, task.env)
                    deadline = min(deadline, loop.time() + info.episode_timeout_s)
                    watch(me, deadline, "the episode", "EPISODE_DEADLINE")
                    args = _json_object(task.args_json, "SCENARIO_ARGS_INVALID", "start.task.args_json")
                    with telemetry.span("start", {"yieldloop.env": info.name, "yieldloop.scenario": task.scenario}):
                        opened = await self.host.open(info.name, task.scenario, args, key)
                    response = pb.StreamEpisodeResponse()
                    started = response.started
                    started.MergeFrom(self.started(info))  # the tools, copied in C
                    started.episode_id = request.start.episode_id or key
                    fill_prompt(started, opened)
                    await write(response)
                elif info is None:
                    raise protocol_error(f"{action or 'an empty message'} before start")
                elif action == "submit":
                    submit = request.submit
                    completion = None
                    if submit.stop_reason or submit.completion_token_ids:
                        completion = FinalCompletion(
                            submit.answer, tuple(submit.completion_token_ids), StopReason.label(submit.stop_reason)
                        )
                    with telemetry.span("grade") as span:
                        graded = True  # nothing may follow a submit: the host may end the episode with its grade
                        grade = await self.host.submit(key, submit.answer, completion)
                        if span is not None:
                            span.set_attribute("yieldloop.reward", grade.reward)
                    info_json = {"subscores": grade.subscores, **grade.info} if grade.subscores else grade.info
                    response = pb.StreamEpisodeResponse()
                    graded = response.graded
                    graded.reward = grade.reward
                    graded.info_json = json.dumps(info_json, default=str) if info_json else "{}"
                    await write(response)
                else:
                    raise protocol_error("empty request")
        finally:
            # Teardown runs however the stream ends: done, error, deadline or a vanished client,
            # and no deadline interrupts it.
            watch(me, math.inf, "", "")
            if self.host.is_open(key):  # (closed with its grade by a worker: nothing to wait for)
                await asyncio.shield(self.host.close(key))
