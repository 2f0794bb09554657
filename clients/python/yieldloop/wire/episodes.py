"""Episode sessions over EnvService: one StreamEpisode stream each, or tags multiplexed on shared StreamEpisodes
streams (``Client(multiplex_episodes=True)``). Their methods take and return domain types
(:class:`~yieldloop.types.EpisodeStarted`, :class:`~yieldloop.types.ToolResult`,
:class:`~yieldloop.types.EpisodeGraded`).
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
from collections.abc import Sequence
from typing import Any

import grpc

from yieldloop.convert import from_pb
from yieldloop.errors import FailedPreconditionError, UnavailableError, YieldloopError, error_from_wire
from yieldloop.proto.common.v1 import common_pb2 as common_pb
from yieldloop.proto.env.v1 import env_service_pb2 as env_pb
from yieldloop.proto.env.v1 import env_service_pb2_grpc as env_grpc
from yieldloop.types import EpisodeGraded, EpisodeStarted, ToolResult
from yieldloop.wire.calls import CallStatus


class _Episode:
    """What an episode session offers (start, call tools, submit); subclasses carry its messages."""

    _task: common_pb.Task
    started: EpisodeStarted | None

    async def _exchange(self, request: env_pb.StreamEpisodeRequest, last: bool = False) -> env_pb.StreamEpisodeResponse:
        """Sends ``request`` and returns its response; ``last``: the episode ends with it (the submit)."""
        raise NotImplementedError

    async def start(self) -> EpisodeStarted:
        response = await self._exchange(env_pb.StreamEpisodeRequest(start=env_pb.StartEpisode(task=self._task)))
        self.started = from_pb(EpisodeStarted, response.started)
        return self.started

    async def call_tool(
        self, name: str, arguments_json: str = "{}", call_id: str = "", *, errors_as_results: bool = False
    ) -> ToolResult:
        """Calls a tool; with ``errors_as_results`` an unknown tool or bad arguments come back as an
        error result (``is_error``) instead of failing the episode."""
        request = env_pb.StreamEpisodeRequest()
        call = request.call_tool  # filled in place: no copy of a nested message
        call.call_id, call.name, call.arguments_json = call_id, name, arguments_json
        call.errors_as_results = errors_as_results
        return from_pb(ToolResult, (await self._exchange(request)).tool_result)

    async def submit(
        self, answer: str, *, stop_reason: int = 0, completion_token_ids: Sequence[int] = ()
    ) -> EpisodeGraded:
        """Submits the answer, with how the model's final turn ended and its token ids when known (the
        scenario sees them as ``ctx.completion``)."""
        request = env_pb.StreamEpisodeRequest(
            submit=env_pb.SubmitAnswer(
                answer=answer, stop_reason=int(stop_reason), completion_token_ids=completion_token_ids
            )
        )
        return from_pb(EpisodeGraded, (await self._exchange(request, last=True)).graded)

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> _Episode:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class EpisodeSession(_Episode):
    """One EnvService episode over a bidi stream of its own: start, call tools, submit."""

    def __init__(self, stub: env_grpc.EnvServiceStub, task: common_pb.Task, timeout: float | None) -> None:
        self._call = stub.StreamEpisode(timeout=timeout)
        self._status = CallStatus(self._call)
        self._task = task
        self.started = None

    async def _exchange(self, request: env_pb.StreamEpisodeRequest, last: bool = False) -> env_pb.StreamEpisodeResponse:
        try:
            await self._call.write(request)
            response = await self._call.read()
        except grpc.aio.AioRpcError as err:
            raise await self._status.error(err) from None
        except asyncio.InvalidStateError:  # the call already ended (deadline, server error): say how
            raise await self._status.error() from None
        if response is grpc.aio.EOF:  # a failed call raises from read(); EOF means an OK close
            raise _closed_early()
        if last:
            await self._call.done_writing()  # the server ends the stream once we half-close
        return response

    async def close(self) -> None:
        self._call.cancel()


def _closed_early() -> FailedPreconditionError:
    return FailedPreconditionError("episode stream closed early", reason="EPISODE_PROTOCOL")


class _EpisodeStream:
    """One StreamEpisodes stream and the episodes open on it: frames that are ready together leave in one
    message; a failure of the stream fails them all (and the stream is not used again)."""

    def __init__(self, stub: Any) -> None:
        # Opened outside the caller's context: the stream serves many episodes, and belongs to no one's trace.
        detached = contextvars.Context()
        self._call = detached.run(stub.StreamEpisodes)
        self._status = CallStatus(self._call)
        self.sessions: dict[int, MultiplexedEpisode] = {}
        self.alive = True
        self._out: list[env_pb.EpisodeRequestFrame] = []
        self._ready = asyncio.Event()
        self._tasks = (
            asyncio.create_task(self._write_loop(), context=detached),
            asyncio.create_task(self._read_loop(), context=detached),
        )

    def send(self, frame: env_pb.EpisodeRequestFrame) -> None:
        if self.alive:
            self._out.append(frame)
            self._ready.set()

    async def _write_loop(self) -> None:
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                if self._out:
                    frames, self._out = self._out, []
                    await self._call.write(env_pb.StreamEpisodesRequest(frames=frames))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the stream failed: the read loop reports it to every episode open on it

    async def _read_loop(self) -> None:
        error: YieldloopError | None = None
        try:
            while (response := await self._call.read()) is not grpc.aio.EOF:
                for frame in response.frames:
                    session = self.sessions.get(frame.tag)
                    if session is None:
                        continue
                    if frame.HasField("response"):
                        session._deliver(frame.response)
                    if frame.closed:
                        del self.sessions[frame.tag]
                        ended = error_from_wire(
                            dict(
                                code=frame.error.code,
                                message=frame.error.message,
                                reason=frame.error.reason,
                                field=frame.error.field,
                            )
                        )
                        session._ended(ended if frame.HasField("error") else None)
            error = UnavailableError("EnvService ended the episode stream", reason="EPISODE_STREAM_LOST")
        except grpc.aio.AioRpcError as err:
            error = await self._status.error(err)
        finally:
            self.alive, self._out = False, []
            self._tasks[0].cancel()
            sessions, self.sessions = self.sessions, {}
            for session in sessions.values():
                session._ended(error or UnavailableError("the episode stream was closed", reason="EPISODE_STREAM_LOST"))

    async def close(self) -> None:
        self._call.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class EpisodeStreams:
    """The StreamEpisodes streams to one EnvService address (see ``Client(multiplex_episodes=True)``): an episode
    joins the least busy stream, and a new stream opens when each has ``per_stream`` episodes open, so behind
    one address that balances calls (``dns:///`` with round_robin) episodes still spread over the replicas."""

    def __init__(self, stub: Any, trace_context: Any = None, per_stream: int = 64) -> None:
        self._stub = stub
        self.trace_context = trace_context
        self.per_stream = per_stream
        self._streams: list[_EpisodeStream] = []
        self._tags = itertools.count(1)

    def open(self, session: MultiplexedEpisode) -> tuple[_EpisodeStream, int]:
        """The stream ``session`` runs on and its tag there."""
        self._streams = [stream for stream in self._streams if stream.alive]
        stream = min(self._streams, key=lambda s: len(s.sessions), default=None)
        if stream is None or len(stream.sessions) >= self.per_stream:
            stream = _EpisodeStream(self._stub())
            self._streams.append(stream)
        tag = next(self._tags)
        stream.sessions[tag] = session
        return stream, tag

    async def close(self) -> None:
        for stream in self._streams:
            await stream.close()
        self._streams.clear()


class MultiplexedEpisode(_Episode):
    """One EnvService episode as a tag on a shared StreamEpisodes stream; the same methods and errors as
    :class:`EpisodeSession`."""

    def __init__(self, streams: EpisodeStreams, task: common_pb.Task) -> None:
        self._streams = streams
        self._stream: _EpisodeStream | None = None
        self._task = task
        self._tag = 0
        self._waiter: asyncio.Future | None = None
        self._done = False  # the server closed the episode, or the client did
        self._error: YieldloopError | None = None
        self.started = None

    def _deliver(self, response: env_pb.StreamEpisodeResponse) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(response)

    def _ended(self, error: YieldloopError | None) -> None:
        self._done, self._error = True, error
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(error or _closed_early())

    async def _exchange(self, request: env_pb.StreamEpisodeRequest, last: bool = False) -> env_pb.StreamEpisodeResponse:
        if self._done:
            raise self._error or _closed_early()
        frame = env_pb.EpisodeRequestFrame(
            request=request, close=last
        )  # the submit's close: StreamEpisode's half-close
        if self._stream is None:
            self._stream, self._tag = self._streams.open(self)
            if self._streams.trace_context is not None:
                frame.trace_context.update(self._streams.trace_context())
        frame.tag = self._tag
        self._waiter = asyncio.get_running_loop().create_future()
        self._stream.send(frame)
        try:
            return await self._waiter
        finally:
            self._waiter = None
            self._done = self._done or last

    async def close(self) -> None:
        if self._stream is not None and not self._done:
            self._done = True
            self._stream.send(env_pb.EpisodeRequestFrame(tag=self._tag, close=True))
