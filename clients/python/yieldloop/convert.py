"""The one converter between domain types (:mod:`yieldloop.types`) and the generated protobuf messages.

Servicers and the client call these at the wire; nothing else builds protobuf from domain objects.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf import message_factory

from yieldloop.errors import invalid_field
from yieldloop.proto.checkpoint.v1 import checkpoint_service_pb2 as ckpt_pb
from yieldloop.proto.common.v1 import common_pb2 as common_pb
from yieldloop.proto.rollout.v1 import rollout_service_pb2 as rollout_pb
from yieldloop.proto.trainer.v1 import trainer_service_pb2 as trainer_pb
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
    WeightBroadcast,
    WeightEvent,
    WeightGroup,
    WeightPiece,
    WeightSubscribed,
)

E = TypeVar("E", bound=enum.IntEnum)
T = TypeVar("T")

_READERS: dict[type, list[tuple[str, Callable[[Any], Any]]]] = {}


def from_pb(cls: type[T], message: Any) -> T:
    """The domain dataclass ``cls`` from a message with the same field names: nested messages (None when an
    optional one is unset), repeated fields, maps and enums (checked: :func:`_enum`) follow the dataclass's
    annotations. The plan per class is made once."""
    readers = _READERS.get(cls)
    if readers is None:
        hints = typing.get_type_hints(cls)
        readers = _READERS[cls] = [(f.name, _reader(f.name, hints[f.name])) for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    return cls(**{name: read(message) for name, read in readers})


def _reader(name: str, hint: Any) -> Callable[[Any], Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):  # X | None: an optional message
        read = _reader(name, next(a for a in args if a is not type(None)))
        return lambda m: read(m) if m.HasField(name) else None
    if origin in (list, tuple):
        inner = args[0]
        if dataclasses.is_dataclass(inner):
            return lambda m: origin(from_pb(inner, item) for item in getattr(m, name))  # type: ignore[arg-type]
        return lambda m: origin(getattr(m, name))
    if origin is dict:
        return lambda m: dict(getattr(m, name))
    if isinstance(hint, type) and issubclass(hint, enum.IntEnum):
        return lambda m: _enum(hint, getattr(m, name), name)
    if dataclasses.is_dataclass(hint):
        return lambda m: from_pb(hint, getattr(m, name))  # type: ignore[arg-type]
    return lambda m: getattr(m, name)


def to_pb(message_cls: type[T], obj: Any) -> T:
    """The message ``message_cls`` from a domain dataclass with the same field names (the inverse of
    :func:`from_pb`)."""
    fields = message_cls.DESCRIPTOR.fields_by_name  # type: ignore[attr-defined]
    values = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None:
            continue
        if dataclasses.is_dataclass(value):
            value = to_pb(message_factory.GetMessageClass(fields[f.name].message_type), value)
        elif isinstance(value, (list, tuple)) and value and dataclasses.is_dataclass(value[0]):
            item_cls = message_factory.GetMessageClass(fields[f.name].message_type)
            value = [to_pb(item_cls, item) for item in value]
        values[f.name] = value
    return message_cls(**values)


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


def weight_event_to_pb(event: WeightEvent) -> trainer_pb.SubscribeWeightsResponse:
    if isinstance(event, WeightGroup):
        return trainer_pb.SubscribeWeightsResponse(group=trainer_pb.WeightGroup(**dataclasses.asdict(event)))
    if isinstance(event, WeightBroadcast):
        objects = [trainer_pb.WeightObject(name=o.name, size=o.size, sha256=o.sha256) for o in event.objects]
        broadcast = trainer_pb.WeightBroadcast(
            checkpoint_id=event.checkpoint_id, chunk_bytes=event.chunk_bytes, objects=objects
        )
        return trainer_pb.SubscribeWeightsResponse(broadcast=broadcast)
    return trainer_pb.SubscribeWeightsResponse(subscribed=True)


def weight_event_from_pb(message: trainer_pb.SubscribeWeightsResponse) -> WeightEvent:
    kind = message.WhichOneof("event")
    if kind == "group":
        g = message.group
        return WeightGroup(g.address, g.name, g.rank, g.size, g.backend, g.wait_until_open)
    if kind == "broadcast":
        b = message.broadcast
        objects = tuple(ObjectInfo(o.name, o.size, o.sha256, key="") for o in b.objects)
        return WeightBroadcast(b.checkpoint_id, b.chunk_bytes, objects)
    if kind == "subscribed":
        return WeightSubscribed()
    raise invalid_field("event", "a weight group message with no event")


def weight_piece_to_pb(piece: WeightPiece) -> trainer_pb.PullWeightsResponse:
    return trainer_pb.PullWeightsResponse(local_folder=piece.local_folder, name=piece.name, data=piece.data)


def weight_piece_from_pb(message: trainer_pb.PullWeightsResponse) -> WeightPiece:
    return WeightPiece(message.local_folder, message.name, message.data)


def task_to_pb(task: Any) -> common_pb.Task:
    """The wire form of a task (:class:`yieldloop.environment.Task` or :class:`TaskRef`)."""
    return common_pb.Task(env=task.env, scenario=task.scenario, args_json=task.args_json, task_id=task.task_id)


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
