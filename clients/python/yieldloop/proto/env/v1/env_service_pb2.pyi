from yieldloop.proto.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListScenariosRequest(_message.Message):
    __slots__ = ("env",)
    ENV_FIELD_NUMBER: _ClassVar[int]
    env: str
    def __init__(self, env: _Optional[str] = ...) -> None: ...

class ScenarioSpec(_message.Message):
    __slots__ = ("env", "name", "description", "args_json_schema")
    ENV_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    ARGS_JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    env: str
    name: str
    description: str
    args_json_schema: str
    def __init__(self, env: _Optional[str] = ..., name: _Optional[str] = ..., description: _Optional[str] = ..., args_json_schema: _Optional[str] = ...) -> None: ...

class ListScenariosResponse(_message.Message):
    __slots__ = ("scenarios", "tools")
    SCENARIOS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    scenarios: _containers.RepeatedCompositeFieldContainer[ScenarioSpec]
    tools: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolSpec]
    def __init__(self, scenarios: _Optional[_Iterable[_Union[ScenarioSpec, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[_common_pb2.ToolSpec, _Mapping]]] = ...) -> None: ...

class StartEpisode(_message.Message):
    __slots__ = ("task", "episode_id")
    TASK_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    task: _common_pb2.Task
    episode_id: str
    def __init__(self, task: _Optional[_Union[_common_pb2.Task, _Mapping]] = ..., episode_id: _Optional[str] = ...) -> None: ...

class CallTool(_message.Message):
    __slots__ = ("call_id", "name", "arguments_json", "errors_as_results")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    ERRORS_AS_RESULTS_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    name: str
    arguments_json: str
    errors_as_results: bool
    def __init__(self, call_id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ..., errors_as_results: _Optional[bool] = ...) -> None: ...

class SubmitAnswer(_message.Message):
    __slots__ = ("answer", "stop_reason", "completion_token_ids")
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    answer: str
    stop_reason: _common_pb2.StopReason
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, answer: _Optional[str] = ..., stop_reason: _Optional[_Union[_common_pb2.StopReason, str]] = ..., completion_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StreamEpisodeRequest(_message.Message):
    __slots__ = ("start", "call_tool", "submit")
    START_FIELD_NUMBER: _ClassVar[int]
    CALL_TOOL_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    start: StartEpisode
    call_tool: CallTool
    submit: SubmitAnswer
    def __init__(self, start: _Optional[_Union[StartEpisode, _Mapping]] = ..., call_tool: _Optional[_Union[CallTool, _Mapping]] = ..., submit: _Optional[_Union[SubmitAnswer, _Mapping]] = ...) -> None: ...

class EpisodeStarted(_message.Message):
    __slots__ = ("episode_id", "prompt", "messages", "tools", "raw_text")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    RAW_TEXT_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    tools: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolSpec]
    raw_text: bool
    def __init__(self, episode_id: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[_common_pb2.ToolSpec, _Mapping]]] = ..., raw_text: _Optional[bool] = ...) -> None: ...

class ToolResult(_message.Message):
    __slots__ = ("call_id", "content", "is_error")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    IS_ERROR_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    content: str
    is_error: bool
    def __init__(self, call_id: _Optional[str] = ..., content: _Optional[str] = ..., is_error: _Optional[bool] = ...) -> None: ...

class EpisodeGraded(_message.Message):
    __slots__ = ("reward", "info_json")
    REWARD_FIELD_NUMBER: _ClassVar[int]
    INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    reward: float
    info_json: str
    def __init__(self, reward: _Optional[float] = ..., info_json: _Optional[str] = ...) -> None: ...

class StreamEpisodeResponse(_message.Message):
    __slots__ = ("started", "tool_result", "graded")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    TOOL_RESULT_FIELD_NUMBER: _ClassVar[int]
    GRADED_FIELD_NUMBER: _ClassVar[int]
    started: EpisodeStarted
    tool_result: ToolResult
    graded: EpisodeGraded
    def __init__(self, started: _Optional[_Union[EpisodeStarted, _Mapping]] = ..., tool_result: _Optional[_Union[ToolResult, _Mapping]] = ..., graded: _Optional[_Union[EpisodeGraded, _Mapping]] = ...) -> None: ...

class StreamEpisodesRequest(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[EpisodeRequestFrame]
    def __init__(self, frames: _Optional[_Iterable[_Union[EpisodeRequestFrame, _Mapping]]] = ...) -> None: ...

class EpisodeRequestFrame(_message.Message):
    __slots__ = ("tag", "request", "close", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TAG_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    tag: int
    request: StreamEpisodeRequest
    close: bool
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, tag: _Optional[int] = ..., request: _Optional[_Union[StreamEpisodeRequest, _Mapping]] = ..., close: _Optional[bool] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StreamEpisodesResponse(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[EpisodeResponseFrame]
    def __init__(self, frames: _Optional[_Iterable[_Union[EpisodeResponseFrame, _Mapping]]] = ...) -> None: ...

class EpisodeResponseFrame(_message.Message):
    __slots__ = ("tag", "response", "closed", "error")
    TAG_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    tag: int
    response: StreamEpisodeResponse
    closed: bool
    error: EpisodeError
    def __init__(self, tag: _Optional[int] = ..., response: _Optional[_Union[StreamEpisodeResponse, _Mapping]] = ..., closed: _Optional[bool] = ..., error: _Optional[_Union[EpisodeError, _Mapping]] = ...) -> None: ...

class EpisodeError(_message.Message):
    __slots__ = ("code", "message", "reason", "field")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    reason: str
    field: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., reason: _Optional[str] = ..., field: _Optional[str] = ...) -> None: ...
