"""Domain types at the seams between services: plain dataclasses, no protobuf, no grpc.

Services and the client library pass these; :mod:`yieldloop.convert` is the one place they become protobuf
messages and back. Field names match the wire messages, so code reads the same on either side.
"""

from __future__ import annotations

import dataclasses
import enum
import json


@dataclasses.dataclass
class ModelInfo:
    """A model slug: its base, the model it was forked from, its owner."""

    slug: str
    base: str
    parent: str = ""
    owner: str = ""
    trainable: bool = True
    created_time: float = 0.0


@dataclasses.dataclass
class ObjectInfo:
    """One object of a checkpoint, with the checksum every reader verifies."""

    name: str
    size: int
    sha256: str
    key: str


@dataclasses.dataclass
class Manifest:
    """A checkpoint: its objects (written first) and where it sits in the model's tree."""

    model: str
    checkpoint_id: str
    objects: list[ObjectInfo]
    parent_checkpoint_id: str = ""
    step: int = 0
    created_time: float = 0.0
    metadata_json: str = ""

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        raw = json.loads(data)
        raw["objects"] = [ObjectInfo(**o) for o in raw["objects"]]
        return cls(**raw)


@dataclasses.dataclass
class Head:
    """A model's HEAD pointer: the served checkpoint and a sequence that grows with every move."""

    model: str
    checkpoint_id: str
    sequence: int
    updated_time: float


class StopReason(enum.IntEnum):
    """Why one completion ended (values as ``yieldloop.common.v1.StopReason``)."""

    UNSPECIFIED = 0
    EOS = 1
    LENGTH = 2
    STOP_STRING = 3
    CANCELLED = 4
    CONTEXT = 5


class AgentStopReason(enum.IntEnum):
    """Why the agent loop ended an episode (values as ``yieldloop.common.v1.AgentStopReason``)."""

    UNSPECIFIED = 0
    ANSWER = 1
    MAX_STEPS = 2
    MALFORMED_TOOL_CALL = 3
    DEADLINE = 4
    CONTEXT = 5


class RunStatus(enum.IntEnum):
    """How an episode ended (values as ``yieldloop.common.v1.RunStatus``)."""

    UNSPECIFIED = 0
    GRADED = 1
    ENV_ERROR = 2
    INFRA_ERROR = 3


@dataclasses.dataclass
class TaskRef:
    """The task a run played, as recorded: arguments as JSON, and the task's stable id."""

    env: str = ""
    scenario: str = ""
    args_json: str = ""
    task_id: str = ""


@dataclasses.dataclass
class Turn:
    """One model turn, token-exact: the prompt it saw, what it sampled with the sampling logprobs."""

    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)
    completion_token_ids: list[int] = dataclasses.field(default_factory=list)
    completion_logprobs: list[float] = dataclasses.field(default_factory=list)
    weight_version: str = ""
    completion_text: str = ""
    stop_reason: StopReason = StopReason.UNSPECIFIED


@dataclasses.dataclass
class Run:
    """One episode: the task, every turn, the answer and its reward (or why there is none)."""

    run_id: str = ""
    task: TaskRef = dataclasses.field(default_factory=TaskRef)
    group_id: str = ""
    prompt: str = ""
    turns: list[Turn] = dataclasses.field(default_factory=list)
    answer: str = ""
    reward: float = 0.0
    info_json: str = ""
    status: RunStatus = RunStatus.UNSPECIFIED
    error: str = ""
    model: str = ""
    trace_id: str = ""
    agent_stop_reason: AgentStopReason = AgentStopReason.UNSPECIFIED
    attempts: int = 0


@dataclasses.dataclass
class JobInfo:
    """A recorded job: a named set of runs of one model."""

    job_id: str = ""
    model: str = ""
    name: str = ""
    group_size: int = 0
    created_time: float = 0.0
    metadata_json: str = ""
    num_runs: int = 0
