"""RolloutService servicer: protobuf <-> engine and rollout translation only."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import math
from collections.abc import AsyncIterator

import grpc

from yieldloop.client import Client
from yieldloop.convert import job_to_pb, run_from_pb, run_to_pb, task_ref_from_pb
from yieldloop.errors import FailedPreconditionError, NotFoundError, check_json_object, check_text, invalid_field
from yieldloop.proto.rollout.v1 import rollout_service_pb2 as pb
from yieldloop.proto.rollout.v1 import rollout_service_pb2_grpc as pb_grpc
from yieldloop.types import JobInfo
from yieldloop_server.common import telemetry
from yieldloop_server.common.auth import ModelAccess, current_principal, require_job, require_run, sees_job
from yieldloop_server.common.grpc_server import rpc
from yieldloop_server.rollout.engines import SamplingConfig
from yieldloop_server.rollout.models import ServedModels
from yieldloop_server.rollout.rollouts import STOP_REASONS, AgentConfig, RolloutLimits, stream_rollout_batches
from yieldloop_server.store.traces import TraceStore, named_trace


def sampling_from_pb(message: pb.SamplingParams) -> SamplingConfig:
    return SamplingConfig(
        max_tokens=message.max_tokens,
        temperature=message.temperature,
        top_p=message.top_p or 1.0,
        top_k=message.top_k,
        stop=tuple(message.stop),
        seed=message.seed,
        ignore_eos=message.ignore_eos,
    ).validate()


class RolloutServicer(pb_grpc.RolloutServiceServicer):
    """Serves every model by slug (``models``); episodes run against EnvService through ``env``."""

    def __init__(
        self,
        models: ServedModels,
        env: Client,
        traces: TraceStore | None,
        limits: RolloutLimits = RolloutLimits(),
        stream_interval_s: float = 0.0,
    ) -> None:
        self.models = models
        self.env = env
        self.traces = traces
        self.limits = limits
        self.episodes = asyncio.Semaphore(limits.max_episodes)
        """Episodes running at once over every StreamRollouts request."""
        self.openai_base_url = ""
        self.stream_interval_s = stream_interval_s
        """Generate streams at most one message per this many seconds (see SamplingConfig.stream_interval_s)."""
        self.access = ModelAccess.through(models.checkpoints, models.default)

    @rpc
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        sampling = dataclasses.replace(sampling_from_pb(request.sampling), stream_interval_s=self.stream_interval_s)
        kind = request.WhichOneof("prompt")
        if kind not in ("chat", "prompt_token_ids"):
            raise invalid_field("prompt", "give prompt_token_ids or chat")
        await self.access.require(request.model or self.models.default, "sample")
        async with self.models.use(request.model) as served:
            engine = served.engine
            if kind == "chat":
                engine.require_ready()
                prompt_ids = await engine.render_chat_async(
                    [{"role": m.role, "content": m.content} for m in request.chat.messages]
                )
            else:
                prompt_ids = list(request.prompt_token_ids.token_ids)
            first = True
            async for delta in engine.generate(prompt_ids, sampling):
                response = pb.GenerateResponse(
                    token_ids=delta.token_ids,
                    logprobs=delta.logprobs,
                    weight_version=delta.weight_version,
                    finished=delta.finished,
                    stop_reason=STOP_REASONS.get(delta.stop_reason, 0),
                )
                if first:
                    response.prompt_token_ids.extend(prompt_ids)
                    first = False
                yield response

    @rpc
    async def StreamRollouts(
        self, request: pb.StreamRolloutsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StreamRolloutsResponse]:
        limits = self.limits
        if request.group_size < 1:
            raise invalid_field("group_size", f"group_size must be >= 1, got {request.group_size}")
        if not request.tasks:
            raise invalid_field("tasks", "no tasks given")
        runs = len(request.tasks) * request.group_size
        if runs > limits.max_runs:
            raise invalid_field(
                "group_size",
                f"{len(request.tasks)} tasks x group_size {request.group_size} = {runs} "
                f"episodes; this service runs at most {limits.max_runs} per request",
            )
        if request.max_concurrent < 0:
            raise invalid_field("max_concurrent", "max_concurrent must be >= 0")
        for name in ("max_steps", "max_attempts", "episode_timeout_s"):
            if getattr(request, name) < 0 or not math.isfinite(getattr(request, name)):
                raise invalid_field(name, f"{name} must be >= 0")
        for name, most in (("max_attempts", limits.max_attempts), ("max_steps", limits.max_steps)):
            if getattr(request, name) > most:
                raise invalid_field(name, f"{name} is at most {most} on this service, got {getattr(request, name)}")
        config = AgentConfig(
            max_steps=request.max_steps or AgentConfig.max_steps,
            episode_timeout_s=request.episode_timeout_s,
            max_attempts=request.max_attempts or AgentConfig.max_attempts,
        )
        sampling = sampling_from_pb(request.sampling)
        principal = current_principal()
        # Each team's rollouts without a job go to its own default job.
        job_id = request.job_id or ("default" if principal.is_admin else f"{principal.team}-default")
        await self.access.require(request.model or self.models.default, "sample")
        async with contextlib.AsyncExitStack() as stack:
            served = await stack.enter_async_context(self.models.use(request.model))
            if request.checkpoint_id and served.pinned is None:
                raise invalid_field("checkpoint_id", "this server evaluates only the checkpoint it serves")
            engine = served.engine
            if request.checkpoint_id:
                engine = await stack.enter_async_context(served.pinned.engine(request.checkpoint_id))
            else:
                engine.require_ready()
            job = await asyncio.to_thread(self.traces.ensure_job, job_id, served.slug, principal.team)
            require_job(job.team, job_id)
            async for runs in stream_rollout_batches(
                engine,
                self.env,
                [task_ref_from_pb(task) for task in request.tasks],
                group_size=request.group_size,
                max_concurrent=request.max_concurrent,
                sampling=sampling,
                model=served.slug,
                config=config,
                shared_limit=self.episodes,
                # Durable before it is streamed (a run the client saw always has its trace), in batches.
                record=functools.partial(self._record, job_id=job_id, team=principal.team),
            ):
                if request.batch_runs:
                    yield pb.StreamRolloutsResponse(runs=[run_to_pb(run) for run in runs])
                    continue
                for run in runs:
                    yield pb.StreamRolloutsResponse(run=run_to_pb(run))

    @rpc
    async def RecordRuns(
        self, request: pb.RecordRunsRequest, context: grpc.aio.ServicerContext
    ) -> pb.RecordRunsResponse:
        principal = current_principal()
        job_id = request.job_id or ("default" if principal.is_admin else f"{principal.team}-default")
        wanted = request.job
        if wanted.group_size < 0:
            raise invalid_field("job.group_size", "group_size must be >= 0")
        check_json_object(wanted.metadata_json, "job.metadata_json")
        name = check_text(wanted.name, "job.name")
        runs = [run_from_pb(run) for run in request.runs]
        for run in runs:
            if not named_trace(run.trace_id):
                raise invalid_field("runs.trace_id", "a recorded run's trace id is 32 lowercase hex digits")
            if not math.isfinite(run.reward):
                raise invalid_field("runs.reward", "a recorded run's reward must be finite")
        recorded = await asyncio.to_thread(self.traces.recorded, [run.trace_id for run in runs])
        if recorded:
            raise FailedPreconditionError(
                f"trace {recorded[0]} was recorded already: a new trace needs a new id",
                reason="TRACE_ALREADY_RECORDED",
                field="runs.trace_id",
            )
        job = await asyncio.to_thread(
            self.traces.ensure_job,
            job_id,
            wanted.model,
            principal.team,
            name=name,
            group_size=wanted.group_size,
            metadata_json=wanted.metadata_json,
        )
        require_job(job.team, job_id)
        if runs:
            await self._record(runs, job_id, principal.team)  # durable before the answer
        return pb.RecordRunsResponse(job=job_to_pb(job))

    async def _record(self, runs: list, job_id: str, team: str) -> None:
        for run in runs:
            run.team = team
        await asyncio.to_thread(self.traces.put_many, runs, job_id)

    @rpc
    async def GetRuns(self, request: pb.GetRunsRequest, context: grpc.aio.ServicerContext) -> pb.GetRunsResponse:
        runs = await asyncio.to_thread(lambda: [self.traces.get(trace_id) for trace_id in request.trace_ids])
        for run in runs:
            require_run(run.team, run.trace_id)
        return pb.GetRunsResponse(runs=[run_to_pb(run) for run in runs])

    @rpc
    async def GetTraceSpans(
        self, request: pb.GetTraceSpansRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetTraceSpansResponse:
        if not named_trace(request.trace_id):
            raise invalid_field("trace_id", "a trace id is 32 lowercase hex digits")
        try:
            run = await asyncio.to_thread(self.traces.get, request.trace_id)
            require_run(run.team, run.trace_id)
        except NotFoundError:
            pass  # spans of a trace whose run was not recorded (yet): nothing names a team
        spans = await asyncio.to_thread(telemetry.read_spans, self.traces.store, request.trace_id)
        return pb.GetTraceSpansResponse(
            spans=[
                pb.TraceSpan(
                    span_id=s["span_id"],
                    parent_span_id=s["parent_span_id"],
                    name=s["name"],
                    service=s["service"],
                    start_time_unix_nano=s["start_ns"],
                    end_time_unix_nano=s["end_ns"],
                    status=s["status"],
                    error=s["error"],
                    attributes={k: str(v) for k, v in s["attributes"].items()},
                )
                for s in spans
            ]
        )

    @rpc
    async def GetServingInfo(
        self, request: pb.GetServingInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServingInfoResponse:
        await self.access.require(request.model or self.models.default, "sample")
        async with self.models.use(request.model) as served:
            if request.wait_for_checkpoint_id:
                if self.models.checkpoints is not None:  # NOT_FOUND now, rather than waiting for the deadline
                    await self.models.checkpoints.get_checkpoint(served.slug, request.wait_for_checkpoint_id)
                await served.follower.wait_for(request.wait_for_checkpoint_id)  # bounded by the call deadline
            return pb.GetServingInfoResponse(
                model=served.slug,
                weight_version=served.engine.weight_version,
                head_sequence=served.follower.head_sequence,
                engine=served.engine.name,
                last_reload_error=served.follower.last_error,
                openai_base_url=self.openai_base_url,
                adapter_base=served.adapter_base,
                engine_weight_loads=served.engine.weight_loads,
                following=served.follower.following,
                follow_error=served.follower.follow_error,
                candidate_engine_like_head=served.pinned is not None and served.candidates_like_head,
            )

    @rpc
    async def CreateJob(self, request: pb.CreateJobRequest, context: grpc.aio.ServicerContext) -> pb.CreateJobResponse:
        model = request.model or self.models.default
        await self.access.require(model, "sample")
        if request.model and self.models.checkpoints is not None:
            await self.models.checkpoints.get_head(model)  # NOT_FOUND (MODEL_NOT_FOUND) for a missing slug
        if request.group_size < 0:
            raise invalid_field("group_size", "group_size must be >= 0")
        check_json_object(request.metadata_json, "metadata_json")
        job = JobInfo(
            model=model,
            name=check_text(request.name, "name"),
            group_size=request.group_size,
            metadata_json=request.metadata_json,
            team=current_principal().team,
        )
        return pb.CreateJobResponse(job=job_to_pb(await asyncio.to_thread(self.traces.create_job, job)))

    @rpc
    async def ListJobs(self, request: pb.ListJobsRequest, context: grpc.aio.ServicerContext) -> pb.ListJobsResponse:
        jobs = await asyncio.to_thread(self.traces.list_jobs)
        return pb.ListJobsResponse(jobs=[job_to_pb(job) for job in jobs if sees_job(job.team)])

    @rpc
    async def StreamJobRuns(
        self, request: pb.StreamJobRunsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StreamJobRunsResponse]:
        job = await asyncio.to_thread(self.traces.get_job, request.job_id)  # NOT_FOUND (JOB_NOT_FOUND)
        require_job(job.team, job.job_id)
        for trace_id in await asyncio.to_thread(self.traces.job_runs, request.job_id):
            yield pb.StreamJobRunsResponse(run=run_to_pb(await asyncio.to_thread(self.traces.get, trace_id)))
