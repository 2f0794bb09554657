from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PromotionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROMOTION_STATE_UNSPECIFIED: _ClassVar[PromotionState]
    PROMOTION_STATE_PROMOTED: _ClassVar[PromotionState]
    PROMOTION_STATE_REJECTED: _ClassVar[PromotionState]
PROMOTION_STATE_UNSPECIFIED: PromotionState
PROMOTION_STATE_PROMOTED: PromotionState
PROMOTION_STATE_REJECTED: PromotionState

class ApiKeyInfo(_message.Message):
    __slots__ = ("key_id", "team", "role", "name", "created_time", "revoked_time")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    TEAM_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CREATED_TIME_FIELD_NUMBER: _ClassVar[int]
    REVOKED_TIME_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    team: str
    role: str
    name: str
    created_time: float
    revoked_time: float
    def __init__(self, key_id: _Optional[str] = ..., team: _Optional[str] = ..., role: _Optional[str] = ..., name: _Optional[str] = ..., created_time: _Optional[float] = ..., revoked_time: _Optional[float] = ...) -> None: ...

class CreateApiKeyRequest(_message.Message):
    __slots__ = ("team", "role", "name")
    TEAM_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    team: str
    role: str
    name: str
    def __init__(self, team: _Optional[str] = ..., role: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class CreateApiKeyResponse(_message.Message):
    __slots__ = ("info", "api_key")
    INFO_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    info: ApiKeyInfo
    api_key: str
    def __init__(self, info: _Optional[_Union[ApiKeyInfo, _Mapping]] = ..., api_key: _Optional[str] = ...) -> None: ...

class ListApiKeysRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListApiKeysResponse(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[ApiKeyInfo]
    def __init__(self, keys: _Optional[_Iterable[_Union[ApiKeyInfo, _Mapping]]] = ...) -> None: ...

class RevokeApiKeyRequest(_message.Message):
    __slots__ = ("key_id",)
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    def __init__(self, key_id: _Optional[str] = ...) -> None: ...

class RevokeApiKeyResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: ApiKeyInfo
    def __init__(self, info: _Optional[_Union[ApiKeyInfo, _Mapping]] = ...) -> None: ...

class Promotion(_message.Message):
    __slots__ = ("state", "reason", "heldout_reward", "baseline_checkpoint_id", "baseline_reward", "decided_time")
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HELDOUT_REWARD_FIELD_NUMBER: _ClassVar[int]
    BASELINE_CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    BASELINE_REWARD_FIELD_NUMBER: _ClassVar[int]
    DECIDED_TIME_FIELD_NUMBER: _ClassVar[int]
    state: PromotionState
    reason: str
    heldout_reward: float
    baseline_checkpoint_id: str
    baseline_reward: float
    decided_time: float
    def __init__(self, state: _Optional[_Union[PromotionState, str]] = ..., reason: _Optional[str] = ..., heldout_reward: _Optional[float] = ..., baseline_checkpoint_id: _Optional[str] = ..., baseline_reward: _Optional[float] = ..., decided_time: _Optional[float] = ...) -> None: ...

class RecordPromotionRequest(_message.Message):
    __slots__ = ("model", "checkpoint_id", "promotion")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMOTION_FIELD_NUMBER: _ClassVar[int]
    model: str
    checkpoint_id: str
    promotion: Promotion
    def __init__(self, model: _Optional[str] = ..., checkpoint_id: _Optional[str] = ..., promotion: _Optional[_Union[Promotion, _Mapping]] = ...) -> None: ...

class RecordPromotionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("slug", "base", "parent", "owner", "trainable", "created_time", "architecture", "num_parameters", "dtype", "has_chat_template", "source", "size_bytes", "lora", "adapter_base_model", "adapter_base_checkpoint_id", "public")
    SLUG_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_FIELD_NUMBER: _ClassVar[int]
    CREATED_TIME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_BASE_CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_FIELD_NUMBER: _ClassVar[int]
    slug: str
    base: str
    parent: str
    owner: str
    trainable: bool
    created_time: float
    architecture: str
    num_parameters: int
    dtype: str
    has_chat_template: bool
    source: str
    size_bytes: int
    lora: LoraConfig
    adapter_base_model: str
    adapter_base_checkpoint_id: str
    public: bool
    def __init__(self, slug: _Optional[str] = ..., base: _Optional[str] = ..., parent: _Optional[str] = ..., owner: _Optional[str] = ..., trainable: _Optional[bool] = ..., created_time: _Optional[float] = ..., architecture: _Optional[str] = ..., num_parameters: _Optional[int] = ..., dtype: _Optional[str] = ..., has_chat_template: _Optional[bool] = ..., source: _Optional[str] = ..., size_bytes: _Optional[int] = ..., lora: _Optional[_Union[LoraConfig, _Mapping]] = ..., adapter_base_model: _Optional[str] = ..., adapter_base_checkpoint_id: _Optional[str] = ..., public: _Optional[bool] = ...) -> None: ...

class LoraConfig(_message.Message):
    __slots__ = ("rank", "alpha", "target_modules")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    alpha: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rank: _Optional[int] = ..., alpha: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class ObjectInfo(_message.Message):
    __slots__ = ("name", "size", "sha256", "key", "state")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    sha256: str
    key: str
    state: bool
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ..., key: _Optional[str] = ..., state: _Optional[bool] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("model", "checkpoint_id", "parent_checkpoint_id", "step", "created_time", "objects", "metadata_json", "pending", "weights_source")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CREATED_TIME_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_SOURCE_FIELD_NUMBER: _ClassVar[int]
    model: str
    checkpoint_id: str
    parent_checkpoint_id: str
    step: int
    created_time: float
    objects: _containers.RepeatedCompositeFieldContainer[ObjectInfo]
    metadata_json: str
    pending: bool
    weights_source: str
    def __init__(self, model: _Optional[str] = ..., checkpoint_id: _Optional[str] = ..., parent_checkpoint_id: _Optional[str] = ..., step: _Optional[int] = ..., created_time: _Optional[float] = ..., objects: _Optional[_Iterable[_Union[ObjectInfo, _Mapping]]] = ..., metadata_json: _Optional[str] = ..., pending: _Optional[bool] = ..., weights_source: _Optional[str] = ...) -> None: ...

class Head(_message.Message):
    __slots__ = ("model", "checkpoint_id", "sequence", "updated_time")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    UPDATED_TIME_FIELD_NUMBER: _ClassVar[int]
    model: str
    checkpoint_id: str
    sequence: int
    updated_time: float
    def __init__(self, model: _Optional[str] = ..., checkpoint_id: _Optional[str] = ..., sequence: _Optional[int] = ..., updated_time: _Optional[float] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class ForkModelRequest(_message.Message):
    __slots__ = ("source", "name", "owner", "lora")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    source: str
    name: str
    owner: str
    lora: LoraConfig
    def __init__(self, source: _Optional[str] = ..., name: _Optional[str] = ..., owner: _Optional[str] = ..., lora: _Optional[_Union[LoraConfig, _Mapping]] = ...) -> None: ...

class DeleteModelRequest(_message.Message):
    __slots__ = ("model", "force")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    model: str
    force: bool
    def __init__(self, model: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class DeleteModelResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class GetModelResponse(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: ModelInfo
    def __init__(self, model: _Optional[_Union[ModelInfo, _Mapping]] = ...) -> None: ...

class ForkModelResponse(_message.Message):
    __slots__ = ("model", "head")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    model: ModelInfo
    head: Head
    def __init__(self, model: _Optional[_Union[ModelInfo, _Mapping]] = ..., head: _Optional[_Union[Head, _Mapping]] = ...) -> None: ...

class ImportModelRequest(_message.Message):
    __slots__ = ("source", "name", "owner", "public")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_FIELD_NUMBER: _ClassVar[int]
    source: str
    name: str
    owner: str
    public: bool
    def __init__(self, source: _Optional[str] = ..., name: _Optional[str] = ..., owner: _Optional[str] = ..., public: _Optional[bool] = ...) -> None: ...

class ImportModelResponse(_message.Message):
    __slots__ = ("model", "head")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    model: ModelInfo
    head: Head
    def __init__(self, model: _Optional[_Union[ModelInfo, _Mapping]] = ..., head: _Optional[_Union[Head, _Mapping]] = ...) -> None: ...

class UploadModelRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: UploadModelHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[UploadModelHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class UploadModelHeader(_message.Message):
    __slots__ = ("name", "owner", "public", "source", "files")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    name: str
    owner: str
    public: bool
    source: str
    files: _containers.RepeatedCompositeFieldContainer[UploadedFile]
    def __init__(self, name: _Optional[str] = ..., owner: _Optional[str] = ..., public: _Optional[bool] = ..., source: _Optional[str] = ..., files: _Optional[_Iterable[_Union[UploadedFile, _Mapping]]] = ...) -> None: ...

class UploadedFile(_message.Message):
    __slots__ = ("name", "size", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    sha256: str
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class UploadModelResponse(_message.Message):
    __slots__ = ("model", "head")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    model: ModelInfo
    head: Head
    def __init__(self, model: _Optional[_Union[ModelInfo, _Mapping]] = ..., head: _Optional[_Union[Head, _Mapping]] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class CheckpointSummary(_message.Message):
    __slots__ = ("checkpoint_id", "parent_checkpoint_id", "step", "created_time", "is_head", "promotion", "pending", "has_state", "metadata_json")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CREATED_TIME_FIELD_NUMBER: _ClassVar[int]
    IS_HEAD_FIELD_NUMBER: _ClassVar[int]
    PROMOTION_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    HAS_STATE_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    parent_checkpoint_id: str
    step: int
    created_time: float
    is_head: bool
    promotion: Promotion
    pending: bool
    has_state: bool
    metadata_json: str
    def __init__(self, checkpoint_id: _Optional[str] = ..., parent_checkpoint_id: _Optional[str] = ..., step: _Optional[int] = ..., created_time: _Optional[float] = ..., is_head: _Optional[bool] = ..., promotion: _Optional[_Union[Promotion, _Mapping]] = ..., pending: _Optional[bool] = ..., has_state: _Optional[bool] = ..., metadata_json: _Optional[str] = ...) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints",)
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[CheckpointSummary]
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[CheckpointSummary, _Mapping]]] = ...) -> None: ...

class GetCheckpointRequest(_message.Message):
    __slots__ = ("model", "checkpoint_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    checkpoint_id: str
    def __init__(self, model: _Optional[str] = ..., checkpoint_id: _Optional[str] = ...) -> None: ...

class GetCheckpointResponse(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ...) -> None: ...

class CommitCheckpointRequest(_message.Message):
    __slots__ = ("manifest", "set_head", "expected_head_checkpoint_id")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    SET_HEAD_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_HEAD_CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    set_head: bool
    expected_head_checkpoint_id: str
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., set_head: _Optional[bool] = ..., expected_head_checkpoint_id: _Optional[str] = ...) -> None: ...

class CommitCheckpointResponse(_message.Message):
    __slots__ = ("manifest", "head")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    head: Head
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., head: _Optional[_Union[Head, _Mapping]] = ...) -> None: ...

class GetHeadRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class GetHeadResponse(_message.Message):
    __slots__ = ("head",)
    HEAD_FIELD_NUMBER: _ClassVar[int]
    head: Head
    def __init__(self, head: _Optional[_Union[Head, _Mapping]] = ...) -> None: ...

class SetHeadRequest(_message.Message):
    __slots__ = ("model", "checkpoint_id", "expected_checkpoint_id", "expected_sequence")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    model: str
    checkpoint_id: str
    expected_checkpoint_id: str
    expected_sequence: int
    def __init__(self, model: _Optional[str] = ..., checkpoint_id: _Optional[str] = ..., expected_checkpoint_id: _Optional[str] = ..., expected_sequence: _Optional[int] = ...) -> None: ...

class SetHeadResponse(_message.Message):
    __slots__ = ("head",)
    HEAD_FIELD_NUMBER: _ClassVar[int]
    head: Head
    def __init__(self, head: _Optional[_Union[Head, _Mapping]] = ...) -> None: ...

class WatchHeadRequest(_message.Message):
    __slots__ = ("model", "after_sequence")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    model: str
    after_sequence: int
    def __init__(self, model: _Optional[str] = ..., after_sequence: _Optional[int] = ...) -> None: ...

class WatchHeadResponse(_message.Message):
    __slots__ = ("head",)
    HEAD_FIELD_NUMBER: _ClassVar[int]
    head: Head
    def __init__(self, head: _Optional[_Union[Head, _Mapping]] = ...) -> None: ...
