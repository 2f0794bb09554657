"""The async client over all four services.

Example::

    async with Client(env="127.0.0.1:7001", rollout="127.0.0.1:7002",
                      trainer="127.0.0.1:7003", checkpoint="127.0.0.1:7004") as client:
        runs = [run async for run in client.stream_rollouts([task], group_size=8)]
        await client.forward_backward(runs=runs, loss_fn="importance_sampling")
        step = await client.optim_step(learning_rate=1e-4, set_head=True)

Methods are snake_case wrappers of the PascalCase RPCs. What callers work
with comes back as domain types (:mod:`yieldloop.types`: Run, JobInfo, Manifest,
Head, Datum); responses that are only read come back as the protobuf messages.
Inputs take either form. A failed call raises a subclass of
:class:`yieldloop.errors.YieldloopError` carrying the gRPC code and the
``ErrorInfo`` reason.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import dataclasses
import functools
import itertools
import pathlib
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import grpc

from yieldloop._status import error_from_rpc
from yieldloop.convert import (
    datum_from_pb,
    datum_to_pb,
    head_from_pb,
    job_from_pb,
    lora_to_pb,
    manifest_from_pb,
    manifest_to_pb,
    model_from_pb,
    run_from_pb,
    run_to_pb,
)
from yieldloop.environment import Task
from yieldloop.errors import (
    FailedPreconditionError,
    NotFoundError,
    UnavailableError,
    YieldloopError,
    error_from_wire,
    invalid_field,
)
from yieldloop.groups import split_whole_groups
from yieldloop.proto.checkpoint.v1 import checkpoint_service_pb2 as ckpt_pb
from yieldloop.proto.checkpoint.v1 import checkpoint_service_pb2_grpc as ckpt_grpc
from yieldloop.proto.common.v1 import common_pb2 as common_pb
from yieldloop.proto.env.v1 import env_service_pb2 as env_pb
from yieldloop.proto.env.v1 import env_service_pb2_grpc as env_grpc
from yieldloop.proto.rollout.v1 import rollout_service_pb2 as rollout_pb
from yieldloop.proto.rollout.v1 import rollout_service_pb2_grpc as rollout_grpc
from yieldloop.proto.trainer.v1 import trainer_service_pb2 as trainer_pb
from yieldloop.proto.trainer.v1 import trainer_service_pb2_grpc as trainer_grpc
from yieldloop.retry import Backoff
from yieldloop.transport import DEFAULT_TRANSPORT, TransportConfig, open_channel
from yieldloop.types import Datum, Head, JobInfo, LoraConfig, Manifest, ModelInfo, Run

RETRY = Backoff(initial_s=0.25, max_s=5.0)
"""Between retries of a repeatable call while its service is unavailable (a restart takes seconds)."""
SERVICES = ("checkpoint", "env", "trainer", "rollout")
"""The four services, in the order a stack starts them (each calls only those before it)."""


def task_to_proto(task: Task | common_pb.Task) -> common_pb.Task:
    if isinstance(task, common_pb.Task):
        return task
    return common_pb.Task(env=task.env, scenario=task.scenario, args_json=task.args_json, task_id=task.task_id)


def sampling_params(**kwargs: Any) -> rollout_pb.SamplingParams:
    """SamplingParams from keyword arguments (temperature, top_p, top_k, max_tokens, stop, seed, ignore_eos)."""
    return rollout_pb.SamplingParams(**kwargs)


@dataclasses.dataclass
class Completion:
    """A whole generation gathered from the Generate stream."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    weight_version: str
    stop_reason: int


_CORE_INTERNAL = "Internal error from Core"  # grpcio's status for a write that failed in core
_SERVER_STATUS_WITHIN_S = 5.0
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


class _CallStatus:
    """A streaming call's status as the server sent it, for its typed error.

    grpc/grpc#36066: when the server ends a client-streaming or bidi call while the client is still
    sending (an interceptor refusing it, a validation error), the write that fails sets the call's status
    to INTERNAL "Internal error from Core" and raises it (or a later write raises
    asyncio.InvalidStateError). That status may replace the server's, already received, or be replaced by
    it a moment later. A done callback runs at every status the call is given: this keeps the first that
    is not core's (grpcio keeps the current one in the call's ``_status``; without it, the call's status
    is used as before) and, for a failure that reads as core's, waits a moment for the server's.
    """

    def __init__(self, call: Any) -> None:
        self.call = call
        self._server: Any = None
        """The first status the server sent (grpcio's own status object: its AioRpcError is built only when
        :meth:`error` asks, not for the calls that end well)."""
        self._arrived = asyncio.Event()
        call.add_done_callback(self._on_status)

    def _on_status(self, call: Any) -> None:
        status = getattr(getattr(call, "_cython_call", None), "_status", None)
        if self._server is not None or status is None or status.details() == _CORE_INTERNAL:
            return
        self._server = status
        self._arrived.set()

    async def error(self, err: grpc.aio.AioRpcError | None = None) -> YieldloopError:
        """The typed error of the failed call, from the server's status where it sent one."""
        call = self.call
        if self._server is None and await call.details() == _CORE_INTERNAL:
            try:
                await asyncio.wait_for(self._arrived.wait(), _SERVER_STATUS_WITHIN_S)
            except TimeoutError:  # no status from the server (the connection broke): core's stands
                pass
        if self._server is not None:
            status = self._server
            err = grpc.aio.AioRpcError(
                _STATUS_CODES.get(status.code(), grpc.StatusCode.UNKNOWN),
                grpc.aio.Metadata(),
                grpc.aio.Metadata(*(status.trailing_metadata() or ())),
                status.details(),
            )
        elif err is None:
            err = grpc.aio.AioRpcError(
                await call.code(), grpc.aio.Metadata(), await call.trailing_metadata(), await call.details()
            )
        return error_from_rpc(err)


async def _unary(method: Any, request: Any, timeout: float | None = None) -> Any:
    """Calls a unary-response RPC (``request`` may be an iterator for client streams).

    An exception raised while producing a client stream's messages is raised as itself: grpc would cancel
    the call and report only CANCELLED.
    """
    failure: list[Exception] = []
    streaming = hasattr(request, "__iter__")  # a client stream (protobuf messages are not iterable)
    if streaming:
        request = _recording(request, failure)
    call = method(request, timeout=timeout)
    status = _CallStatus(call) if streaming else None
    try:
        return await call
    except asyncio.CancelledError:
        if failure:
            raise failure[0] from None
        raise
    except grpc.aio.AioRpcError as err:
        if failure:
            raise failure[0] from None
        raise (await status.error(err) if status else error_from_rpc(err)) from None


def _recording(requests: Iterable[Any], failure: list[Exception]) -> Iterable[Any]:
    try:
        yield from requests
    except Exception as exc:  # kept for _unary, which raises it instead of grpc's CANCELLED
        failure.append(exc)
        raise


async def _stream(call: Any) -> AsyncIterator[Any]:
    try:
        async for item in call:
            yield item
    except grpc.aio.AioRpcError as err:
        raise error_from_rpc(err) from None  # a unary request: sent whole, before any status (no #36066)
    finally:
        call.cancel()


class _Episode:
    """What an episode session offers (start, call tools, submit); subclasses carry its messages."""

    _task: common_pb.Task
    started: env_pb.EpisodeStarted | None

    async def _exchange(self, request: env_pb.StreamEpisodeRequest, last: bool = False) -> env_pb.StreamEpisodeResponse:
        """Sends ``request`` and returns its response; ``last``: the episode ends with it (the submit)."""
        raise NotImplementedError

    async def start(self) -> env_pb.EpisodeStarted:
        response = await self._exchange(env_pb.StreamEpisodeRequest(start=env_pb.StartEpisode(task=self._task)))
        self.started = response.started
        return response.started

    async def call_tool(
        self, name: str, arguments_json: str = "{}", call_id: str = "", *, errors_as_results: bool = False
    ) -> env_pb.ToolResult:
        """Calls a tool; with ``errors_as_results`` an unknown tool or bad arguments come back as an
        error result (``is_error``) instead of failing the episode."""
        request = env_pb.StreamEpisodeRequest()
        call = request.call_tool  # filled in place: no copy of a nested message
        call.call_id, call.name, call.arguments_json = call_id, name, arguments_json
        call.errors_as_results = errors_as_results
        return (await self._exchange(request)).tool_result

    async def submit(
        self, answer: str, *, stop_reason: int = 0, completion_token_ids: Sequence[int] = ()
    ) -> env_pb.EpisodeGraded:
        """Submits the answer, with how the model's final turn ended and its token ids when known (the
        scenario sees them as ``ctx.completion``)."""
        request = env_pb.StreamEpisodeRequest(
            submit=env_pb.SubmitAnswer(
                answer=answer, stop_reason=int(stop_reason), completion_token_ids=completion_token_ids
            )
        )
        return (await self._exchange(request, last=True)).graded

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
        self._status = _CallStatus(self._call)
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
        self._status = _CallStatus(self._call)
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
                        session.deliver(frame.response)
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
                        session.ended(ended if frame.HasField("error") else None)
            error = UnavailableError("EnvService ended the episode stream", reason="EPISODE_STREAM_LOST")
        except grpc.aio.AioRpcError as err:
            error = await self._status.error(err)
        finally:
            self.alive, self._out = False, []
            self._tasks[0].cancel()
            sessions, self.sessions = self.sessions, {}
            for session in sessions.values():
                session.ended(error or UnavailableError("the episode stream was closed", reason="EPISODE_STREAM_LOST"))

    async def close(self) -> None:
        self._call.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class _EpisodeStreams:
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

    def __init__(self, streams: _EpisodeStreams, task: common_pb.Task) -> None:
        self._streams = streams
        self._stream: _EpisodeStream | None = None
        self._task = task
        self._tag = 0
        self._waiter: asyncio.Future | None = None
        self._done = False  # the server closed the episode, or the client did
        self._error: YieldloopError | None = None
        self.started = None

    def deliver(self, response: env_pb.StreamEpisodeResponse) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(response)

    def ended(self, error: YieldloopError | None) -> None:
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


class _Keyed:
    """A stub whose methods add call metadata (the API key) to every call."""

    def __init__(self, stub: Any, metadata: tuple[tuple[str, str], ...]) -> None:
        self._stub, self._metadata = stub, metadata

    def __getattr__(self, name: str) -> Any:
        return functools.partial(getattr(self._stub, name), metadata=self._metadata)


class Client:
    """Async client for EnvService, RolloutService, TrainerService and CheckpointService.

    Args:
        env, rollout, trainer, checkpoint: ``host:port`` (or ``dns:///host:port``
            for round-robin across replicas) of each service; a service left
            out raises FailedPreconditionError when used. ``env`` may name
            several EnvService replicas (a list, or comma-separated): episodes
            are spread across them in turn.
        timeout: Default deadline in seconds for unary calls (None: no deadline).
        transport: How channels are built (message limits, interceptors; see :mod:`yieldloop.transport`).
        api_key: Sent with every call (``authorization: Bearer``); overrides ``transport.api_key``.
        retry_within_s: How long calls that are safe to repeat (an OptimStep with its idempotency key, a
            CommitCheckpoint of the same manifest) are retried while their service is UNAVAILABLE (restarting),
            with backoff and jitter (:class:`yieldloop.retry.Backoff`); 0: never.
        multiplex_episodes: Episodes without a timeout of their own share one StreamEpisodes stream per
            EnvService replica instead of a StreamEpisode stream each (for many episodes at once: a stream costs
            more than its messages); the same methods and errors either way.
    """

    def __init__(
        self,
        env: str | Sequence[str] | None = None,
        rollout: str | None = None,
        trainer: str | None = None,
        checkpoint: str | None = None,
        *,
        timeout: float | None = None,
        transport: TransportConfig = DEFAULT_TRANSPORT,
        retry_within_s: float = 120.0,
        api_key: str | None = None,
        multiplex_episodes: bool = False,
    ) -> None:
        self.timeout = timeout
        self.multiplex_episodes = multiplex_episodes
        self._episode_streams: dict[tuple[str, int], _EpisodeStreams] = {}
        self.transport = transport if api_key is None else dataclasses.replace(transport, api_key=api_key)
        self._metadata = (("authorization", f"Bearer {self.transport.api_key}"),) if self.transport.api_key else ()
        self.retry_within_s = retry_within_s
        self._channels: dict[tuple[str, int], grpc.aio.Channel] = {}
        self._stubs: dict[tuple[Any, int], Any] = {}
        self._owns_channels = True
        envs = [env] if isinstance(env, str) else list(env or ())
        self._env_addresses = [a.strip() for item in envs for a in item.split(",") if a.strip()]
        # (address, connection): episodes take every replica in turn, then each replica's next connection
        self._env_targets = [
            (address, connection)
            for connection in range(max(1, self.transport.env_connections))
            for address in self._env_addresses
        ]
        self._next_env = itertools.count()
        self._addresses = {"rollout": rollout, "trainer": trainer, "checkpoint": checkpoint}

    def with_api_key(self, api_key: str) -> Client:
        """This client calling with ``api_key`` instead, over the same channels (a front that acts for its callers
        forwards each caller's key). Closing it closes nothing: the channels stay this client's."""
        clone = copy.copy(self)
        clone.transport = dataclasses.replace(self.transport, api_key=api_key)
        clone._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        clone._owns_channels, clone._stubs = False, {}
        clone.multiplex_episodes, clone._episode_streams = False, {}  # a shared stream is one caller's
        return clone

    def has(self, service: str) -> bool:
        """Whether this client was given an address for ``service``."""
        return bool(self._env_addresses if service == "env" else self._addresses.get(service))

    async def _repeatable(self, method: Any, request: Any) -> Any:
        """A unary call that is safe to repeat, retried while its service is UNAVAILABLE (see ``retry_within_s``)."""
        deadline = time.monotonic() + self.retry_within_s
        for attempt in itertools.count():
            try:
                return await _unary(method, request, self.timeout)
            except UnavailableError:
                wait = RETRY.delay(attempt)
                if time.monotonic() + wait > deadline:
                    raise
                await asyncio.sleep(wait)

    def _channel(self, service: str, address: str | None = None, connection: int = 0) -> grpc.aio.Channel:
        """The channel to ``address`` (default: the service's); channels of other ``connection`` numbers to the same
        address are connections of their own."""
        address = address or self._addresses.get(service)
        if not address:
            raise FailedPreconditionError(f"no address given for the {service} service", reason="INVALID_FIELD")
        key = (address, connection)
        if key not in self._channels:
            self._channels[key] = open_channel(address, self.transport)
        return self._channels[key]

    def _stub(self, kind: Any, channel: grpc.aio.Channel) -> Any:
        """A stub whose every call carries the API key (``authorization: Bearer``) as call metadata: gRPC's core
        sends it with the call's headers, nothing per message (an interceptor would put Python on every message
        of every stream). Built once per service and channel: a stub builds a callable for each of its methods."""
        key = (kind, id(channel))
        stub = self._stubs.get(key)
        if stub is None:
            stub = self._stubs[key] = _Keyed(kind(channel), self._metadata) if self._metadata else kind(channel)
        return stub

    @property
    def env_stub(self) -> env_grpc.EnvServiceStub:
        """A stub for the next EnvService replica (round robin)."""
        return self._env_stub(self._next_env_target())

    def _next_env_target(self) -> tuple[str, int]:
        """The next (replica address, connection) in turn (``transport.env_connections`` per address)."""
        if not self._env_targets:
            self._channel("env")  # raises: no address
        return self._env_targets[next(self._next_env) % len(self._env_targets)]

    def _env_stub(self, target: tuple[str, int]) -> env_grpc.EnvServiceStub:
        return self._stub(env_grpc.EnvServiceStub, self._channel("env", *target))

    @property
    def rollout_stub(self) -> rollout_grpc.RolloutServiceStub:
        return self._stub(rollout_grpc.RolloutServiceStub, self._channel("rollout"))

    @property
    def trainer_stub(self) -> trainer_grpc.TrainerServiceStub:
        return self._stub(trainer_grpc.TrainerServiceStub, self._channel("trainer"))

    @property
    def checkpoint_stub(self) -> ckpt_grpc.CheckpointServiceStub:
        return self._stub(ckpt_grpc.CheckpointServiceStub, self._channel("checkpoint"))

    async def close(self) -> None:
        if not self._owns_channels:
            return
        for streams in self._episode_streams.values():
            await streams.close()
        self._episode_streams.clear()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._stubs.clear()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # EnvService ------------------------------------------------------------------

    async def list_scenarios(self, env: str = "") -> env_pb.ListScenariosResponse:
        return await _unary(self.env_stub.ListScenarios, env_pb.ListScenariosRequest(env=env), self.timeout)

    def episode(self, task: Task | common_pb.Task, timeout: float | None = None) -> EpisodeSession | MultiplexedEpisode:
        """An episode session; ``async with client.episode(task) as ep`` starts it. ``timeout`` bounds the
        whole episode (its own stream's deadline; such an episode is never multiplexed)."""
        target = self._next_env_target()
        if self.multiplex_episodes and timeout is None:
            streams = self._episode_streams.get(target)
            if streams is None:
                streams = self._episode_streams[target] = _EpisodeStreams(
                    functools.partial(self._env_stub, target), self.transport.trace_context
                )
            return MultiplexedEpisode(streams, task_to_proto(task))
        return EpisodeSession(self._env_stub(target), task_to_proto(task), timeout)

    # RolloutService ----------------------------------------------------------------

    def generate_stream(
        self,
        prompt_token_ids: Sequence[int] | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        sampling: rollout_pb.SamplingParams | None = None,
        model: str = "",
        timeout: float | None = None,
    ) -> AsyncIterator[rollout_pb.GenerateResponse]:
        """Streams Generate deltas for token ids or chat messages (exactly one of them)."""
        if (prompt_token_ids is None) == (messages is None):
            raise invalid_field("prompt", "give exactly one of prompt_token_ids and messages")
        request = rollout_pb.GenerateRequest(model=model, sampling=sampling or sampling_params(max_tokens=16))
        if messages is not None:
            request.chat.messages.extend(common_pb.ChatMessage(**m) for m in messages)
        else:
            request.prompt_token_ids.token_ids.extend(prompt_token_ids)
        return _stream(self.rollout_stub.Generate(request, timeout=timeout))

    async def generate(self, prompt_token_ids: Sequence[int] | None = None, **kwargs: Any) -> Completion:
        """Runs Generate to completion and gathers the deltas."""
        result = Completion([], [], [], "", 0)
        async for delta in self.generate_stream(prompt_token_ids, **kwargs):
            result.prompt_token_ids.extend(delta.prompt_token_ids)
            result.token_ids.extend(delta.token_ids)
            result.logprobs.extend(delta.logprobs)
            result.weight_version = delta.weight_version or result.weight_version
            if delta.finished:
                result.stop_reason = delta.stop_reason
        return result

    async def stream_rollouts(
        self,
        tasks: Iterable[Task | common_pb.Task],
        *,
        group_size: int = 1,
        max_concurrent: int = 0,
        sampling: rollout_pb.SamplingParams | None = None,
        job_id: str = "",
        max_steps: int = 0,
        episode_timeout_s: float = 0.0,
        max_attempts: int = 0,
        checkpoint_id: str = "",
        model: str = "",
        timeout: float | None = None,
    ) -> AsyncIterator[Run]:
        """Runs tasks x group_size episodes and yields Runs as they finish.

        ``max_steps`` bounds model turns per episode (0: 8), ``episode_timeout_s`` its wall clock (0:
        the environment's own), ``max_attempts`` the tries when infrastructure fails (0: 3).
        ``checkpoint_id`` samples that checkpoint instead of the served head (a candidate's evaluation).
        ``model`` names the slug sampled (empty: the rollout service's default model).
        """
        request = rollout_pb.StreamRolloutsRequest(
            tasks=[task_to_proto(t) for t in tasks],
            group_size=group_size,
            max_concurrent=max_concurrent,
            sampling=sampling or sampling_params(temperature=1.0, max_tokens=16),
            job_id=job_id,
            max_steps=max_steps,
            episode_timeout_s=episode_timeout_s,
            max_attempts=max_attempts,
            checkpoint_id=checkpoint_id,
            model=model,
        )
        async for response in _stream(self.rollout_stub.StreamRollouts(request, timeout=timeout)):
            yield run_from_pb(response.run)

    async def create_job(
        self, model: str = "", name: str = "", group_size: int = 0, metadata_json: str = ""
    ) -> JobInfo:
        request = rollout_pb.CreateJobRequest(
            model=model, name=name, group_size=group_size, metadata_json=metadata_json
        )
        return job_from_pb((await _unary(self.rollout_stub.CreateJob, request, self.timeout)).job)

    async def list_jobs(self) -> list[JobInfo]:
        response = await _unary(self.rollout_stub.ListJobs, rollout_pb.ListJobsRequest(), self.timeout)
        return [job_from_pb(job) for job in response.jobs]

    async def job_runs(self, job_id: str) -> AsyncIterator[Run]:
        """Yields a job's recorded runs in the order they were recorded."""
        request = rollout_pb.StreamJobRunsRequest(job_id=job_id)
        async for response in _stream(self.rollout_stub.StreamJobRuns(request, timeout=self.timeout)):
            yield run_from_pb(response.run)

    async def get_runs(self, trace_ids: Iterable[str]) -> list[Run]:
        """Reads persisted runs back from the trace store."""
        request = rollout_pb.GetRunsRequest(trace_ids=list(trace_ids))
        return [run_from_pb(run) for run in (await _unary(self.rollout_stub.GetRuns, request, self.timeout)).runs]

    async def get_trace_spans(self, trace_id: str) -> list[rollout_pb.TraceSpan]:
        """The spans recorded for a run's trace (a stack started with ``--record-spans``), oldest first."""
        request = rollout_pb.GetTraceSpansRequest(trace_id=trace_id)
        return list((await _unary(self.rollout_stub.GetTraceSpans, request, self.timeout)).spans)

    async def get_serving_info(
        self, wait_for_checkpoint_id: str = "", timeout: float | None = None, model: str = ""
    ) -> rollout_pb.GetServingInfoResponse:
        """What serves ``model`` (empty: the default model); with ``wait_for_checkpoint_id``, once it serves that."""
        request = rollout_pb.GetServingInfoRequest(wait_for_checkpoint_id=wait_for_checkpoint_id, model=model)
        return await _unary(self.rollout_stub.GetServingInfo, request, timeout or self.timeout)

    # TrainerService ----------------------------------------------------------------

    async def forward_backward(
        self,
        *,
        runs: Iterable[Run | common_pb.Run | str] = (),
        datums: Iterable[Datum | common_pb.Datum] = (),
        loss_fn: str = "importance_sampling",
        loss_fn_config: Mapping[str, float] | None = None,
        normalize_advantages_by_std: bool = False,
        drop_groups_without_signal: bool = False,
        reward_scale: float = 1.0,
        group_size: int = 0,
        allow_incomplete_groups: bool = False,
        model: str = "",
    ) -> trainer_pb.ForwardBackwardResponse:
        """Streams a config then runs (Run messages or trace ids, interchangeably) and/or datums.

        Gradients accumulate until optim_step. ``model`` names the slug trained (empty: the trainer's default).

        Runs become datums with GRPO advantages (reward * reward_scale minus the group mean, optionally
        divided by the group's std); with ``group_size`` a group of another size is refused unless
        ``allow_incomplete_groups``.
        """
        config = trainer_pb.ForwardBackwardConfig(
            loss_fn=loss_fn,
            loss_fn_config=dict(loss_fn_config or {}),
            normalize_advantages_by_std=normalize_advantages_by_std,
            drop_groups_without_signal=drop_groups_without_signal,
            reward_scale=reward_scale,
            group_size=group_size,
            allow_incomplete_groups=allow_incomplete_groups,
            model=model,
        )

        def requests() -> Iterable[trainer_pb.ForwardBackwardRequest]:
            yield trainer_pb.ForwardBackwardRequest(config=config)
            for run in runs:
                if isinstance(run, str):
                    yield trainer_pb.ForwardBackwardRequest(trace_id=run)
                else:
                    yield trainer_pb.ForwardBackwardRequest(run=run_to_pb(run))
            for datum in datums:
                yield trainer_pb.ForwardBackwardRequest(datum=datum_to_pb(datum))

        return await _unary(self.trainer_stub.ForwardBackward, requests(), self.timeout)

    async def forward_scored(
        self,
        *,
        runs: Iterable[Run | common_pb.Run] = (),
        datums: Iterable[Datum | common_pb.Datum] = (),
        model: str = "",
    ) -> list[tuple[Datum, list[float]]]:
        """For each run, then each datum: the datum scored (runs with their group-centred advantages) and the
        learner's logprob of each of its targets (no gradient)."""

        def requests() -> Iterable[trainer_pb.ForwardRequest]:
            for run in runs:
                yield trainer_pb.ForwardRequest(run=run_to_pb(run), model=model)
            for datum in datums:
                yield trainer_pb.ForwardRequest(datum=datum_to_pb(datum), model=model)

        response = await _unary(self.trainer_stub.Forward, requests(), self.timeout)
        return [(datum_from_pb(result.datum), list(result.logprobs)) for result in response.results]

    async def forward(
        self,
        *,
        runs: Iterable[Run | common_pb.Run] = (),
        datums: Iterable[Datum | common_pb.Datum] = (),
        model: str = "",
    ) -> list[list[float]]:
        """The learner's per-target-token logprobs for each run, then each datum (no gradient)."""
        return [logprobs for _, logprobs in await self.forward_scored(runs=runs, datums=datums, model=model)]

    async def backward(self, datums: Iterable[Datum | common_pb.Datum], model: str = "") -> trainer_pb.BackwardResponse:
        """Accumulates the gradient of -(weights * logprob).sum() for datums whose weights are -d loss / d logprob
        (a custom loss: see :func:`yieldloop.training.forward_backward_custom`)."""
        requests = (trainer_pb.BackwardRequest(datum=datum_to_pb(d), model=model) for d in datums)
        return await _unary(self.trainer_stub.Backward, requests, self.timeout)

    async def optim_step(
        self,
        learning_rate: float,
        *,
        set_head: bool = True,
        metadata_json: str = "",
        skip_checkpoint: bool = False,
        model: str = "",
        idempotency_key: str = "",
        drop_gradients_if_refused: bool = False,
        save_state: bool = False,
        wait_durable: bool = False,
        **adam: float,
    ) -> trainer_pb.OptimStepResponse:
        """AdamW step (beta1, beta2, eps, weight_decay, max_grad_norm as keywords) and checkpoint commit.

        All or nothing (a refused or failed step leaves the trainer as before it); ``idempotency_key`` (a fresh
        one per call by default) makes a retried request return the first outcome. The head moves as soon as the
        checkpoint is committed (the fleet pulls the new weights from the trainer meanwhile) and the answer comes
        once the checkpoint is durable in the object store: an acknowledged step is never rolled back.
        ``wait_durable`` writes the checkpoint to the store before committing it (the head never names a pending
        checkpoint). ``save_state`` saves the full training state with this step (the trainer does so every few
        steps anyway, see ``--state-every``).
        """
        request = trainer_pb.OptimStepRequest(
            adam=trainer_pb.AdamParams(learning_rate=learning_rate, **adam),
            set_head=set_head,
            metadata_json=metadata_json,
            skip_checkpoint=skip_checkpoint,
            model=model,
            idempotency_key=idempotency_key or uuid.uuid4().hex,
            drop_gradients_if_refused=drop_gradients_if_refused,
            save_state=save_state,
            wait_durable=wait_durable,
        )
        return await self._repeatable(self.trainer_stub.OptimStep, request)

    async def discard_gradients(self, model: str = "") -> int:
        """Forgets the gradients accumulated for ``model`` since its last step (every caller's: e.g. after a step
        refused as NON_FINITE or HEAD_CONFLICT); returns how many datums they came from."""
        request = trainer_pb.DiscardGradientsRequest(model=model)
        return (await _unary(self.trainer_stub.DiscardGradients, request, self.timeout)).num_datums

    def pull_weights(
        self, model: str, checkpoint_id: str, host_id: str = "", probe: bool = False
    ) -> AsyncIterator[trainer_pb.PullWeightsResponse]:
        """The sampler weights of a checkpoint the trainer still holds (see TrainerService.PullWeights); with
        ``probe``, one empty message when it holds them (NOT_FOUND otherwise)."""
        request = trainer_pb.PullWeightsRequest(model=model, checkpoint_id=checkpoint_id, host_id=host_id, probe=probe)
        return _stream(self.trainer_stub.PullWeights(request, timeout=self.timeout))

    def subscribe_weights(
        self, model: str, backend: str = "gloo"
    ) -> AsyncIterator[trainer_pb.SubscribeWeightsResponse]:
        """Membership in the trainer's weight group for ``model``, for as long as the stream is read (see
        TrainerService.SubscribeWeights; no deadline)."""
        request = trainer_pb.SubscribeWeightsRequest(model=model, backend=backend)
        return _stream(self.trainer_stub.SubscribeWeights(request))

    async def train_step(
        self,
        runs: Sequence[Run | common_pb.Run | str],
        learning_rate: float,
        *,
        loss_fn: str = "importance_sampling",
        num_substeps: int = 1,
        set_head: bool = True,
        adam: Mapping[str, float] | None = None,
        model: str = "",
        timings: dict[str, float] | None = None,
        **forward_backward_options: Any,
    ) -> tuple[trainer_pb.OptimStepResponse, list[trainer_pb.ForwardBackwardResponse]]:
        """One training step on a batch: ``num_substeps`` optimizer steps on consecutive slices of it.

        The runs are split into ``num_substeps`` slices of whole groups (GRPO groups are never cut); each
        slice gets a forward_backward and an optimizer step; the last step writes the checkpoint (and moves
        HEAD when ``set_head``). Returns the last OptimStep response and every slice's metrics; adds the wall
        seconds of the forward_backward and optim_step calls to ``timings`` (``forward_backward_s``, ``optim_step_s``).
        """
        slices = split_whole_groups(runs, num_substeps)
        metrics, step = [], None
        spent = timings if timings is not None else {}
        for i, batch in enumerate(slices):
            started = time.perf_counter()
            metrics.append(
                await self.forward_backward(runs=batch, loss_fn=loss_fn, model=model, **forward_backward_options)
            )
            middle = time.perf_counter()
            last = i == len(slices) - 1
            step = await self.optim_step(
                learning_rate, set_head=set_head and last, skip_checkpoint=not last, model=model, **dict(adam or {})
            )
            spent["forward_backward_s"] = spent.get("forward_backward_s", 0.0) + middle - started
            spent["optim_step_s"] = spent.get("optim_step_s", 0.0) + time.perf_counter() - middle
        return step, metrics

    async def list_losses(self) -> trainer_pb.ListLossesResponse:
        return await _unary(self.trainer_stub.ListLosses, trainer_pb.ListLossesRequest(), self.timeout)

    async def get_trainer_info(self, model: str = "") -> trainer_pb.GetTrainerInfoResponse:
        request = trainer_pb.GetTrainerInfoRequest(model=model)
        return await _unary(self.trainer_stub.GetTrainerInfo, request, self.timeout)

    # CheckpointService ---------------------------------------------------------------

    async def list_models(self) -> ckpt_pb.ListModelsResponse:
        return await _unary(self.checkpoint_stub.ListModels, ckpt_pb.ListModelsRequest(), self.timeout)

    async def delete_model(self, model: str, force: bool = False) -> None:
        """Deletes a model (FAILED_PRECONDITION/MODEL_IN_USE while forks depend on it, unless ``force``)."""
        request = ckpt_pb.DeleteModelRequest(model=model, force=force)
        await _unary(self.checkpoint_stub.DeleteModel, request, self.timeout)

    async def get_model(self, model: str) -> ModelInfo:
        """One model's record (NOT_FOUND/MODEL_NOT_FOUND when there is none)."""
        response = await _unary(self.checkpoint_stub.GetModel, ckpt_pb.GetModelRequest(model=model), self.timeout)
        return model_from_pb(response.model)

    async def fork_model(
        self, source: str, name: str, owner: str = "", lora: LoraConfig | None = None
    ) -> ckpt_pb.ForkModelResponse:
        """Forks ``source`` (a slug or ``slug@checkpoint``) into ``name``: full fine-tuning, or with ``lora`` a
        LoRA fork training adapters only over the source's frozen weights."""
        request = ckpt_pb.ForkModelRequest(
            source=source, name=name, owner=owner, lora=lora_to_pb(lora) if lora is not None else None
        )
        return await _unary(self.checkpoint_stub.ForkModel, request, self.timeout)

    async def import_model(
        self, source: str, name: str, owner: str = "", public: bool = False, on_server: bool = False
    ) -> ckpt_pb.ImportModelResponse:
        """Imports a Hugging Face model as the base slug ``name``; its weights become the checkpoint "base" (HEAD).
        ``source`` is a folder on this machine (uploaded: :meth:`upload_model`) or a hub id ("org/name") in the
        checkpoint service's local Hugging Face cache; with ``on_server``, a folder on the service's machine (admin
        keys only, under the operator's ``--import-roots``). It belongs to the key's team (an admin names any
        ``owner``, and may make it ``public``: every team samples and forks it).

        Raises:
            NotFoundError: MODEL_SOURCE_NOT_FOUND for a path that is no folder here (without ``on_server``).
        """
        folder = pathlib.Path(source).expanduser()
        if not on_server:
            if folder.is_dir():
                return await self.upload_model(folder, name, owner, public, source=source)
            if source.startswith(("/", ".", "~")) or source.count("/") > 1 or "\\" in source:
                raise NotFoundError(
                    f"no folder {source!r} on this machine (a folder on the checkpoint service's "
                    "machine: on_server / --on-server, admin keys)",
                    reason="MODEL_SOURCE_NOT_FOUND",
                    field="source",
                )
        request = ckpt_pb.ImportModelRequest(source=source, name=name, owner=owner, public=public)
        return await _unary(self.checkpoint_stub.ImportModel, request, self.timeout)

    async def upload_model(
        self, folder: str | pathlib.Path, name: str, owner: str = "", public: bool = False, source: str = ""
    ) -> ckpt_pb.UploadModelResponse:
        """Uploads a Hugging Face model folder of this machine (its weights, configs, tokenizer files and chat
        templates, each with its sha256) and imports it as the base slug ``name`` (see :meth:`import_model`)."""
        from yieldloop.uploads import upload_header, upload_requests

        folder = pathlib.Path(folder).expanduser()
        header = await asyncio.to_thread(upload_header, folder, name, owner, public, source)
        return await _unary(self.checkpoint_stub.UploadModel, upload_requests(folder, header), self.timeout)

    # API keys (admin keys only) -------------------------------------------------------------------------

    async def create_api_key(self, team: str, role: str, name: str = "") -> ckpt_pb.CreateApiKeyResponse:
        """A new key for ``team`` with ``role`` (sample, train or admin); ``api_key`` is shown this once."""
        request = ckpt_pb.CreateApiKeyRequest(team=team, role=role, name=name)
        return await _unary(self.checkpoint_stub.CreateApiKey, request, self.timeout)

    async def list_api_keys(self) -> list[ckpt_pb.ApiKeyInfo]:
        return list((await _unary(self.checkpoint_stub.ListApiKeys, ckpt_pb.ListApiKeysRequest(), self.timeout)).keys)

    async def revoke_api_key(self, key_id: str) -> ckpt_pb.ApiKeyInfo:
        """Revokes a key: every service refuses it within seconds."""
        request = ckpt_pb.RevokeApiKeyRequest(key_id=key_id)
        return (await _unary(self.checkpoint_stub.RevokeApiKey, request, self.timeout)).info

    async def list_checkpoints(self, model: str) -> ckpt_pb.ListCheckpointsResponse:
        request = ckpt_pb.ListCheckpointsRequest(model=model)
        return await _unary(self.checkpoint_stub.ListCheckpoints, request, self.timeout)

    async def get_checkpoint(self, model: str, checkpoint_id: str) -> Manifest:
        request = ckpt_pb.GetCheckpointRequest(model=model, checkpoint_id=checkpoint_id)
        return manifest_from_pb((await _unary(self.checkpoint_stub.GetCheckpoint, request, self.timeout)).manifest)

    async def commit_checkpoint(
        self, manifest: Manifest, *, set_head: bool = False, expected_head_checkpoint_id: str = ""
    ) -> tuple[Manifest, Head | None]:
        """Commits a checkpoint whose objects are written; returns it (as stored) and the head when it moved."""
        request = ckpt_pb.CommitCheckpointRequest(
            manifest=manifest_to_pb(manifest),
            set_head=set_head,
            expected_head_checkpoint_id=expected_head_checkpoint_id,
        )
        response = await self._repeatable(self.checkpoint_stub.CommitCheckpoint, request)
        return manifest_from_pb(response.manifest), head_from_pb(response.head) if response.HasField("head") else None

    async def get_head(self, model: str) -> Head:
        request = ckpt_pb.GetHeadRequest(model=model)
        return head_from_pb((await _unary(self.checkpoint_stub.GetHead, request, self.timeout)).head)

    async def set_head(
        self, model: str, checkpoint_id: str, expected_checkpoint_id: str = "", expected_sequence: int = 0
    ) -> Head:
        """Moves a model's head (compare-and-swap on the expected checkpoint id and/or sequence)."""
        request = ckpt_pb.SetHeadRequest(
            model=model,
            checkpoint_id=checkpoint_id,
            expected_checkpoint_id=expected_checkpoint_id,
            expected_sequence=expected_sequence,
        )
        return head_from_pb((await _unary(self.checkpoint_stub.SetHead, request, self.timeout)).head)

    async def record_promotion(self, model: str, checkpoint_id: str, promotion: ckpt_pb.Promotion) -> None:
        """Records the promotion gate's decision on a checkpoint (HEAD does not move)."""
        request = ckpt_pb.RecordPromotionRequest(model=model, checkpoint_id=checkpoint_id, promotion=promotion)
        await _unary(self.checkpoint_stub.RecordPromotion, request, self.timeout)

    async def watch_head(self, model: str, after_sequence: int = 0) -> AsyncIterator[Head]:
        """Yields the model's head on every move (first the current one when newer than after_sequence)."""
        request = ckpt_pb.WatchHeadRequest(model=model, after_sequence=after_sequence)
        async for response in _stream(self.checkpoint_stub.WatchHead(request)):
            yield head_from_pb(response.head)
