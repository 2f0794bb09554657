"""Domain types at the seams between services: plain dataclasses, no protobuf, no grpc.

Services and the client library pass these; :mod:`yieldloop.convert` is the one place they become protobuf
messages and back. Field names match the wire messages, so code reads the same on either side.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math

from yieldloop.errors import InvalidArgumentError

MAX_LORA_RANK = 1024


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """A LoRA adapter's shape (peft's format): the update ``B @ A`` of each target module is scaled by
    ``alpha / rank``."""

    rank: int
    alpha: float = 0.0
    """0: twice the rank."""
    target_modules: tuple[str, ...] = ()
    """Module names ("q_proj", ...); empty: every linear layer of the decoder blocks (peft's "all-linear")."""

    def validate(self, field: str = "lora") -> LoraConfig:
        """Checks the config; returns it with defaults filled in (INVALID_ARGUMENT/INVALID_FIELD otherwise)."""
        import math
        import re

        from yieldloop.errors import invalid_field

        if not isinstance(self.rank, int) or not 0 < self.rank <= MAX_LORA_RANK:
            raise invalid_field(
                f"{field}.rank", f"a LoRA rank must be an integer in [1, {MAX_LORA_RANK}], got {self.rank}"
            )
        if not math.isfinite(self.alpha) or self.alpha < 0:
            raise invalid_field(f"{field}.alpha", f"LoRA alpha must be a finite number > 0, got {self.alpha}")
        for name in self.target_modules:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", name):
                raise invalid_field(f"{field}.target_modules", f"{name!r} is not a module name")
        return LoraConfig(self.rank, self.alpha or 2.0 * self.rank, tuple(self.target_modules))

    @property
    def scaling(self) -> float:
        return (self.alpha or 2.0 * self.rank) / self.rank

    def describe(self) -> str:
        return f"lora r={self.rank}"


@dataclasses.dataclass
class ModelInfo:
    """A model slug: its base, the model it was forked from, its owner."""

    slug: str
    base: str
    parent: str = ""
    owner: str = ""
    trainable: bool = True
    created_time: float = 0.0
    architecture: str = ""
    """The transformers architecture of the weights, e.g. "LlamaForCausalLM"."""
    num_parameters: int = 0
    dtype: str = ""
    """The weights' dtype as stored, e.g. "float32", "bfloat16"."""
    has_chat_template: bool = False
    source: str = ""
    """Where an imported base came from (a folder or a hub id)."""
    size_bytes: int = 0
    """Bytes of the base checkpoint (for a LoRA fork, of its adapter)."""
    lora: LoraConfig | None = None
    """Set for a LoRA fork: its checkpoints hold the adapter (and its optimizer state) only."""
    adapter_base_model: str = ""
    """For a LoRA fork: the slug whose weights (at ``adapter_base_checkpoint_id``) the adapter applies to."""
    adapter_base_checkpoint_id: str = ""
    public: bool = False
    """Every team may see, sample and fork it; only its owner team trains it."""

    @property
    def kind(self) -> str:
        """ "full" or "lora r=R"."""
        return self.lora.describe() if self.lora else "full"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelInfo:
        known = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        lora = data.pop("lora", None)
        if lora:
            lora = LoraConfig(int(lora["rank"]), float(lora.get("alpha", 0.0)), tuple(lora.get("target_modules", ())))
        return cls(**data, lora=lora or None)


@dataclasses.dataclass
class ObjectInfo:
    """One object of a checkpoint, with the checksum every reader verifies."""

    name: str
    size: int
    sha256: str
    key: str
    state: bool = False
    """Training state only (optimizer moments, step): engines never fetch it."""


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
    pending: bool = False
    """The objects are still being written to the store (the weights are served from ``weights_source``)."""
    weights_source: str = ""
    """While pending: the TrainerService address serving the sampler weights."""

    @property
    def sampler_objects(self) -> list[ObjectInfo]:
        """What an engine loads: every object but the training state."""
        return [obj for obj in self.objects if not obj.state]

    @property
    def has_state(self) -> bool:
        """Whether the checkpoint holds the full training state (optimizer moments)."""
        return any(obj.state for obj in self.objects)

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True).encode()

    def validate(self) -> Manifest:
        """INVALID_ARGUMENT naming the field for values no checkpoint has (NaN or negative times, a negative step,
        metadata that is not a JSON object, objects of negative size or a malformed sha256)."""
        import math
        import re

        from yieldloop.errors import check_json_object, invalid_field

        if not math.isfinite(self.created_time) or self.created_time < 0:
            raise invalid_field(
                "manifest.created_time", f"created_time must be finite and >= 0, got {self.created_time}"
            )
        if self.step < 0:
            raise invalid_field("manifest.step", f"step must be >= 0, got {self.step}")
        check_json_object(self.metadata_json, "manifest.metadata_json")
        for obj in self.objects:
            if obj.size < 0 or not re.fullmatch(r"[0-9a-f]{64}", obj.sha256):
                raise invalid_field(
                    "manifest.objects",
                    f"object {obj.name[:80]!r} needs a size >= 0 and a sha256 of 64 lower-case hex digits",
                )
        return self

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


@dataclasses.dataclass(frozen=True)
class WeightSubscribed:
    """A weight group took the subscriber in (it is a member for as long as it reads the stream)."""


@dataclasses.dataclass(frozen=True)
class WeightGroup:
    """A process group to join for a model's broadcasts: rank 0 is the trainer, the members ranks 1..size-1."""

    address: str
    """``host:port`` of the trainer's rendezvous store."""
    name: str
    rank: int
    size: int
    backend: str
    """"gloo" or "nccl"."""
    wait_until_open: bool = False
    """Join only once the trainer opened the group (its previous broadcast ended)."""


@dataclasses.dataclass(frozen=True)
class WeightBroadcast:
    """A checkpoint's sampler weights follow in the group, object by object in pieces of ``chunk_bytes``."""

    checkpoint_id: str
    chunk_bytes: int
    objects: tuple[ObjectInfo, ...]
    """Name, size and sha256 of each object (no store key)."""


WeightEvent = WeightSubscribed | WeightGroup | WeightBroadcast
"""What a weight group's member is told, in order: subscribed, then groups to join and broadcasts in them."""


@dataclasses.dataclass(frozen=True)
class WeightPiece:
    """One message of a pull of sampler weights: the folder to read in place (``local_folder``, the same host),
    or the next bytes of the object ``name``; an empty piece answers a probe."""

    local_folder: str = ""
    name: str = ""
    data: bytes = b""


class StopReason(enum.IntEnum):
    """Why one completion ended (values as ``yieldloop.common.v1.StopReason``)."""

    UNSPECIFIED = 0
    EOS = 1
    LENGTH = 2
    STOP_STRING = 3
    CANCELLED = 4
    CONTEXT = 5

    @classmethod
    def label(cls, value: int) -> str:
        """The engines' name of a wire value ("eos", "length", ...); "" when unspecified or unknown."""
        member = cls._value2member_map_.get(value, cls.UNSPECIFIED)
        return "" if member is cls.UNSPECIFIED else member.name.lower()


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


class PromptFormat(enum.IntEnum):
    """How a run's prompt reached the model (values as ``yieldloop.common.v1.PromptFormat``)."""

    UNSPECIFIED = 0
    CHAT = 1
    """Rendered with the model's chat template."""
    RAW = 2
    """Raw text: the scenario yielded RawText, or the model has no chat template."""


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
    prompt_format: PromptFormat = PromptFormat.UNSPECIFIED
    team: str = ""
    """The team whose key ran it (set when recorded); only that team and admins read it back by trace id."""


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
    team: str = ""
    """The team whose key created it; its runs are that team's."""


@dataclasses.dataclass
class Datum:
    """One training sequence: position i of ``input_tokens`` predicts ``target_tokens[i]``.

    Per target: the sampler's logprob, the advantage (0 off the action tokens) and the weight (cross_entropy;
    a custom loss's ``-d loss / d logprob``).
    """

    input_tokens: list[int]
    target_tokens: list[int]
    sampling_logprobs: list[float] = dataclasses.field(default_factory=list)
    advantages: list[float] = dataclasses.field(default_factory=list)
    weights: list[float] = dataclasses.field(default_factory=list)

    def validate(self, vocab_size: int, field: str = "datum", max_tokens: int = 0) -> Datum:
        """Checks lengths (at most ``max_tokens`` when given: the model's context), finiteness, that sampling
        logprobs are <= 0, and token ids (filling omitted per-target lists with zeros).

        Raises:
            InvalidArgumentError: DATUM_INVALID or TOKEN_OUT_OF_VOCAB naming the field.
        """
        num = len(self.input_tokens)
        if num == 0:
            raise datum_error("a datum needs at least one token", f"{field}.input_tokens")
        if max_tokens and num > max_tokens:
            raise datum_error(
                f"a datum of {num} tokens is longer than the model's {max_tokens}-token context",
                f"{field}.input_tokens",
            )
        for name in ("target_tokens", "sampling_logprobs", "advantages", "weights"):
            values = getattr(self, name)
            if name != "target_tokens" and not values:
                setattr(self, name, [0.0] * num)
            elif len(values) != num:
                raise datum_error(f"{name} has {len(values)} entries but input_tokens has {num}", f"{field}.{name}")
        for name in ("sampling_logprobs", "advantages", "weights"):
            if not all(math.isfinite(v) for v in getattr(self, name)):
                raise datum_error(f"{name} holds NaN or inf", f"{field}.{name}")
        if any(v > 1e-6 for v in self.sampling_logprobs):
            raise datum_error("sampling_logprobs must be <= 0 (log-probabilities)", f"{field}.sampling_logprobs")
        for name in ("input_tokens", "target_tokens"):
            bad = [t for t in getattr(self, name) if not 0 <= t < vocab_size]
            if bad:
                raise InvalidArgumentError(
                    f"{name} holds ids {bad[:5]} outside the vocabulary [0, {vocab_size})",
                    reason="TOKEN_OUT_OF_VOCAB",
                    field=f"{field}.{name}",
                )
        return self


def datum_error(message: str, field: str) -> InvalidArgumentError:
    """INVALID_ARGUMENT/DATUM_INVALID naming the field to blame."""
    return InvalidArgumentError(message, reason="DATUM_INVALID", field=field)


# What the services answer (the Client returns these; field names are the wire's) ----------------------------


@dataclasses.dataclass
class ToolSpec:
    """A tool an environment offers: its name, description and the JSON schema of its arguments."""

    name: str = ""
    description: str = ""
    parameters_json_schema: str = ""


@dataclasses.dataclass
class ScenarioSpec:
    """A scenario an environment offers (``env``/``name``) and the JSON schema of its arguments."""

    env: str = ""
    name: str = ""
    description: str = ""
    args_json_schema: str = ""


@dataclasses.dataclass
class Scenarios:
    """What an EnvService offers: its scenarios and the tools of its environments."""

    scenarios: list[ScenarioSpec] = dataclasses.field(default_factory=list)
    tools: list[ToolSpec] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ChatMessage:
    role: str = ""
    content: str = ""


@dataclasses.dataclass
class EpisodeStarted:
    """An episode's prompt (text or chat messages) and the tools it may call."""

    episode_id: str = ""
    prompt: str = ""
    messages: list[ChatMessage] = dataclasses.field(default_factory=list)
    tools: list[ToolSpec] = dataclasses.field(default_factory=list)
    raw_text: bool = False
    """The prompt is raw text for the model (no chat template)."""


@dataclasses.dataclass
class ToolResult:
    call_id: str = ""
    content: str = ""
    is_error: bool = False


@dataclasses.dataclass
class EpisodeGraded:
    """The reward of a submitted answer (the scenario's second yield) and what the grader added."""

    reward: float = 0.0
    info_json: str = ""


@dataclasses.dataclass
class SamplingParams:
    """How a request samples (zero values: the service's defaults; see RolloutService's SamplingParams)."""

    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    max_tokens: int = 0
    stop: list[str] = dataclasses.field(default_factory=list)
    seed: int = 0
    ignore_eos: bool = False


@dataclasses.dataclass
class GenerateDelta:
    """One message of a Generate stream: new tokens with their sampling logprobs."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    weight_version: str = ""
    finished: bool = False
    stop_reason: StopReason = StopReason.UNSPECIFIED
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class TraceSpan:
    """One span recorded for a run's trace."""

    span_id: str = ""
    parent_span_id: str = ""
    name: str = ""
    service: str = ""
    start_time_unix_nano: int = 0
    end_time_unix_nano: int = 0
    status: str = ""
    error: str = ""
    attributes: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class ServingInfo:
    """What serves a model on a RolloutService."""

    model: str = ""
    weight_version: str = ""
    head_sequence: int = 0
    engine: str = ""
    last_reload_error: str = ""
    openai_base_url: str = ""
    adapter_base: str = ""
    engine_weight_loads: int = 0
    following: bool = False
    follow_error: str = ""
    candidate_engine_like_head: bool = False


@dataclasses.dataclass
class CheckpointRef:
    model: str = ""
    checkpoint_id: str = ""


@dataclasses.dataclass
class ForwardBackwardResult:
    """What a forward_backward accumulated: the loss summed over tokens, counts and the loss's metrics."""

    loss_sum: float = 0.0
    num_datums: int = 0
    num_action_tokens: int = 0
    num_groups: int = 0
    num_groups_without_signal: int = 0
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class BackwardResult:
    num_datums: int = 0
    num_tokens: int = 0


@dataclasses.dataclass
class OptimStepResult:
    """An optimizer step: the step number, its checkpoint (None when skipped) and where the head went."""

    step: int = 0
    checkpoint: CheckpointRef | None = None
    grad_norm: float = 0.0
    head_sequence: int = 0
    parent_checkpoint_id: str = ""
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    durable: bool = False
    has_state: bool = False


@dataclasses.dataclass
class LossKnob:
    name: str = ""
    default_value: float = 0.0
    description: str = ""


@dataclasses.dataclass
class LossInfo:
    """A loss the trainer computes and its knobs (``loss_fn_config`` keys)."""

    name: str = ""
    description: str = ""
    knobs: list[LossKnob] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class TrainerInfo:
    model: str = ""
    step: int = 0
    checkpoint_id: str = ""
    num_pending_datums: int = 0
    device: str = ""
    weight_group_members: int = 0


@dataclasses.dataclass
class NewModel:
    """A model a fork, import or upload created, and its head."""

    model: ModelInfo
    head: Head


@dataclasses.dataclass
class ApiKeyInfo:
    key_id: str = ""
    team: str = ""
    role: str = ""
    name: str = ""
    created_time: float = 0.0
    revoked_time: float = 0.0


@dataclasses.dataclass
class NewApiKey:
    """A key just created: ``api_key`` is shown this once."""

    info: ApiKeyInfo
    api_key: str


class PromotionState(enum.IntEnum):
    """The promotion gate's decision (values as ``yieldloop.checkpoint.v1.PromotionState``)."""

    UNSPECIFIED = 0
    PROMOTED = 1
    REJECTED = 2


@dataclasses.dataclass
class Promotion:
    """Why a checkpoint was promoted to HEAD or not (held-out reward against the baseline's)."""

    state: PromotionState = PromotionState.UNSPECIFIED
    reason: str = ""
    heldout_reward: float = 0.0
    baseline_checkpoint_id: str = ""
    baseline_reward: float = 0.0
    decided_time: float = 0.0


@dataclasses.dataclass
class CheckpointSummary:
    checkpoint_id: str = ""
    parent_checkpoint_id: str = ""
    step: int = 0
    created_time: float = 0.0
    is_head: bool = False
    promotion: Promotion | None = None
    pending: bool = False
    has_state: bool = False
    metadata_json: str = ""
