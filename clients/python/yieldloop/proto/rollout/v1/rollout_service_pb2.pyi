from yieldloop.proto.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RecordRunsRequest(_message.Message):
    __slots__ = ("job_id", "job", "runs")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    job: CreateJobRequest
    runs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Run]
    def __init__(self, job_id: _Optional[str] = ..., job: _Optional[_Union[CreateJobRequest, _Mapping]] = ..., runs: _Optional[_Iterable[_Union[_common_pb2.Run, _Mapping]]] = ...) -> None: ...

class RecordRunsResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class GetTraceSpansRequest(_message.Message):
    __slots__ = ("trace_id",)
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    trace_id: str
    def __init__(self, trace_id: _Optional[str] = ...) -> None: ...

class TraceSpan(_message.Message):
    __slots__ = ("span_id", "parent_span_id", "name", "service", "start_time_unix_nano", "end_time_unix_nano", "status", "error", "attributes")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SPAN_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_SPAN_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    START_TIME_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    END_TIME_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    span_id: str
    parent_span_id: str
    name: str
    service: str
    start_time_unix_nano: int
    end_time_unix_nano: int
    status: str
    error: str
    attributes: _containers.ScalarMap[str, str]
    def __init__(self, span_id: _Optional[str] = ..., parent_span_id: _Optional[str] = ..., name: _Optional[str] = ..., service: _Optional[str] = ..., start_time_unix_nano: _Optional[int] = ..., end_time_unix_nano: _Optional[int] = ..., status: _Optional[str] = ..., error: _Optional[str] = ..., attributes: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GetTraceSpansResponse(_message.Message):
    __slots__ = ("spans",)
    SPANS_FIELD_NUMBER: _ClassVar[int]
    spans: _containers.RepeatedCompositeFieldContainer[TraceSpan]
    def __init__(self, spans: _Optional[_Iterable[_Union[TraceSpan, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "stop", "seed", "ignore_eos")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    ignore_eos: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt_token_ids", "chat", "sampling", "request_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt_token_ids: PromptTokens
    chat: ChatPrompt
    sampling: SamplingParams
    request_id: str
    def __init__(self, model: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[PromptTokens, _Mapping]] = ..., chat: _Optional[_Union[ChatPrompt, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class PromptTokens(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatPrompt(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "weight_version", "finished", "stop_reason", "prompt_token_ids")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    weight_version: str
    finished: bool
    stop_reason: _common_pb2.StopReason
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., weight_version: _Optional[str] = ..., finished: _Optional[bool] = ..., stop_reason: _Optional[_Union[_common_pb2.StopReason, str]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StreamRolloutsRequest(_message.Message):
    __slots__ = ("tasks", "group_size", "max_concurrent", "sampling", "job_id", "max_steps", "episode_timeout_s", "max_attempts", "checkpoint_id", "model", "batch_runs")
    TASKS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    EPISODE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BATCH_RUNS_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[_common_pb2.Task]
    group_size: int
    max_concurrent: int
    sampling: SamplingParams
    job_id: str
    max_steps: int
    episode_timeout_s: float
    max_attempts: int
    checkpoint_id: str
    model: str
    batch_runs: bool
    def __init__(self, tasks: _Optional[_Iterable[_Union[_common_pb2.Task, _Mapping]]] = ..., group_size: _Optional[int] = ..., max_concurrent: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., job_id: _Optional[str] = ..., max_steps: _Optional[int] = ..., episode_timeout_s: _Optional[float] = ..., max_attempts: _Optional[int] = ..., checkpoint_id: _Optional[str] = ..., model: _Optional[str] = ..., batch_runs: _Optional[bool] = ...) -> None: ...

class StreamRolloutsResponse(_message.Message):
    __slots__ = ("run", "runs")
    RUN_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    run: _common_pb2.Run
    runs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Run]
    def __init__(self, run: _Optional[_Union[_common_pb2.Run, _Mapping]] = ..., runs: _Optional[_Iterable[_Union[_common_pb2.Run, _Mapping]]] = ...) -> None: ...

class GetRunsRequest(_message.Message):
    __slots__ = ("trace_ids",)
    TRACE_IDS_FIELD_NUMBER: _ClassVar[int]
    trace_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, trace_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetRunsResponse(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Run]
    def __init__(self, runs: _Optional[_Iterable[_Union[_common_pb2.Run, _Mapping]]] = ...) -> None: ...

class GetServingInfoRequest(_message.Message):
    __slots__ = ("wait_for_checkpoint_id", "model")
    WAIT_FOR_CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    wait_for_checkpoint_id: str
    model: str
    def __init__(self, wait_for_checkpoint_id: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class GetServingInfoResponse(_message.Message):
    __slots__ = ("model", "weight_version", "head_sequence", "engine", "last_reload_error", "openai_base_url", "adapter_base", "engine_weight_loads", "following", "follow_error", "candidate_engine_like_head")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEAD_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    LAST_RELOAD_ERROR_FIELD_NUMBER: _ClassVar[int]
    OPENAI_BASE_URL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_BASE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_WEIGHT_LOADS_FIELD_NUMBER: _ClassVar[int]
    FOLLOWING_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_ERROR_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_ENGINE_LIKE_HEAD_FIELD_NUMBER: _ClassVar[int]
    model: str
    weight_version: str
    head_sequence: int
    engine: str
    last_reload_error: str
    openai_base_url: str
    adapter_base: str
    engine_weight_loads: int
    following: bool
    follow_error: str
    candidate_engine_like_head: bool
    def __init__(self, model: _Optional[str] = ..., weight_version: _Optional[str] = ..., head_sequence: _Optional[int] = ..., engine: _Optional[str] = ..., last_reload_error: _Optional[str] = ..., openai_base_url: _Optional[str] = ..., adapter_base: _Optional[str] = ..., engine_weight_loads: _Optional[int] = ..., following: _Optional[bool] = ..., follow_error: _Optional[str] = ..., candidate_engine_like_head: _Optional[bool] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "model", "name", "group_size", "created_time", "num_runs", "metadata_json", "team")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    CREATED_TIME_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNS_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    TEAM_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    model: str
    name: str
    group_size: int
    created_time: float
    num_runs: int
    metadata_json: str
    team: str
    def __init__(self, job_id: _Optional[str] = ..., model: _Optional[str] = ..., name: _Optional[str] = ..., group_size: _Optional[int] = ..., created_time: _Optional[float] = ..., num_runs: _Optional[int] = ..., metadata_json: _Optional[str] = ..., team: _Optional[str] = ...) -> None: ...

class CreateJobRequest(_message.Message):
    __slots__ = ("model", "name", "group_size", "metadata_json")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    model: str
    name: str
    group_size: int
    metadata_json: str
    def __init__(self, model: _Optional[str] = ..., name: _Optional[str] = ..., group_size: _Optional[int] = ..., metadata_json: _Optional[str] = ...) -> None: ...

class CreateJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ...) -> None: ...

class StreamJobRunsRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class StreamJobRunsResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: _common_pb2.Run
    def __init__(self, run: _Optional[_Union[_common_pb2.Run, _Mapping]] = ...) -> None: ...
