from yieldloop.proto.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubscribeWeightsRequest(_message.Message):
    __slots__ = ("model", "backend")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    model: str
    backend: str
    def __init__(self, model: _Optional[str] = ..., backend: _Optional[str] = ...) -> None: ...

class WeightGroup(_message.Message):
    __slots__ = ("address", "name", "rank", "size", "backend", "wait_until_open")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    WAIT_UNTIL_OPEN_FIELD_NUMBER: _ClassVar[int]
    address: str
    name: str
    rank: int
    size: int
    backend: str
    wait_until_open: bool
    def __init__(self, address: _Optional[str] = ..., name: _Optional[str] = ..., rank: _Optional[int] = ..., size: _Optional[int] = ..., backend: _Optional[str] = ..., wait_until_open: _Optional[bool] = ...) -> None: ...

class WeightBroadcast(_message.Message):
    __slots__ = ("checkpoint_id", "objects", "chunk_bytes")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    objects: _containers.RepeatedCompositeFieldContainer[WeightObject]
    chunk_bytes: int
    def __init__(self, checkpoint_id: _Optional[str] = ..., objects: _Optional[_Iterable[_Union[WeightObject, _Mapping]]] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class WeightObject(_message.Message):
    __slots__ = ("name", "size", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    sha256: str
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class SubscribeWeightsResponse(_message.Message):
    __slots__ = ("subscribed", "group", "broadcast")
    SUBSCRIBED_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    BROADCAST_FIELD_NUMBER: _ClassVar[int]
    subscribed: bool
    group: WeightGroup
    broadcast: WeightBroadcast
    def __init__(self, subscribed: _Optional[bool] = ..., group: _Optional[_Union[WeightGroup, _Mapping]] = ..., broadcast: _Optional[_Union[WeightBroadcast, _Mapping]] = ...) -> None: ...

class PullWeightsRequest(_message.Message):
    __slots__ = ("model", "checkpoint_id", "host_id", "probe")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    model: str
    checkpoint_id: str
    host_id: str
    probe: bool
    def __init__(self, model: _Optional[str] = ..., checkpoint_id: _Optional[str] = ..., host_id: _Optional[str] = ..., probe: _Optional[bool] = ...) -> None: ...

class PullWeightsResponse(_message.Message):
    __slots__ = ("local_folder", "name", "data")
    LOCAL_FOLDER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    local_folder: str
    name: str
    data: bytes
    def __init__(self, local_folder: _Optional[str] = ..., name: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class ForwardBackwardConfig(_message.Message):
    __slots__ = ("loss_fn", "loss_fn_config", "normalize_advantages_by_std", "drop_groups_without_signal", "reward_scale", "group_size", "allow_incomplete_groups", "model")
    class LossFnConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LOSS_FN_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_CONFIG_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_ADVANTAGES_BY_STD_FIELD_NUMBER: _ClassVar[int]
    DROP_GROUPS_WITHOUT_SIGNAL_FIELD_NUMBER: _ClassVar[int]
    REWARD_SCALE_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ALLOW_INCOMPLETE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    loss_fn: str
    loss_fn_config: _containers.ScalarMap[str, float]
    normalize_advantages_by_std: bool
    drop_groups_without_signal: bool
    reward_scale: float
    group_size: int
    allow_incomplete_groups: bool
    model: str
    def __init__(self, loss_fn: _Optional[str] = ..., loss_fn_config: _Optional[_Mapping[str, float]] = ..., normalize_advantages_by_std: _Optional[bool] = ..., drop_groups_without_signal: _Optional[bool] = ..., reward_scale: _Optional[float] = ..., group_size: _Optional[int] = ..., allow_incomplete_groups: _Optional[bool] = ..., model: _Optional[str] = ...) -> None: ...

class ForwardBackwardRequest(_message.Message):
    __slots__ = ("config", "datum", "run", "trace_id")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    DATUM_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    config: ForwardBackwardConfig
    datum: _common_pb2.Datum
    run: _common_pb2.Run
    trace_id: str
    def __init__(self, config: _Optional[_Union[ForwardBackwardConfig, _Mapping]] = ..., datum: _Optional[_Union[_common_pb2.Datum, _Mapping]] = ..., run: _Optional[_Union[_common_pb2.Run, _Mapping]] = ..., trace_id: _Optional[str] = ...) -> None: ...

class ForwardBackwardResponse(_message.Message):
    __slots__ = ("loss_sum", "num_datums", "num_action_tokens", "num_groups", "num_groups_without_signal", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LOSS_SUM_FIELD_NUMBER: _ClassVar[int]
    NUM_DATUMS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_WITHOUT_SIGNAL_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    loss_sum: float
    num_datums: int
    num_action_tokens: int
    num_groups: int
    num_groups_without_signal: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, loss_sum: _Optional[float] = ..., num_datums: _Optional[int] = ..., num_action_tokens: _Optional[int] = ..., num_groups: _Optional[int] = ..., num_groups_without_signal: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("datum", "run", "model")
    DATUM_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    datum: _common_pb2.Datum
    run: _common_pb2.Run
    model: str
    def __init__(self, datum: _Optional[_Union[_common_pb2.Datum, _Mapping]] = ..., run: _Optional[_Union[_common_pb2.Run, _Mapping]] = ..., model: _Optional[str] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprobs", "datum")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DATUM_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    datum: _common_pb2.Datum
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., datum: _Optional[_Union[_common_pb2.Datum, _Mapping]] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, results: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class BackwardRequest(_message.Message):
    __slots__ = ("datum", "model")
    DATUM_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    datum: _common_pb2.Datum
    model: str
    def __init__(self, datum: _Optional[_Union[_common_pb2.Datum, _Mapping]] = ..., model: _Optional[str] = ...) -> None: ...

class BackwardResponse(_message.Message):
    __slots__ = ("num_datums", "num_tokens")
    NUM_DATUMS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_datums: int
    num_tokens: int
    def __init__(self, num_datums: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class AdamParams(_message.Message):
    __slots__ = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "max_grad_norm")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    max_grad_norm: float
    def __init__(self, learning_rate: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., max_grad_norm: _Optional[float] = ...) -> None: ...

class OptimStepRequest(_message.Message):
    __slots__ = ("adam", "set_head", "metadata_json", "skip_checkpoint", "model", "idempotency_key", "drop_gradients_if_refused", "save_state", "wait_durable")
    ADAM_FIELD_NUMBER: _ClassVar[int]
    SET_HEAD_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    SKIP_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    DROP_GRADIENTS_IF_REFUSED_FIELD_NUMBER: _ClassVar[int]
    SAVE_STATE_FIELD_NUMBER: _ClassVar[int]
    WAIT_DURABLE_FIELD_NUMBER: _ClassVar[int]
    adam: AdamParams
    set_head: bool
    metadata_json: str
    skip_checkpoint: bool
    model: str
    idempotency_key: str
    drop_gradients_if_refused: bool
    save_state: bool
    wait_durable: bool
    def __init__(self, adam: _Optional[_Union[AdamParams, _Mapping]] = ..., set_head: _Optional[bool] = ..., metadata_json: _Optional[str] = ..., skip_checkpoint: _Optional[bool] = ..., model: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., drop_gradients_if_refused: _Optional[bool] = ..., save_state: _Optional[bool] = ..., wait_durable: _Optional[bool] = ...) -> None: ...

class OptimStepResponse(_message.Message):
    __slots__ = ("step", "checkpoint", "grad_norm", "head_sequence", "parent_checkpoint_id", "timings", "durable", "has_state")
    class TimingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    HEAD_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PARENT_CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    HAS_STATE_FIELD_NUMBER: _ClassVar[int]
    step: int
    checkpoint: _common_pb2.CheckpointRef
    grad_norm: float
    head_sequence: int
    parent_checkpoint_id: str
    timings: _containers.ScalarMap[str, float]
    durable: bool
    has_state: bool
    def __init__(self, step: _Optional[int] = ..., checkpoint: _Optional[_Union[_common_pb2.CheckpointRef, _Mapping]] = ..., grad_norm: _Optional[float] = ..., head_sequence: _Optional[int] = ..., parent_checkpoint_id: _Optional[str] = ..., timings: _Optional[_Mapping[str, float]] = ..., durable: _Optional[bool] = ..., has_state: _Optional[bool] = ...) -> None: ...

class LossKnob(_message.Message):
    __slots__ = ("name", "default_value", "description")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_VALUE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    default_value: float
    description: str
    def __init__(self, name: _Optional[str] = ..., default_value: _Optional[float] = ..., description: _Optional[str] = ...) -> None: ...

class LossSpec(_message.Message):
    __slots__ = ("name", "description", "knobs")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    KNOBS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    knobs: _containers.RepeatedCompositeFieldContainer[LossKnob]
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., knobs: _Optional[_Iterable[_Union[LossKnob, _Mapping]]] = ...) -> None: ...

class ListLossesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLossesResponse(_message.Message):
    __slots__ = ("losses",)
    LOSSES_FIELD_NUMBER: _ClassVar[int]
    losses: _containers.RepeatedCompositeFieldContainer[LossSpec]
    def __init__(self, losses: _Optional[_Iterable[_Union[LossSpec, _Mapping]]] = ...) -> None: ...

class DiscardGradientsRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class DiscardGradientsResponse(_message.Message):
    __slots__ = ("num_datums",)
    NUM_DATUMS_FIELD_NUMBER: _ClassVar[int]
    num_datums: int
    def __init__(self, num_datums: _Optional[int] = ...) -> None: ...

class GetTrainerInfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class GetTrainerInfoResponse(_message.Message):
    __slots__ = ("model", "step", "checkpoint_id", "num_pending_datums", "device", "weight_group_members")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PENDING_DATUMS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_GROUP_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    step: int
    checkpoint_id: str
    num_pending_datums: int
    device: str
    weight_group_members: int
    def __init__(self, model: _Optional[str] = ..., step: _Optional[int] = ..., checkpoint_id: _Optional[str] = ..., num_pending_datums: _Optional[int] = ..., device: _Optional[str] = ..., weight_group_members: _Optional[int] = ...) -> None: ...
