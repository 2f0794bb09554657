"""The one converter between domain types (:mod:`yieldloop.types`) and the generated protobuf messages.

Servicers and the client call these at the wire; nothing else builds protobuf from domain objects.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TypeVar

from yieldloop.errors import invalid_field
from yieldloop.proto.checkpoint.v1 import checkpoint_service_pb2 as ckpt_pb
from yieldloop.proto.common.v1 import common_pb2 as common_pb
from yieldloop.proto.rollout.v1 import rollout_service_pb2 as rollout_pb
from yieldloop.types import (
    AgentStopReason,
    Datum,
    Head,
    JobInfo,
    LoraConfig,
    Manifest,
    ModelInfo,
    ObjectInfo,
    PromptFormat,
    Run,
    RunStatus,
    StopReason,
    TaskRef,
    Turn,
)

E = TypeVar("E", bound=enum.IntEnum)


def head_to_pb(head: Head) -> ckpt_pb.Head:
    return ckpt_pb.Head(**dataclasses.asdict(head))


def head_from_pb(message: ckpt_pb.Head) -> Head:
    return Head(message.model, message.checkpoint_id, message.sequence, message.updated_time)


def lora_to_pb(lora: LoraConfig) -> ckpt_pb.LoraConfig:
    return ckpt_pb.LoraConfig(rank=lora.rank, alpha=lora.alpha, target_modules=list(lora.target_modules))


def lora_from_pb(message: ckpt_pb.LoraConfig) -> LoraConfig:
    return LoraConfig(message.rank, message.alpha, tuple(message.target_modules))


def model_to_pb(info: ModelInfo) -> ckpt_pb.ModelInfo:
    fields = {f.name: getattr(info, f.name) for f in dataclasses.fields(ModelInfo) if f.name != "lora"}
    return ckpt_pb.ModelInfo(**fields, lora=lora_to_pb(info.lora) if info.lora else None)


def model_from_pb(message: ckpt_pb.ModelInfo) -> ModelInfo:
    fields = {f.name: getattr(message, f.name) for f in dataclasses.fields(ModelInfo) if f.name != "lora"}
    return ModelInfo(**fields, lora=lora_from_pb(message.lora) if message.HasField("lora") else None)


def manifest_to_pb(manifest: Manifest | ckpt_pb.Manifest) -> ckpt_pb.Manifest:
    if isinstance(manifest, ckpt_pb.Manifest):
        return manifest
    return ckpt_pb.Manifest(**dataclasses.asdict(manifest))


def manifest_from_pb(message: ckpt_pb.Manifest) -> Manifest:
    return Manifest(
        model=message.model,
        checkpoint_id=message.checkpoint_id,
        objects=[ObjectInfo(o.name, o.size, o.sha256, o.key, o.state) for o in message.objects],
        parent_checkpoint_id=message.parent_checkpoint_id,
        step=message.step,
        created_time=message.created_time,
        metadata_json=message.metadata_json,
        pending=message.pending,
        weights_source=message.weights_source,
    )


def task_ref_from_pb(message: common_pb.Task) -> TaskRef:
    return TaskRef(message.env, message.scenario, message.args_json, message.task_id)


def turn_to_pb(turn: Turn) -> common_pb.Turn:
    return common_pb.Turn(
        prompt_token_ids=turn.prompt_token_ids,
        completion_token_ids=turn.completion_token_ids,
        completion_logprobs=turn.completion_logprobs,
        weight_version=turn.weight_version,
        completion_text=turn.completion_text,
        stop_reason=int(turn.stop_reason),
    )


def _enum(cls: type[E], value: int, field: str) -> E:
    """The domain enum member for a wire value; INVALID_ARGUMENT naming ``field`` for a value this side does not
    know (protobuf keeps unknown enum values as plain integers)."""
    try:
        return cls(value)
    except ValueError:
        raise invalid_field(
            field, f"{field} {value} is not a {cls.__name__} (known: {', '.join(str(int(m)) for m in cls)})"
        ) from None


def turn_from_pb(message: common_pb.Turn) -> Turn:
    return Turn(
        list(message.prompt_token_ids),
        list(message.completion_token_ids),
        list(message.completion_logprobs),
        message.weight_version,
        message.completion_text,
        _enum(StopReason, message.stop_reason, "turns.stop_reason"),
    )


def run_to_pb(run: Run | common_pb.Run) -> common_pb.Run:
    if isinstance(run, common_pb.Run):
        return run
    fields = {f.name: getattr(run, f.name) for f in dataclasses.fields(run)}
    fields.update(
        task=common_pb.Task(**dataclasses.asdict(run.task)),
        turns=[turn_to_pb(t) for t in run.turns],
        status=int(run.status),
        agent_stop_reason=int(run.agent_stop_reason),
        prompt_format=int(run.prompt_format),
    )
    return common_pb.Run(**fields)


def run_from_pb(message: common_pb.Run) -> Run:
    return Run(
        run_id=message.run_id,
        task=task_ref_from_pb(message.task),
        group_id=message.group_id,
        prompt=message.prompt,
        turns=[turn_from_pb(t) for t in message.turns],
        answer=message.answer,
        reward=message.reward,
        info_json=message.info_json,
        status=_enum(RunStatus, message.status, "run.status"),
        error=message.error,
        model=message.model,
        trace_id=message.trace_id,
        agent_stop_reason=_enum(AgentStopReason, message.agent_stop_reason, "run.agent_stop_reason"),
        attempts=message.attempts,
        prompt_format=_enum(PromptFormat, message.prompt_format, "run.prompt_format"),
        team=message.team,
    )


def run_to_bytes(run: Run) -> bytes:
    """A run in its wire encoding (how the trace store keeps it)."""
    return run_to_pb(run).SerializeToString()


def run_from_bytes(data: bytes) -> Run:
    return run_from_pb(common_pb.Run.FromString(data))


def job_to_pb(job: JobInfo) -> rollout_pb.Job:
    return rollout_pb.Job(**dataclasses.asdict(job))


def job_from_pb(message: rollout_pb.Job) -> JobInfo:
    return JobInfo(
        message.job_id,
        message.model,
        message.name,
        message.group_size,
        message.created_time,
        message.metadata_json,
        message.num_runs,
        message.team,
    )


def datum_to_pb(datum: Datum | common_pb.Datum) -> common_pb.Datum:
    if isinstance(datum, common_pb.Datum):
        return datum
    return common_pb.Datum(**dataclasses.asdict(datum))


def datum_from_pb(message: common_pb.Datum) -> Datum:
    return Datum(
        list(message.input_tokens),
        list(message.target_tokens),
        list(message.sampling_logprobs),
        list(message.advantages),
        list(message.weights),
    )
