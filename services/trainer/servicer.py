"""TrainerService servicer: protobuf <-> trainer translation, plus the checkpoint commit."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import pathlib
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from yieldloop.client import Client
from yieldloop.convert import run_from_bytes, run_from_pb, run_to_bytes
from yieldloop.types import Run, RunStatus
from yieldloop.proto.common.v1 import common_pb2 as common_pb
from yieldloop.errors import invalid_field
from yieldloop_server.checkpoint.files import download_verified, upload_folder
from yieldloop_server.checkpoint.registry import Manifest
from yieldloop_server.common.grpc_server import rpc
from yieldloop_server.store import ObjectStore
from yieldloop_server.store.traces import TraceStore
from yieldloop_server.trainer import losses
from yieldloop_server.trainer.datums import Datum, runs_to_datums
from yieldloop_server.trainer.trainer import AdamConfig, Trainer, TrainerConfig
from yieldloop.proto.trainer.v1 import trainer_service_pb2 as pb
from yieldloop.proto.trainer.v1 import trainer_service_pb2_grpc as pb_grpc


def datum_from_pb(message: common_pb.Datum) -> Datum:
    return Datum(
        input_tokens=list(message.input_tokens),
        target_tokens=list(message.target_tokens),
        sampling_logprobs=list(message.sampling_logprobs),
        advantages=list(message.advantages),
        weights=list(message.weights),
    )


def datum_pb(datum: Datum) -> common_pb.Datum:
    return common_pb.Datum(**dataclasses.asdict(datum))


class TrainerServicer(pb_grpc.TrainerServiceServicer):
    """Serves one model's trainer; OptimStep commits through CheckpointService.

    Args:
        model: The model slug trained.
        store: Where checkpoints are written (the same store CheckpointService reads).
        checkpoints: Client connected to CheckpointService.
        work_dir: Local scratch space for checkpoint folders.
        config: Device, dtype and micro-batch size.
    """

    def __init__(
        self,
        model: str,
        store: ObjectStore,
        checkpoints: Client,
        work_dir: pathlib.Path,
        config: TrainerConfig,
        nproc: int = 1,
    ) -> None:
        self.model = model
        self.store = store
        self.checkpoints = checkpoints
        self.work_dir = work_dir
        self.config = config
        self.nproc = nproc
        self.trainer: Trainer | Any | None = None
        self.checkpoint_id = ""
        # One thread owns the weights, so calls apply in arrival order.
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainer")

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def follow_head(self) -> None:
        """Reloads from the head when it moved away from our last checkpoint (a rollback or a branch point),
        so the next commit extends the tree from there. Only between steps: pending gradients pin the weights."""
        assert self.trainer is not None
        if self.trainer.num_pending_datums:
            return
        head = await self.checkpoints.get_head(self.model)
        if head.checkpoint_id != self.checkpoint_id:
            await self.close_trainer()
            await self.load_head()

    async def close_trainer(self) -> None:
        if self.trainer is not None and hasattr(self.trainer, "close"):
            await self._run(self.trainer.close)
        self.trainer = None

    async def load_head(self) -> None:
        """Loads the model's head checkpoint (weights and optimizer state) from the store."""
        head = await self.checkpoints.get_head(self.model)
        manifest = await self.checkpoints.get_checkpoint(self.model, head.checkpoint_id)
        folder = await asyncio.to_thread(
            download_verified, self.store, manifest, self.work_dir / "cache" / self.model / manifest.checkpoint_id
        )
        if self.nproc > 1:  # data parallel: rank 0 here, the other ranks in spawned processes
            from yieldloop_server.trainer.distributed import DistributedTrainer

            self.trainer = await self._run(DistributedTrainer, folder, self.config, self.nproc)
        else:
            self.trainer = await self._run(Trainer, folder, self.config)
        self.checkpoint_id = manifest.checkpoint_id

    async def close(self) -> None:
        await self.close_trainer()
        self._executor.shutdown(wait=True)

    @rpc
    async def ForwardBackward(
        self, request_iterator: AsyncIterator[pb.ForwardBackwardRequest], context: grpc.aio.ServicerContext
    ) -> pb.ForwardBackwardResponse:
        await self.follow_head()
        assert self.trainer is not None
        config: pb.ForwardBackwardConfig | None = None
        runs: list[Run] = []
        datums: list[Datum] = []
        num_ungraded = 0
        traces = TraceStore(self.store, run_to_bytes, run_from_bytes)
        async for request in request_iterator:
            item = request.WhichOneof("item")
            if config is None and item != "config":
                raise invalid_field("config", "the first message must be a ForwardBackwardConfig")
            if item == "config":
                if config is not None:
                    raise invalid_field("config", "the config was sent twice")
                config = request.config
                losses.resolve(config.loss_fn, dict(config.loss_fn_config))  # fail before the data arrives
            elif item == "datum":
                datums.append(datum_from_pb(request.datum).validate(self.trainer.vocab_size, f"datums[{len(datums)}]"))
            elif item in ("run", "trace_id"):
                run = run_from_pb(request.run) if item == "run" else await asyncio.to_thread(traces.get, request.trace_id)
                if run.status in (RunStatus.GRADED, RunStatus.UNSPECIFIED):
                    runs.append(run)
                else:  # env or infra failures carry no reward signal
                    num_ungraded += 1
            else:
                raise invalid_field("item", "empty request")
        if config is None:
            raise invalid_field("config", "no ForwardBackwardConfig was sent")
        run_datums, stats = runs_to_datums(
            runs,
            normalize_by_std=config.normalize_advantages_by_std,
            drop_groups_without_signal=config.drop_groups_without_signal,
            reward_scale=config.reward_scale or 1.0,
            group_size=config.group_size,
            allow_incomplete_groups=config.allow_incomplete_groups,
        )
        for i, datum in enumerate(run_datums):
            datum.validate(self.trainer.vocab_size, f"runs[{i}]")
        all_datums = datums + run_datums
        if not all_datums:
            raise invalid_field("items", "the batch is empty (no datums, or every group was dropped)")
        metrics = await self._run(
            self.trainer.forward_backward, all_datums, config.loss_fn, dict(config.loss_fn_config)
        )
        return pb.ForwardBackwardResponse(
            loss_sum=metrics.pop("loss_sum"),
            num_datums=len(all_datums),
            num_action_tokens=int(metrics.pop("num_action_tokens")),
            num_groups=stats.num_groups,
            num_groups_without_signal=stats.num_groups_without_signal,
            metrics={**metrics, "num_runs_ungraded": num_ungraded},
        )

    @rpc
    async def Forward(
        self, request_iterator: AsyncIterator[pb.ForwardRequest], context: grpc.aio.ServicerContext
    ) -> pb.ForwardResponse:
        await self.follow_head()
        assert self.trainer is not None
        items: list[Datum | int] = []  # a datum, or the index of a run
        runs: list[Run] = []
        async for request in request_iterator:
            kind = request.WhichOneof("item")
            if kind == "datum":
                items.append(datum_from_pb(request.datum).validate(self.trainer.vocab_size, f"items[{len(items)}]"))
            elif kind == "run":
                items.append(len(runs))
                runs.append(run_from_pb(request.run))
            else:
                raise invalid_field(f"items[{len(items)}]", "empty request")
        if not items:
            raise invalid_field("items", "the batch is empty")
        run_datums, _ = runs_to_datums(runs)
        datums = [run_datums[item] if isinstance(item, int) else item for item in items]
        for i, datum in enumerate(datums):
            datum.validate(self.trainer.vocab_size, f"items[{i}]")
        logprobs = await self._run(self.trainer.logprobs, datums)
        return pb.ForwardResponse(
            results=[pb.TokenLogprobs(logprobs=lp, datum=datum_pb(d)) for lp, d in zip(logprobs, datums, strict=True)]
        )

    @rpc
    async def Backward(
        self, request_iterator: AsyncIterator[pb.BackwardRequest], context: grpc.aio.ServicerContext
    ) -> pb.BackwardResponse:
        await self.follow_head()
        assert self.trainer is not None
        datums: list[Datum] = []
        async for request in request_iterator:
            datum = datum_from_pb(request.datum)
            datum.sampling_logprobs, datum.advantages = [], []  # only the weights count here
            datums.append(datum.validate(self.trainer.vocab_size, f"datums[{len(datums)}]"))
        if not datums:
            raise invalid_field("items", "the batch is empty")
        # -(weights * lp).sum() is exactly the cross_entropy loss with these weights.
        metrics = await self._run(self.trainer.forward_backward, datums, "cross_entropy", {})
        return pb.BackwardResponse(num_datums=len(datums), num_tokens=int(metrics["num_action_tokens"]))

    @rpc
    async def OptimStep(self, request: pb.OptimStepRequest, context: grpc.aio.ServicerContext) -> pb.OptimStepResponse:
        assert self.trainer is not None
        adam = request.adam
        config = AdamConfig(
            learning_rate=adam.learning_rate,
            beta1=adam.beta1 or 0.9,
            beta2=adam.beta2 or 0.95,
            eps=adam.eps or 1e-8,
            weight_decay=adam.weight_decay,
            max_grad_norm=adam.max_grad_norm,
        )
        grad_norm = await self._run(self.trainer.optim_step, config)
        step = self.trainer.step
        if request.skip_checkpoint:
            return pb.OptimStepResponse(step=step, grad_norm=grad_norm)
        checkpoint_id = f"step-{step:06d}-{uuid.uuid4().hex[:8]}"
        scratch = pathlib.Path(tempfile.mkdtemp(dir=self.work_dir, prefix=".save-"))
        try:
            folder = await self._run(self.trainer.save, scratch / checkpoint_id)
            objects = await asyncio.to_thread(upload_folder, self.store, self.model, checkpoint_id, folder)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        manifest = Manifest(
            model=self.model,
            checkpoint_id=checkpoint_id,
            objects=objects,
            parent_checkpoint_id=self.checkpoint_id,
            step=step,
            metadata_json=request.metadata_json or json.dumps({"grad_norm": grad_norm}),
        )
        _, head = await self.checkpoints.commit_checkpoint(manifest, set_head=request.set_head)
        self.checkpoint_id = checkpoint_id
        return pb.OptimStepResponse(
            step=step,
            checkpoint=common_pb.CheckpointRef(model=self.model, checkpoint_id=checkpoint_id),
            grad_norm=grad_norm,
            head_sequence=head.sequence if head is not None else 0,
        )

    @rpc
    async def ListLosses(self, request: pb.ListLossesRequest, context: grpc.aio.ServicerContext) -> pb.ListLossesResponse:
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
    async def GetTrainerInfo(
        self, request: pb.GetTrainerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetTrainerInfoResponse:
        assert self.trainer is not None
        return pb.GetTrainerInfoResponse(
            model=self.model,
            step=self.trainer.step,
            checkpoint_id=self.checkpoint_id,
            num_pending_datums=self.trainer.num_pending_datums,
            device=self.config.device,
        )
