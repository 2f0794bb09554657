"""TrainerService servicer: protobuf <-> training session translation only (see :mod:`.session`)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator
from typing import Any

import grpc

from yieldloop.convert import datum_from_pb, datum_to_pb, run_from_pb, weight_event_to_pb, weight_piece_to_pb
from yieldloop.errors import check_json_object, invalid_field
from yieldloop.proto.common.v1 import common_pb2 as common_pb
from yieldloop.proto.trainer.v1 import trainer_service_pb2 as pb
from yieldloop.proto.trainer.v1 import trainer_service_pb2_grpc as pb_grpc
from yieldloop.types import Datum, Run, RunStatus
from yieldloop_server.common import telemetry
from yieldloop_server.common.auth import ModelAccess, require_run
from yieldloop_server.common.grpc_server import rpc
from yieldloop_server.trainer import losses
from yieldloop_server.trainer.session import LossOptions, TrainingSessions
from yieldloop_server.trainer.trainer import AdamConfig
from yieldloop_server.weights.base import WeightSource


class TrainerServicer(pb_grpc.TrainerServiceServicer):
    """Serves the training sessions of every slug (see :class:`TrainingSessions`)."""

    def __init__(self, sessions: TrainingSessions, weights: WeightSource) -> None:
        self.sessions = sessions
        self.weights = weights
        self.access = ModelAccess.through(sessions.checkpoints, sessions.default)

    @rpc
    async def ForwardBackward(
        self, request_iterator: AsyncIterator[pb.ForwardBackwardRequest], context: grpc.aio.ServicerContext
    ) -> pb.ForwardBackwardResponse:
        requests = aiter(request_iterator)
        first = await anext(requests, None)
        if first is None:
            raise invalid_field("config", "no ForwardBackwardConfig was sent")
        if first.WhichOneof("item") != "config":
            raise invalid_field("config", "the first message must be a ForwardBackwardConfig")
        config = first.config
        losses.resolve(config.loss_fn, dict(config.loss_fn_config))  # fail before the data arrives
        await self.access.require(config.model or self.sessions.default, "train")
        async with self.sessions.use(config.model) as session:
            await session.follow_head()
            runs: list[Run | str] = []  # a trace id stands for its run until they are read together
            datums: list[Datum] = []
            async for request in requests:
                item = request.WhichOneof("item")
                if item == "config":
                    raise invalid_field("config", "the config was sent twice")
                if item == "datum":
                    datums.append(
                        datum_from_pb(request.datum).validate(
                            session.vocab_size, f"datums[{len(datums)}]", session.max_tokens
                        )
                    )
                elif item == "run":
                    runs.append(run_from_pb(request.run))
                elif item == "trace_id":
                    runs.append(request.trace_id)
                else:
                    raise invalid_field("item", "empty request")
            read = await session.get_runs([item for item in runs if isinstance(item, str)])
            for run in read:
                require_run(run.team, run.trace_id)
            named = iter(read)
            runs = [next(named) if isinstance(item, str) else item for item in runs]
            if not math.isfinite(config.reward_scale) or config.reward_scale < 0:
                raise invalid_field(
                    "config.reward_scale", f"reward_scale must be finite and >= 0 (0: 1), got {config.reward_scale}"
                )
            if config.group_size < 0:
                raise invalid_field("config.group_size", f"group_size must be >= 0, got {config.group_size}")
            options = LossOptions(
                loss_fn=config.loss_fn,
                loss_fn_config=dict(config.loss_fn_config),
                normalize_advantages_by_std=config.normalize_advantages_by_std,
                drop_groups_without_signal=config.drop_groups_without_signal,
                reward_scale=config.reward_scale,
                group_size=config.group_size,
                allow_incomplete_groups=config.allow_incomplete_groups,
            )
            # The step's span links to the trace of every run it trains on (one trace per episode).
            with telemetry.span(
                "forward_backward",
                {"yieldloop.model": session.model, "yieldloop.runs": len(runs), "yieldloop.datums": len(datums)},
                links=telemetry.run_links([run.trace_id for run in runs]),
            ):
                metrics, num_datums, stats = await session.forward_backward(datums, runs, options)
            session.trained_traces += [run.trace_id for run in runs if run.trace_id]
            labels = {"model": session.model, "loss_fn": config.loss_fn}
            telemetry.set_gauge(
                "yieldloop.train.loss",
                metrics["loss_sum"] / max(1.0, metrics["num_action_tokens"]),
                labels,
                description="loss per action token of the last forward_backward",
            )
            if "kl_sampler_learner" in metrics:
                telemetry.set_gauge(
                    "yieldloop.train.kl",
                    metrics["kl_sampler_learner"],
                    labels,
                    description="KL(sampler || learner) per action token, last forward_backward",
                )
            rewards = [run.reward for run in runs if run.status == RunStatus.GRADED]
            if rewards:
                telemetry.set_gauge(
                    "yieldloop.train.reward",
                    sum(rewards) / len(rewards),
                    {"model": session.model},
                    description="mean reward of the runs of the last forward_backward",
                )
        return pb.ForwardBackwardResponse(
            loss_sum=metrics.pop("loss_sum"),
            num_datums=num_datums,
            num_action_tokens=int(metrics.pop("num_action_tokens")),
            num_groups=stats.num_groups,
            num_groups_without_signal=stats.num_groups_without_signal,
            metrics=metrics,
        )

    @contextlib.asynccontextmanager
    async def _session_of(self, request_iterator: AsyncIterator[Any]) -> AsyncIterator[tuple[Any, AsyncIterator[Any]]]:
        """The training session a client stream's first message names (``model``; the caller may train it),
        following its head, and the stream's messages from the first on."""
        requests = aiter(request_iterator)
        first = await anext(requests, None)
        if first is None:
            raise invalid_field("items", "the batch is empty")
        await self.access.require(first.model or self.sessions.default, "train")

        async def every() -> AsyncIterator[Any]:
            yield first
            async for request in requests:
                yield request

        async with self.sessions.use(first.model) as session:
            await session.follow_head()
            yield session, every()

    @rpc
    async def Forward(
        self, request_iterator: AsyncIterator[pb.ForwardRequest], context: grpc.aio.ServicerContext
    ) -> pb.ForwardResponse:
        async with self._session_of(request_iterator) as (session, requests):
            items: list[Datum | Run] = []
            async for request in requests:
                kind = request.WhichOneof("item")
                if kind == "datum":
                    items.append(datum_from_pb(request.datum).validate(session.vocab_size, f"items[{len(items)}]"))
                elif kind == "run":
                    items.append(run_from_pb(request.run))
                else:
                    raise invalid_field(f"items[{len(items)}]", "empty request")
            scored = await session.score(items)
        return pb.ForwardResponse(
            results=[pb.TokenLogprobs(logprobs=logprobs, datum=datum_to_pb(datum)) for datum, logprobs in scored]
        )

    @rpc
    async def Backward(
        self, request_iterator: AsyncIterator[pb.BackwardRequest], context: grpc.aio.ServicerContext
    ) -> pb.BackwardResponse:
        async with self._session_of(request_iterator) as (session, requests):
            datums: list[Datum] = []
            async for request in requests:
                datum = datum_from_pb(request.datum)
                datum.sampling_logprobs, datum.advantages = [], []  # only the weights count here
                datums.append(datum.validate(session.vocab_size, f"datums[{len(datums)}]", session.max_tokens))
            num_tokens = await session.backward(datums)
        return pb.BackwardResponse(num_datums=len(datums), num_tokens=num_tokens)

    @rpc
    async def OptimStep(self, request: pb.OptimStepRequest, context: grpc.aio.ServicerContext) -> pb.OptimStepResponse:
        adam = request.adam
        config = AdamConfig(
            learning_rate=adam.learning_rate,
            beta1=adam.beta1 or 0.9,
            beta2=adam.beta2 or 0.95,
            eps=adam.eps or 1e-8,
            weight_decay=adam.weight_decay,
            max_grad_norm=adam.max_grad_norm,
        )
        check_json_object(request.metadata_json, "metadata_json")
        if len(request.idempotency_key) > 128:
            raise invalid_field("idempotency_key", "an idempotency key has at most 128 characters")
        await self.access.require(request.model or self.sessions.default, "train")
        async with self.sessions.use(request.model) as session:
            trained = list(session.trained_traces)
            with telemetry.span(
                "optim_step", {"yieldloop.model": session.model}, links=telemetry.run_links(trained)
            ) as span:
                outcome = await session.optim_step(
                    config.validate(),
                    skip_checkpoint=request.skip_checkpoint,
                    set_head=request.set_head,
                    metadata_json=request.metadata_json,
                    idempotency_key=request.idempotency_key,
                    drop_gradients_if_refused=request.drop_gradients_if_refused,
                    save_state=request.save_state,
                    wait_durable=request.wait_durable,
                )
                del session.trained_traces[: len(trained)]  # applied: a refused step keeps them for the next
                if span is not None:
                    span.set_attribute("yieldloop.checkpoint_id", outcome.checkpoint_id)
                    span.set_attribute("yieldloop.step", outcome.step)
        response = pb.OptimStepResponse(
            step=outcome.step,
            grad_norm=outcome.grad_norm,
            parent_checkpoint_id=outcome.parent_checkpoint_id,
            timings=outcome.timings,
            durable=outcome.durable,
            has_state=outcome.has_state,
        )
        if outcome.checkpoint_id:
            response.checkpoint.CopyFrom(
                common_pb.CheckpointRef(model=session.model, checkpoint_id=outcome.checkpoint_id)
            )
            response.head_sequence = outcome.head.sequence if outcome.head is not None else 0
        return response

    @rpc
    async def ListLosses(
        self, request: pb.ListLossesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListLossesResponse:
        return pb.ListLossesResponse(
            losses=[
                pb.LossSpec(
                    name=spec.name,
                    description=spec.description,
                    knobs=[
                        pb.LossKnob(name=k, default_value=v, description=spec.knob_docs.get(k, ""))
                        for k, v in spec.knobs.items()
                    ],
                )
                for spec in losses.LOSSES.values()
            ]
        )

    @rpc
    async def DiscardGradients(
        self, request: pb.DiscardGradientsRequest, context: grpc.aio.ServicerContext
    ) -> pb.DiscardGradientsResponse:
        await self.access.require(request.model or self.sessions.default, "train")
        async with self.sessions.use(request.model) as session:
            return pb.DiscardGradientsResponse(num_datums=await session.discard_gradients())

    @rpc
    async def GetTrainerInfo(
        self, request: pb.GetTrainerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetTrainerInfoResponse:
        await self.access.require(request.model or self.sessions.default, "see")
        async with self.sessions.use(request.model) as session:
            assert session.trainer is not None
            return pb.GetTrainerInfoResponse(
                model=session.model,
                step=session.trainer.step,
                checkpoint_id=session.checkpoint_id,
                num_pending_datums=session.trainer.num_pending_datums,
                device=session.config.device,
                weight_group_members=self.weights.members(session.model),
            )

    @rpc
    async def PullWeights(
        self, request: pb.PullWeightsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PullWeightsResponse]:
        async for piece in self.weights.pull(request.model, request.checkpoint_id, request.host_id, request.probe):
            yield weight_piece_to_pb(piece)

    @rpc
    async def SubscribeWeights(
        self, request: pb.SubscribeWeightsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SubscribeWeightsResponse]:
        async for event in self.weights.subscribe(request.model, request.backend):
            yield weight_event_to_pb(event)
