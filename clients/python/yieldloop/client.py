"""The async client over all four services.

Example::

    async with Client(env="127.0.0.1:7001", rollout="127.0.0.1:7002",
                      trainer="127.0.0.1:7003", checkpoint="127.0.0.1:7004") as client:
        runs = [run async for run in client.stream_rollouts([task], group_size=8)]
        await client.forward_backward(runs=runs, loss_fn="importance_sampling")
        step = await client.optim_step(learning_rate=1e-4, set_head=True)

Methods are snake_case wrappers of the PascalCase RPCs. They take and return domain types
(:mod:`yieldloop.types`: Run, Datum, Manifest, Head, OptimStepResult, ServingInfo, ...), never protobuf
messages; the raw stubs, for callers that need the messages themselves, are behind one door
(``client.raw.<service>``). A failed call raises a subclass of :class:`yieldloop.errors.YieldloopError`
carrying the gRPC code and the ``ErrorInfo`` reason.
"""

from __future__ import annotations

import asyncio
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

from yieldloop.convert import (
    datum_from_pb,
    datum_to_pb,
    from_pb,
    head_from_pb,
    job_from_pb,
    lora_to_pb,
    manifest_from_pb,
    manifest_to_pb,
    model_from_pb,
    run_from_pb,
    run_to_pb,
    task_to_pb,
    to_pb,
    weight_event_from_pb,
    weight_piece_from_pb,
)
from yieldloop.environment import Task
from yieldloop.errors import FailedPreconditionError, NotFoundError, UnavailableError, invalid_field
from yieldloop.groups import split_whole_groups
from yieldloop.proto.checkpoint.v1 import checkpoint_service_pb2 as ckpt_pb
from yieldloop.proto.common.v1 import common_pb2 as common_pb
from yieldloop.proto.env.v1 import env_service_pb2 as env_pb
from yieldloop.proto.rollout.v1 import rollout_service_pb2 as rollout_pb
from yieldloop.proto.trainer.v1 import trainer_service_pb2 as trainer_pb
from yieldloop.retry import Backoff
from yieldloop.transport import DEFAULT_TRANSPORT, TransportConfig, open_channel
from yieldloop.types import (
    ApiKeyInfo,
    BackwardResult,
    CheckpointSummary,
    Datum,
    ForwardBackwardResult,
    GenerateDelta,
    Head,
    JobInfo,
    LoraConfig,
    LossInfo,
    Manifest,
    ModelInfo,
    NewApiKey,
    NewModel,
    OptimStepResult,
    Promotion,
    Run,
    SamplingParams,
    Scenarios,
    ServingInfo,
    TraceSpan,
    TrainerInfo,
    WeightEvent,
    WeightPiece,
)
from yieldloop.wire.calls import stream as _stream
from yieldloop.wire.calls import unary as _unary
from yieldloop.wire.episodes import EpisodeSession, EpisodeStreams, MultiplexedEpisode
from yieldloop.wire.raw import RawStubs

RETRY = Backoff(initial_s=0.25, max_s=5.0)
"""Between retries of a repeatable call while its service is unavailable (a restart takes seconds)."""
SERVICES = ("checkpoint", "env", "trainer", "rollout")
"""The four services, in the order a stack starts them (each calls only those before it)."""


def sampling_params(**kwargs: Any) -> SamplingParams:
    """SamplingParams from keyword arguments (temperature, top_p, top_k, max_tokens, stop, seed, ignore_eos)."""
    if "stop" in kwargs:
        kwargs["stop"] = list(kwargs["stop"])
    return SamplingParams(**kwargs)


@dataclasses.dataclass
class Completion:
    """A whole generation gathered from the Generate stream."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    weight_version: str
    stop_reason: int
    """A :class:`~yieldloop.types.StopReason` value."""


def _addresses(given: str | Sequence[str] | None) -> list[str]:
    """Addresses given as one string (comma-separated) or a list of them."""
    items = [given] if isinstance(given, str) else list(given or ())
    return [a.strip() for item in items for a in item.split(",") if a.strip()]


class Client:
    """Async client for EnvService, RolloutService, TrainerService and CheckpointService.

    Args:
        env, rollout, trainer, checkpoint: ``host:port`` (or ``dns:///host:port``
            for round-robin across replicas) of each service; a service left
            out raises FailedPreconditionError when used. ``env`` may name
            several EnvService replicas (a list, or comma-separated): episodes
            are spread across them in turn; ``rollout`` likewise several
            RolloutService replicas of one model: each call goes to the next.
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
        rollout: str | Sequence[str] | None = None,
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
        self._episode_streams: dict[tuple[str, int], EpisodeStreams] = {}
        self.transport = transport if api_key is None else dataclasses.replace(transport, api_key=api_key)
        self.metadata = (("authorization", f"Bearer {self.transport.api_key}"),) if self.transport.api_key else ()
        """Sent with every call (the API key)."""
        self.retry_within_s = retry_within_s
        self._channels: dict[tuple[str, int], grpc.aio.Channel] = {}
        self.raw = RawStubs(self)
        """The generated stubs, one per service (``client.raw.trainer.OptimStep(...)``): protobuf in and out."""
        self._owns_channels = True
        self._env_addresses = _addresses(env)
        # (address, connection): episodes take every replica in turn, then each replica's next connection
        self._env_targets = [
            (address, connection)
            for connection in range(max(1, self.transport.env_connections))
            for address in self._env_addresses
        ]
        self._next_env = itertools.count()
        self._rollout_addresses = _addresses(rollout)
        self._next_rollout = itertools.count()
        self._addresses = {
            "rollout": self._rollout_addresses[0] if self._rollout_addresses else None,
            "trainer": trainer,
            "checkpoint": checkpoint,
        }

    def with_api_key(self, api_key: str) -> Client:
        """This client calling with ``api_key`` instead, over the same channels (a front that acts for its callers
        forwards each caller's key). Closing it closes nothing: the channels stay this client's."""
        clone = copy.copy(self)
        clone.transport = dataclasses.replace(self.transport, api_key=api_key)
        clone.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        clone._owns_channels, clone.raw = False, RawStubs(clone)
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

    def channel(self, service: str, address: str | None = None, connection: int = 0) -> grpc.aio.Channel:
        """The channel to ``address`` (default: the service's); channels of other ``connection`` numbers to the same
        address are connections of their own."""
        if address is None and service == "rollout" and len(self._rollout_addresses) > 1:  # replicas in turn
            address = self._rollout_addresses[next(self._next_rollout) % len(self._rollout_addresses)]
        address = address or self._addresses.get(service)
        if not address:
            raise FailedPreconditionError(f"no address given for the {service} service", reason="INVALID_FIELD")
        key = (address, connection)
        if key not in self._channels:
            self._channels[key] = open_channel(address, self.transport)
        return self._channels[key]

    def next_env_target(self) -> tuple[str, int]:
        """The next (EnvService replica address, connection) in turn (``transport.env_connections`` per address)."""
        if not self._env_targets:
            self.channel("env")  # raises: no address
        return self._env_targets[next(self._next_env) % len(self._env_targets)]

    async def close(self) -> None:
        if not self._owns_channels:
            return
        for streams in self._episode_streams.values():
            await streams.close()
        self._episode_streams.clear()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self.raw.clear()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # EnvService ------------------------------------------------------------------

    async def list_scenarios(self, env: str = "") -> Scenarios:
        """The scenarios (and tools) the EnvService offers (``env``: of that environment only)."""
        response = await _unary(self.raw.env.ListScenarios, env_pb.ListScenariosRequest(env=env), self.timeout)
        return from_pb(Scenarios, response)

    def episode(self, task: Task, timeout: float | None = None) -> EpisodeSession | MultiplexedEpisode:
        """An episode session; ``async with client.episode(task) as ep`` starts it. ``timeout`` bounds the
        whole episode (its own stream's deadline; such an episode is never multiplexed)."""
        target = self.next_env_target()
        if self.multiplex_episodes and timeout is None:
            streams = self._episode_streams.get(target)
            if streams is None:
                streams = self._episode_streams[target] = EpisodeStreams(
                    functools.partial(self.raw.env_at, target), self.transport.trace_context
                )
            return MultiplexedEpisode(streams, task_to_pb(task))
        return EpisodeSession(self.raw.env_at(target), task_to_pb(task), timeout)

    # RolloutService ----------------------------------------------------------------

    def generate_stream(
        self,
        prompt_token_ids: Sequence[int] | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        sampling: SamplingParams | None = None,
        model: str = "",
        timeout: float | None = None,
    ) -> AsyncIterator[GenerateDelta]:
        """Streams Generate deltas for token ids or chat messages (exactly one of them)."""
        if (prompt_token_ids is None) == (messages is None):
            raise invalid_field("prompt", "give exactly one of prompt_token_ids and messages")
        wire_sampling = to_pb(rollout_pb.SamplingParams, sampling or sampling_params(max_tokens=16))
        request = rollout_pb.GenerateRequest(model=model, sampling=wire_sampling)
        if messages is not None:
            request.chat.messages.extend(common_pb.ChatMessage(**m) for m in messages)
        else:
            request.prompt_token_ids.token_ids.extend(prompt_token_ids)
        return _deltas(self.raw.rollout.Generate(request, timeout=timeout))

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
        tasks: Iterable[Task],
        *,
        group_size: int = 1,
        max_concurrent: int = 0,
        sampling: SamplingParams | None = None,
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
            tasks=[task_to_pb(t) for t in tasks],
            group_size=group_size,
            max_concurrent=max_concurrent,
            sampling=to_pb(rollout_pb.SamplingParams, sampling or sampling_params(temperature=1.0, max_tokens=16)),
            job_id=job_id,
            max_steps=max_steps,
            episode_timeout_s=episode_timeout_s,
            max_attempts=max_attempts,
            checkpoint_id=checkpoint_id,
            model=model,
            batch_runs=True,
        )
        async for response in _stream(self.raw.rollout.StreamRollouts(request, timeout=timeout)):
            for run in response.runs:
                yield run_from_pb(run)
            if response.HasField("run"):  # a server that does not batch
                yield run_from_pb(response.run)

    async def create_job(
        self, model: str = "", name: str = "", group_size: int = 0, metadata_json: str = ""
    ) -> JobInfo:
        request = rollout_pb.CreateJobRequest(
            model=model, name=name, group_size=group_size, metadata_json=metadata_json
        )
        return job_from_pb((await _unary(self.raw.rollout.CreateJob, request, self.timeout)).job)

    async def list_jobs(self) -> list[JobInfo]:
        response = await _unary(self.raw.rollout.ListJobs, rollout_pb.ListJobsRequest(), self.timeout)
        return [job_from_pb(job) for job in response.jobs]

    async def job_runs(self, job_id: str) -> AsyncIterator[Run]:
        """Yields a job's recorded runs in the order they were recorded."""
        request = rollout_pb.StreamJobRunsRequest(job_id=job_id)
        async for response in _stream(self.raw.rollout.StreamJobRuns(request, timeout=self.timeout)):
            yield run_from_pb(response.run)

    async def record_runs(
        self,
        runs: Sequence[Run],
        job_id: str = "",
        *,
        model: str = "",
        name: str = "",
        group_size: int = 0,
        metadata_json: str = "",
    ) -> JobInfo:
        """Records runs made elsewhere (each with a new trace id) into ``job_id`` (empty: the caller's default job),
        which is created for the caller's team with ``model``, ``name``, ``group_size`` and ``metadata_json`` when
        it does not exist; with no runs, only makes sure of the job. Durable when it returns."""
        request = rollout_pb.RecordRunsRequest(
            job_id=job_id,
            job=rollout_pb.CreateJobRequest(model=model, name=name, group_size=group_size, metadata_json=metadata_json),
            runs=[run_to_pb(run) for run in runs],
        )
        return job_from_pb((await _unary(self.raw.rollout.RecordRuns, request, self.timeout)).job)

    async def get_runs(self, trace_ids: Iterable[str]) -> list[Run]:
        """Reads persisted runs back from the trace store."""
        request = rollout_pb.GetRunsRequest(trace_ids=list(trace_ids))
        return [run_from_pb(run) for run in (await _unary(self.raw.rollout.GetRuns, request, self.timeout)).runs]

    async def get_trace_spans(self, trace_id: str) -> list[TraceSpan]:
        """The spans recorded for a run's trace (a stack started with ``--record-spans``), oldest first."""
        request = rollout_pb.GetTraceSpansRequest(trace_id=trace_id)
        response = await _unary(self.raw.rollout.GetTraceSpans, request, self.timeout)
        return [from_pb(TraceSpan, span) for span in response.spans]

    async def get_serving_info(
        self, wait_for_checkpoint_id: str = "", timeout: float | None = None, model: str = ""
    ) -> ServingInfo:
        """What serves ``model`` (empty: the default model); with ``wait_for_checkpoint_id``, once it serves that."""
        request = rollout_pb.GetServingInfoRequest(wait_for_checkpoint_id=wait_for_checkpoint_id, model=model)
        return from_pb(ServingInfo, await _unary(self.raw.rollout.GetServingInfo, request, timeout or self.timeout))

    # TrainerService ----------------------------------------------------------------

    async def forward_backward(
        self,
        *,
        runs: Iterable[Run | str] = (),
        datums: Iterable[Datum] = (),
        loss_fn: str = "importance_sampling",
        loss_fn_config: Mapping[str, float] | None = None,
        normalize_advantages_by_std: bool = False,
        drop_groups_without_signal: bool = False,
        reward_scale: float = 1.0,
        group_size: int = 0,
        allow_incomplete_groups: bool = False,
        model: str = "",
    ) -> ForwardBackwardResult:
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

        return from_pb(ForwardBackwardResult, await _unary(self.raw.trainer.ForwardBackward, requests(), self.timeout))

    async def forward_scored(
        self,
        *,
        runs: Iterable[Run] = (),
        datums: Iterable[Datum] = (),
        model: str = "",
    ) -> list[tuple[Datum, list[float]]]:
        """For each run, then each datum: the datum scored (runs with their group-centred advantages) and the
        learner's logprob of each of its targets (no gradient)."""

        def requests() -> Iterable[trainer_pb.ForwardRequest]:
            for run in runs:
                yield trainer_pb.ForwardRequest(run=run_to_pb(run), model=model)
            for datum in datums:
                yield trainer_pb.ForwardRequest(datum=datum_to_pb(datum), model=model)

        response = await _unary(self.raw.trainer.Forward, requests(), self.timeout)
        return [(datum_from_pb(result.datum), list(result.logprobs)) for result in response.results]

    async def forward(
        self,
        *,
        runs: Iterable[Run] = (),
        datums: Iterable[Datum] = (),
        model: str = "",
    ) -> list[list[float]]:
        """The learner's per-target-token logprobs for each run, then each datum (no gradient)."""
        return [logprobs for _, logprobs in await self.forward_scored(runs=runs, datums=datums, model=model)]

    async def backward(self, datums: Iterable[Datum], model: str = "") -> BackwardResult:
        """Accumulates the gradient of -(weights * logprob).sum() for datums whose weights are -d loss / d logprob
        (a custom loss: see :func:`yieldloop.training.forward_backward_custom`)."""
        requests = (trainer_pb.BackwardRequest(datum=datum_to_pb(d), model=model) for d in datums)
        return from_pb(BackwardResult, await _unary(self.raw.trainer.Backward, requests, self.timeout))

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
    ) -> OptimStepResult:
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
        return from_pb(OptimStepResult, await self._repeatable(self.raw.trainer.OptimStep, request))

    async def discard_gradients(self, model: str = "") -> int:
        """Forgets the gradients accumulated for ``model`` since its last step (every caller's: e.g. after a step
        refused as NON_FINITE or HEAD_CONFLICT); returns how many datums they came from."""
        request = trainer_pb.DiscardGradientsRequest(model=model)
        return (await _unary(self.raw.trainer.DiscardGradients, request, self.timeout)).num_datums

    async def pull_weights(
        self, model: str, checkpoint_id: str, host_id: str = "", probe: bool = False
    ) -> AsyncIterator[WeightPiece]:
        """The sampler weights of a checkpoint the trainer still holds (see TrainerService.PullWeights); with
        ``probe``, one empty piece when it holds them (NOT_FOUND otherwise)."""
        request = trainer_pb.PullWeightsRequest(model=model, checkpoint_id=checkpoint_id, host_id=host_id, probe=probe)
        async for message in _stream(self.raw.trainer.PullWeights(request, timeout=self.timeout)):
            yield weight_piece_from_pb(message)

    async def subscribe_weights(self, model: str, backend: str = "gloo") -> AsyncIterator[WeightEvent]:
        """Membership in the trainer's weight group for ``model``, for as long as the stream is read (see
        TrainerService.SubscribeWeights; no deadline)."""
        request = trainer_pb.SubscribeWeightsRequest(model=model, backend=backend)
        async for message in _stream(self.raw.trainer.SubscribeWeights(request)):
            yield weight_event_from_pb(message)

    async def train_step(
        self,
        runs: Sequence[Run | str],
        learning_rate: float,
        *,
        loss_fn: str = "importance_sampling",
        num_substeps: int = 1,
        set_head: bool = True,
        adam: Mapping[str, float] | None = None,
        model: str = "",
        timings: dict[str, float] | None = None,
        **forward_backward_options: Any,
    ) -> tuple[OptimStepResult, list[ForwardBackwardResult]]:
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

    async def list_losses(self) -> list[LossInfo]:
        """The losses the trainer computes, with their knobs."""
        response = await _unary(self.raw.trainer.ListLosses, trainer_pb.ListLossesRequest(), self.timeout)
        return [from_pb(LossInfo, spec) for spec in response.losses]

    async def get_trainer_info(self, model: str = "") -> TrainerInfo:
        request = trainer_pb.GetTrainerInfoRequest(model=model)
        return from_pb(TrainerInfo, await _unary(self.raw.trainer.GetTrainerInfo, request, self.timeout))

    # CheckpointService ---------------------------------------------------------------

    async def list_models(self) -> list[ModelInfo]:
        """Every model this key may see."""
        response = await _unary(self.raw.checkpoint.ListModels, ckpt_pb.ListModelsRequest(), self.timeout)
        return [model_from_pb(model) for model in response.models]

    async def delete_model(self, model: str, force: bool = False) -> None:
        """Deletes a model (FAILED_PRECONDITION/MODEL_IN_USE while forks depend on it, unless ``force``)."""
        request = ckpt_pb.DeleteModelRequest(model=model, force=force)
        await _unary(self.raw.checkpoint.DeleteModel, request, self.timeout)

    async def get_model(self, model: str) -> ModelInfo:
        """One model's record (NOT_FOUND/MODEL_NOT_FOUND when there is none)."""
        response = await _unary(self.raw.checkpoint.GetModel, ckpt_pb.GetModelRequest(model=model), self.timeout)
        return model_from_pb(response.model)

    async def fork_model(self, source: str, name: str, owner: str = "", lora: LoraConfig | None = None) -> NewModel:
        """Forks ``source`` (a slug or ``slug@checkpoint``) into ``name``: full fine-tuning, or with ``lora`` a
        LoRA fork training adapters only over the source's frozen weights."""
        request = ckpt_pb.ForkModelRequest(
            source=source, name=name, owner=owner, lora=lora_to_pb(lora) if lora is not None else None
        )
        return from_pb(NewModel, await _unary(self.raw.checkpoint.ForkModel, request, self.timeout))

    async def import_model(
        self, source: str, name: str, owner: str = "", public: bool = False, on_server: bool = False
    ) -> NewModel:
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
        return from_pb(NewModel, await _unary(self.raw.checkpoint.ImportModel, request, self.timeout))

    async def upload_model(
        self, folder: str | pathlib.Path, name: str, owner: str = "", public: bool = False, source: str = ""
    ) -> NewModel:
        """Uploads a Hugging Face model folder of this machine (its weights, configs, tokenizer files and chat
        templates, each with its sha256) and imports it as the base slug ``name`` (see :meth:`import_model`)."""
        from yieldloop.wire.uploads import upload_header, upload_requests

        folder = pathlib.Path(folder).expanduser()
        header = await asyncio.to_thread(upload_header, folder, name, owner, public, source)
        response = await _unary(self.raw.checkpoint.UploadModel, upload_requests(folder, header), self.timeout)
        return from_pb(NewModel, response)

    # API keys (admin keys only) -------------------------------------------------------------------------

    async def create_api_key(self, team: str, role: str, name: str = "") -> NewApiKey:
        """A new key for ``team`` with ``role`` (sample, train or admin); ``api_key`` is shown this once."""
        request = ckpt_pb.CreateApiKeyRequest(team=team, role=role, name=name)
        return from_pb(NewApiKey, await _unary(self.raw.checkpoint.CreateApiKey, request, self.timeout))

    async def list_api_keys(self) -> list[ApiKeyInfo]:
        response = await _unary(self.raw.checkpoint.ListApiKeys, ckpt_pb.ListApiKeysRequest(), self.timeout)
        return [from_pb(ApiKeyInfo, key) for key in response.keys]

    async def revoke_api_key(self, key_id: str) -> ApiKeyInfo:
        """Revokes a key: every service refuses it within seconds."""
        request = ckpt_pb.RevokeApiKeyRequest(key_id=key_id)
        return from_pb(ApiKeyInfo, (await _unary(self.raw.checkpoint.RevokeApiKey, request, self.timeout)).info)

    async def list_checkpoints(self, model: str) -> list[CheckpointSummary]:
        """The model's checkpoints, oldest first."""
        request = ckpt_pb.ListCheckpointsRequest(model=model)
        response = await _unary(self.raw.checkpoint.ListCheckpoints, request, self.timeout)
        return [from_pb(CheckpointSummary, summary) for summary in response.checkpoints]

    async def get_checkpoint(self, model: str, checkpoint_id: str) -> Manifest:
        request = ckpt_pb.GetCheckpointRequest(model=model, checkpoint_id=checkpoint_id)
        return manifest_from_pb((await _unary(self.raw.checkpoint.GetCheckpoint, request, self.timeout)).manifest)

    async def commit_checkpoint(
        self, manifest: Manifest, *, set_head: bool = False, expected_head_checkpoint_id: str = ""
    ) -> tuple[Manifest, Head | None]:
        """Commits a checkpoint whose objects are written; returns it (as stored) and the head when it moved."""
        request = ckpt_pb.CommitCheckpointRequest(
            manifest=manifest_to_pb(manifest),
            set_head=set_head,
            expected_head_checkpoint_id=expected_head_checkpoint_id,
        )
        response = await self._repeatable(self.raw.checkpoint.CommitCheckpoint, request)
        return manifest_from_pb(response.manifest), head_from_pb(response.head) if response.HasField("head") else None

    async def get_head(self, model: str) -> Head:
        request = ckpt_pb.GetHeadRequest(model=model)
        return head_from_pb((await _unary(self.raw.checkpoint.GetHead, request, self.timeout)).head)

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
        return head_from_pb((await _unary(self.raw.checkpoint.SetHead, request, self.timeout)).head)

    async def record_promotion(self, model: str, checkpoint_id: str, promotion: Promotion) -> None:
        """Records the promotion gate's decision on a checkpoint (HEAD does not move)."""
        request = ckpt_pb.RecordPromotionRequest(
            model=model, checkpoint_id=checkpoint_id, promotion=to_pb(ckpt_pb.Promotion, promotion)
        )
        await _unary(self.raw.checkpoint.RecordPromotion, request, self.timeout)

    async def watch_head(self, model: str, after_sequence: int = 0) -> AsyncIterator[Head]:
        """Yields the model's head on every move (first the current one when newer than after_sequence)."""
        request = ckpt_pb.WatchHeadRequest(model=model, after_sequence=after_sequence)
        async for response in _stream(self.raw.checkpoint.WatchHead(request)):
            yield head_from_pb(response.head)


async def _deltas(call: Any) -> AsyncIterator[GenerateDelta]:
    async for message in _stream(call):
        yield from_pb(GenerateDelta, message)
