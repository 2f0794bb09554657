from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StopReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STOP_REASON_UNSPECIFIED: _ClassVar[StopReason]
    STOP_REASON_EOS: _ClassVar[StopReason]
    STOP_REASON_LENGTH: _ClassVar[StopReason]
    STOP_REASON_STOP_STRING: _ClassVar[StopReason]
    STOP_REASON_CANCELLED: _ClassVar[StopReason]
    STOP_REASON_CONTEXT: _ClassVar[StopReason]

class AgentStopReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AGENT_STOP_REASON_UNSPECIFIED: _ClassVar[AgentStopReason]
    AGENT_STOP_REASON_ANSWER: _ClassVar[AgentStopReason]
    AGENT_STOP_REASON_MAX_STEPS: _ClassVar[AgentStopReason]
    AGENT_STOP_REASON_MALFORMED_TOOL_CALL: _ClassVar[AgentStopReason]
    AGENT_STOP_REASON_DEADLINE: _ClassVar[AgentStopReason]
    AGENT_STOP_REASON_CONTEXT: _ClassVar[AgentStopReason]

class RunStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATUS_UNSPECIFIED: _ClassVar[RunStatus]
    RUN_STATUS_GRADED: _ClassVar[RunStatus]
    RUN_STATUS_ENV_ERROR: _ClassVar[RunStatus]
    RUN_STATUS_INFRA_ERROR: _ClassVar[RunStatus]

class PromptFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROMPT_FORMAT_UNSPECIFIED: _ClassVar[PromptFormat]
    PROMPT_FORMAT_CHAT: _ClassVar[PromptFormat]
    PROMPT_FORMAT_RAW: _ClassVar[PromptFormat]

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    INVALID_FIELD: _ClassVar[ErrorReason]
    SCENARIO_NOT_FOUND: _ClassVar[ErrorReason]
    SCENARIO_ARGS_INVALID: _ClassVar[ErrorReason]
    ENVIRONMENT_NOT_FOUND: _ClassVar[ErrorReason]
    ENVIRONMENT_ERROR: _ClassVar[ErrorReason]
    TOOL_NOT_FOUND: _ClassVar[ErrorReason]
    EPISODE_PROTOCOL: _ClassVar[ErrorReason]
    MODEL_NOT_FOUND: _ClassVar[ErrorReason]
    MODEL_ALREADY_EXISTS: _ClassVar[ErrorReason]
    CHECKPOINT_NOT_FOUND: _ClassVar[ErrorReason]
    CHECKPOINT_ALREADY_EXISTS: _ClassVar[ErrorReason]
    CHECKPOINT_CORRUPT: _ClassVar[ErrorReason]
    HEAD_CONFLICT: _ClassVar[ErrorReason]
    DATUM_INVALID: _ClassVar[ErrorReason]
    LOSS_UNKNOWN: _ClassVar[ErrorReason]
    NO_GRADIENTS: _ClassVar[ErrorReason]
    ENGINE_NOT_READY: _ClassVar[ErrorReason]
    PROMPT_TOO_LONG: _ClassVar[ErrorReason]
    TOKEN_OUT_OF_VOCAB: _ClassVar[ErrorReason]
    WEIGHTS_NOT_LOADED: _ClassVar[ErrorReason]
    NOT_IMPLEMENTED: _ClassVar[ErrorReason]
    INTERNAL: _ClassVar[ErrorReason]
    TOOL_ARGS_INVALID: _ClassVar[ErrorReason]
    WORKER_DIED: _ClassVar[ErrorReason]
    EPISODE_DEADLINE: _ClassVar[ErrorReason]
    TOOL_DEADLINE: _ClassVar[ErrorReason]
    GROUP_INCOMPLETE: _ClassVar[ErrorReason]
    TRACE_NOT_FOUND: _ClassVar[ErrorReason]
    ENGINE_ERROR: _ClassVar[ErrorReason]
    JOB_NOT_FOUND: _ClassVar[ErrorReason]
    RUN_NOT_FOUND: _ClassVar[ErrorReason]
    STACK_NOT_RUNNING: _ClassVar[ErrorReason]
    BAD_CONFIG: _ClassVar[ErrorReason]
    INVALID_JSON: _ClassVar[ErrorReason]
    MISSING_DEPENDENCY: _ClassVar[ErrorReason]
    MODEL_SOURCE_NOT_FOUND: _ClassVar[ErrorReason]
    MODEL_SOURCE_INVALID: _ClassVar[ErrorReason]
    NO_CHAT_TEMPLATE: _ClassVar[ErrorReason]
    TOO_MANY_MODELS: _ClassVar[ErrorReason]
    MODEL_TOO_LARGE: _ClassVar[ErrorReason]
    NON_FINITE: _ClassVar[ErrorReason]
    MODEL_IN_USE: _ClassVar[ErrorReason]
    REQUEST_TIMEOUT: _ClassVar[ErrorReason]
    CHECKPOINT_PENDING: _ClassVar[ErrorReason]
    API_KEY_MISSING: _ClassVar[ErrorReason]
    API_KEY_INVALID: _ClassVar[ErrorReason]
    ROLE_NOT_ALLOWED: _ClassVar[ErrorReason]
    MODEL_NOT_OWNED: _ClassVar[ErrorReason]
    API_KEY_NOT_FOUND: _ClassVar[ErrorReason]
    JOB_NOT_OWNED: _ClassVar[ErrorReason]
    RUN_NOT_OWNED: _ClassVar[ErrorReason]
    FORWARD_NOT_FOUND: _ClassVar[ErrorReason]
    GATEWAY_UNAVAILABLE: _ClassVar[ErrorReason]
    EPISODE_STREAM_LOST: _ClassVar[ErrorReason]
    WEIGHT_GROUP_UNAVAILABLE: _ClassVar[ErrorReason]
    CHECKPOINT_ABANDONED: _ClassVar[ErrorReason]
    TRACE_ALREADY_RECORDED: _ClassVar[ErrorReason]
    NO_SPACE: _ClassVar[ErrorReason]
    REQUEST_TOO_LARGE: _ClassVar[ErrorReason]
    IMPORT_PATH_REFUSED: _ClassVar[ErrorReason]
    SERVICE_FAILED: _ClassVar[ErrorReason]
    STACK_LOCKED: _ClassVar[ErrorReason]
    PORT_IN_USE: _ClassVar[ErrorReason]
    NO_GRADED_RUNS: _ClassVar[ErrorReason]
STOP_REASON_UNSPECIFIED: StopReason
STOP_REASON_EOS: StopReason
STOP_REASON_LENGTH: StopReason
STOP_REASON_STOP_STRING: StopReason
STOP_REASON_CANCELLED: StopReason
STOP_REASON_CONTEXT: StopReason
AGENT_STOP_REASON_UNSPECIFIED: AgentStopReason
AGENT_STOP_REASON_ANSWER: AgentStopReason
AGENT_STOP_REASON_MAX_STEPS: AgentStopReason
AGENT_STOP_REASON_MALFORMED_TOOL_CALL: AgentStopReason
AGENT_STOP_REASON_DEADLINE: AgentStopReason
AGENT_STOP_REASON_CONTEXT: AgentStopReason
RUN_STATUS_UNSPECIFIED: RunStatus
RUN_STATUS_GRADED: RunStatus
RUN_STATUS_ENV_ERROR: RunStatus
RUN_STATUS_INFRA_ERROR: RunStatus
PROMPT_FORMAT_UNSPECIFIED: PromptFormat
PROMPT_FORMAT_CHAT: PromptFormat
PROMPT_FORMAT_RAW: PromptFormat
ERROR_REASON_UNSPECIFIED: ErrorReason
INVALID_FIELD: ErrorReason
SCENARIO_NOT_FOUND: ErrorReason
SCENARIO_ARGS_INVALID: ErrorReason
ENVIRONMENT_NOT_FOUND: ErrorReason
ENVIRONMENT_ERROR: ErrorReason
TOOL_NOT_FOUND: ErrorReason
EPISODE_PROTOCOL: ErrorReason
MODEL_NOT_FOUND: ErrorReason
MODEL_ALREADY_EXISTS: ErrorReason
CHECKPOINT_NOT_FOUND: ErrorReason
CHECKPOINT_ALREADY_EXISTS: ErrorReason
CHECKPOINT_CORRUPT: ErrorReason
HEAD_CONFLICT: ErrorReason
DATUM_INVALID: ErrorReason
LOSS_UNKNOWN: ErrorReason
NO_GRADIENTS: ErrorReason
ENGINE_NOT_READY: ErrorReason
PROMPT_TOO_LONG: ErrorReason
TOKEN_OUT_OF_VOCAB: ErrorReason
WEIGHTS_NOT_LOADED: ErrorReason
NOT_IMPLEMENTED: ErrorReason
INTERNAL: ErrorReason
TOOL_ARGS_INVALID: ErrorReason
WORKER_DIED: ErrorReason
EPISODE_DEADLINE: ErrorReason
TOOL_DEADLINE: ErrorReason
GROUP_INCOMPLETE: ErrorReason
TRACE_NOT_FOUND: ErrorReason
ENGINE_ERROR: ErrorReason
JOB_NOT_FOUND: ErrorReason
RUN_NOT_FOUND: ErrorReason
STACK_NOT_RUNNING: ErrorReason
BAD_CONFIG: ErrorReason
INVALID_JSON: ErrorReason
MISSING_DEPENDENCY: ErrorReason
MODEL_SOURCE_NOT_FOUND: ErrorReason
MODEL_SOURCE_INVALID: ErrorReason
NO_CHAT_TEMPLATE: ErrorReason
TOO_MANY_MODELS: ErrorReason
MODEL_TOO_LARGE: ErrorReason
NON_FINITE: ErrorReason
MODEL_IN_USE: ErrorReason
REQUEST_TIMEOUT: ErrorReason
CHECKPOINT_PENDING: ErrorReason
API_KEY_MISSING: ErrorReason
API_KEY_INVALID: ErrorReason
ROLE_NOT_ALLOWED: ErrorReason
MODEL_NOT_OWNED: ErrorReason
API_KEY_NOT_FOUND: ErrorReason
JOB_NOT_OWNED: ErrorReason
RUN_NOT_OWNED: ErrorReason
FORWARD_NOT_FOUND: ErrorReason
GATEWAY_UNAVAILABLE: ErrorReason
EPISODE_STREAM_LOST: ErrorReason
WEIGHT_GROUP_UNAVAILABLE: ErrorReason
CHECKPOINT_ABANDONED: ErrorReason
TRACE_ALREADY_RECORDED: ErrorReason
NO_SPACE: ErrorReason
REQUEST_TOO_LARGE: ErrorReason
IMPORT_PATH_REFUSED: ErrorReason
SERVICE_FAILED: ErrorReason
STACK_LOCKED: ErrorReason
PORT_IN_USE: ErrorReason
NO_GRADED_RUNS: ErrorReason

class Task(_message.Message):
    __slots__ = ("env", "scenario", "args_json", "task_id")
    ENV_FIELD_NUMBER: _ClassVar[int]
    SCENARIO_FIELD_NUMBER: _ClassVar[int]
    ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    env: str
    scenario: str
    args_json: str
    task_id: str
    def __init__(self, env: _Optional[str] = ..., scenario: _Optional[str] = ..., args_json: _Optional[str] = ..., task_id: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ToolSpec(_message.Message):
    __slots__ = ("name", "description", "parameters_json_schema")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json_schema: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json_schema: _Optional[str] = ...) -> None: ...

class Turn(_message.Message):
    __slots__ = ("prompt_token_ids", "completion_token_ids", "completion_logprobs", "weight_version", "completion_text", "stop_reason")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TEXT_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_logprobs: _containers.RepeatedScalarFieldContainer[float]
    weight_version: str
    completion_text: str
    stop_reason: StopReason
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., completion_token_ids: _Optional[_Iterable[int]] = ..., completion_logprobs: _Optional[_Iterable[float]] = ..., weight_version: _Optional[str] = ..., completion_text: _Optional[str] = ..., stop_reason: _Optional[_Union[StopReason, str]] = ...) -> None: ...

class Run(_message.Message):
    __slots__ = ("run_id", "task", "group_id", "prompt", "turns", "answer", "reward", "info_json", "status", "error", "model", "trace_id", "agent_stop_reason", "attempts", "prompt_format", "team")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    TEAM_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    task: Task
    group_id: str
    prompt: str
    turns: _containers.RepeatedCompositeFieldContainer[Turn]
    answer: str
    reward: float
    info_json: str
    status: RunStatus
    error: str
    model: str
    trace_id: str
    agent_stop_reason: AgentStopReason
    attempts: int
    prompt_format: PromptFormat
    team: str
    def __init__(self, run_id: _Optional[str] = ..., task: _Optional[_Union[Task, _Mapping]] = ..., group_id: _Optional[str] = ..., prompt: _Optional[str] = ..., turns: _Optional[_Iterable[_Union[Turn, _Mapping]]] = ..., answer: _Optional[str] = ..., reward: _Optional[float] = ..., info_json: _Optional[str] = ..., status: _Optional[_Union[RunStatus, str]] = ..., error: _Optional[str] = ..., model: _Optional[str] = ..., trace_id: _Optional[str] = ..., agent_stop_reason: _Optional[_Union[AgentStopReason, str]] = ..., attempts: _Optional[int] = ..., prompt_format: _Optional[_Union[PromptFormat, str]] = ..., team: _Optional[str] = ...) -> None: ...

class Datum(_message.Message):
    __slots__ = ("input_tokens", "target_tokens", "sampling_logprobs", "advantages", "weights")
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    input_tokens: _containers.RepeatedScalarFieldContainer[int]
    target_tokens: _containers.RepeatedScalarFieldContainer[int]
    sampling_logprobs: _containers.RepeatedScalarFieldContainer[float]
    advantages: _containers.RepeatedScalarFieldContainer[float]
    weights: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, input_tokens: _Optional[_Iterable[int]] = ..., target_tokens: _Optional[_Iterable[int]] = ..., sampling_logprobs: _Optional[_Iterable[float]] = ..., advantages: _Optional[_Iterable[float]] = ..., weights: _Optional[_Iterable[float]] = ...) -> None: ...

class CheckpointRef(_message.Message):
    __slots__ = ("model", "checkpoint_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    checkpoint_id: str
    def __init__(self, model: _Optional[str] = ..., checkpoint_id: _Optional[str] = ...) -> None: ...
