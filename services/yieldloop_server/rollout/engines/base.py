"""The Engine interface: token-in/token-out sampling with logprobs and weight versions."""

from __future__ import annotations

import abc
import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import json
import math
import pathlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from yieldloop.errors import FailedPreconditionError, InvalidArgumentError, UnavailableError, invalid_field


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Sampling parameters for one request."""

    max_tokens: int = 16
    """Completion tokens at most; must be > 0."""
    temperature: float = 1.0
    """0 samples greedily. Logprobs are those of the distribution sampled from: softmax(logits /
    temperature), restricted to top-k / top-p and renormalised when set; raw log-softmax at 0."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    top_k: int = 0
    """0 disables top-k."""
    stop: tuple[str, ...] = ()
    seed: int = 0
    """0: unseeded."""
    ignore_eos: bool = False
    """Sample past the end-of-sequence token (only max_tokens, the context and stop strings end it)."""
    stream_interval_s: float = 0.0
    """How the engine streams: the first and the finishing tokens at once, in between at most one delta per
    interval (tokens sampled meanwhile are held and merged). 0: every token its own delta; math.inf: only the
    first and the finishing delta (a caller that wants the whole completion). Not a sampling parameter of the
    wire: servers set it (RolloutService's ``--stream-interval-ms``)."""

    def validate(self) -> SamplingConfig:
        """INVALID_ARGUMENT naming the field for a value no engine can sample with (checked before a request
        reaches an engine, so one bad request never fails the batch it would have joined)."""
        if (
            isinstance(self.max_tokens, bool)
            or not isinstance(self.max_tokens, int)
            or not 0 < self.max_tokens <= MAX_TOKENS
        ):
            raise invalid_field(
                "sampling.max_tokens", f"max_tokens must be an integer in [1, {MAX_TOKENS}], got {self.max_tokens!r}"
            )
        if not _finite_number(self.temperature) or self.temperature < 0 or 0 < self.temperature < MIN_TEMPERATURE:
            raise invalid_field(
                "sampling.temperature",
                f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {self.temperature!r}",
            )
        if not _finite_number(self.top_p) or not 0 < self.top_p <= 1:
            raise invalid_field("sampling.top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k < 2**31:
            raise invalid_field("sampling.top_k", f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise invalid_field("sampling.seed", f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise invalid_field("sampling.ignore_eos", "ignore_eos must be a boolean")
        if not isinstance(self.stream_interval_s, (int, float)) or not self.stream_interval_s >= 0:
            raise invalid_field("sampling.stream_interval_s", "stream_interval_s must be >= 0")
        if len(self.stop) > MAX_STOP_STRINGS or any(
            not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_LENGTH for s in self.stop
        ):
            raise invalid_field(
                "sampling.stop",
                f"stop must be at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_LENGTH} characters",
            )
        return self


MAX_TOKENS = 1 << 20
MAX_CHARS_PER_TOKEN = 64
"""No tokenizer's token is longer: text longer than the context times this is refused without tokenizing it."""
OFFLOAD_CHARS = 32_768
"""Text at least this long is tokenized in a worker thread."""
RENDER_CACHE_SIZE = 256
"""Chat renderings an engine remembers (see ChatRenders)."""
MIN_TEMPERATURE = 1e-5
"""Below this (and above 0) softmax(logits / temperature) overflows; 0 samples greedily."""
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 1024


def chat_chars(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> int:
    return sum(len(str(m.get("content", ""))) for m in messages) + (len(json.dumps(list(tools))) if tools else 0)


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass
class TokenDelta:
    """Newly sampled tokens of one request."""

    token_ids: list[int]
    logprobs: list[float]
    weight_version: str
    finished: bool = False
    stop_reason: str = ""
    """"eos", "length", "stop_string", "context" or "cancelled" when finished."""


def whole_completion(sampling: SamplingConfig) -> SamplingConfig:
    """``sampling`` for a caller that reads only the whole completion: the engine holds the tokens until the end
    (one wake-up of the caller per completion, not one per token)."""
    return dataclasses.replace(sampling, stream_interval_s=math.inf)


def merge_deltas(first: TokenDelta, then: TokenDelta) -> TokenDelta:
    """One delta saying what ``first`` and then ``then`` said."""
    return TokenDelta(
        first.token_ids + then.token_ids,
        first.logprobs + then.logprobs,
        then.weight_version,
        then.finished,
        then.stop_reason,
    )


async def coalesce(deltas: AsyncIterator[TokenDelta], interval_s: float) -> AsyncIterator[TokenDelta]:
    """``deltas`` with the ones that arrive within ``interval_s`` of the last one sent merged into the next.

    The first delta and the finishing one go out at once; in between at most one per interval (a held delta
    waits for the next token: at most one decode step past the interval). See SamplingConfig.stream_interval_s.
    """
    if interval_s <= 0:
        async for delta in deltas:
            yield delta
        return
    clock = asyncio.get_running_loop().time
    held: TokenDelta | None = None
    sent = -math.inf
    async for delta in deltas:
        held = delta if held is None else merge_deltas(held, delta)
        now = clock()
        if held.finished or now - sent >= interval_s:
            sent = now
            yield held
            held = None
    if held is not None:
        yield held


_OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")


def folder_signature(folder: pathlib.Path) -> tuple[tuple[str, bytes], ...] | None:
    """A digest of every file of an HF folder but its safetensors weights, by name (None when the folder holds
    weights in another format, which only a full load reads)."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix != ".safetensors")
    if any(p.suffix in _OTHER_WEIGHT_SUFFIXES for p in files):
        return None
    return tuple((p.name, hashlib.blake2b(p.read_bytes(), digest_size=16).digest()) for p in files)


REVIVE_BACKOFF_S = 5.0
"""An engine whose process died starts a new one at the next call; after a new one failed to take the dead one's
weights, calls fail with the death's error for this many seconds before the next try."""


class ChatRenders:
    """A tokenizer's prompt renderings (chats, raw texts), the last RENDER_CACHE_SIZE of each kind remembered by
    conversation or text: a group's episodes (and every group of a batch over the same tasks) share their prompts,
    rendered once instead of once per episode. Long prompts (rendered off the event loop), anything not plain JSON,
    and every conversation of a template that writes today's date (Llama 3's renders differently tomorrow) are
    rendered each time."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._ids: collections.OrderedDict[str, tuple[int, ...]] | None = (
            None if "strftime_now" in str(getattr(tokenizer, "chat_template", None)) else collections.OrderedDict()
        )
        self._raw: collections.OrderedDict[str, tuple[int, ...]] = collections.OrderedDict()
        """Raw texts' ids (remembered even when chats are not)."""

    def render(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> list[int]:
        key = ""
        if self._ids is not None:
            with contextlib.suppress(TypeError, ValueError):
                key = json.dumps([messages, tools, add_generation_prompt], sort_keys=True)
        return self._remembered(
            self._ids,
            key,
            lambda: self.tokenizer.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
            ),
        )

    def raw(self, text: str) -> list[int]:
        """Ids of raw text with the special tokens the tokenizer adds to a sequence, remembered as chats are (by
        text: a template's date plays no part)."""
        return self._remembered(self._raw, text, lambda: self.tokenizer(text, add_special_tokens=True)["input_ids"])

    @staticmethod
    def _remembered(
        cache: collections.OrderedDict[str, tuple[int, ...]] | None, key: str, render: Callable[[], Sequence[int]]
    ) -> list[int]:
        if cache is None or not key or len(key) >= OFFLOAD_CHARS:
            return list(render())
        ids = cache.pop(key, None)  # pop, then put back last: the most recently used
        if ids is None:
            ids = tuple(render())
        cache[key] = ids
        if len(cache) > RENDER_CACHE_SIZE:
            cache.popitem(last=False)
        return list(ids)


class Engine(abc.ABC):
    """A policy engine serving one model's weights.

    Implementations swap weights only at a step boundary, so every token is
    sampled by exactly one weight version, which each delta reports. The
    model's own Hugging Face tokenizer renders chat prompts and decodes, the
    same in every engine.
    """

    name: str = "engine"
    tokenizer: Any = None
    weight_loads: int = 0
    """Full weight loads so far (first load and hot reloads)."""
    _renders: ChatRenders | None = None

    @property
    @abc.abstractmethod
    def weight_version(self) -> str:
        """Checkpoint id now serving ("" before the first load)."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int: ...

    @abc.abstractmethod
    async def load_weights(self, folder: pathlib.Path, version: str) -> None:
        """Loads an HF checkpoint folder; returns once new requests use it."""

    @abc.abstractmethod
    def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingConfig, adapter: str = ""
    ) -> AsyncIterator[TokenDelta]:
        """Streams deltas for one request (with the LoRA adapter loaded as ``adapter`` applied, when named; its
        deltas then report the adapter's version); closing the iterator cancels it and frees its resources."""

    # LoRA adapters: a base engine serves the LoRA forks of its weights, each adapter applied per request.

    def start_from(self, other: Engine) -> None:
        """Says that ``other`` (an engine of this process) serves weights this one's first load may start from:
        an engine that can copy them and then overwrite only what differs (the torch engine) does, when the
        first folder differs from ``other``'s only in its weights. Others ignore it."""

    async def load_adapter(self, name: str, folder: pathlib.Path, version: str) -> None:
        """Loads (or replaces) the adapter ``name`` from a peft adapter folder; returns once new requests use it."""
        raise FailedPreconditionError(f"the {self.name} engine does not serve LoRA adapters", reason="ENGINE_NOT_READY")

    async def unload_adapter(self, name: str) -> None:
        """Forgets the adapter (requests already running finish with it)."""

    def adapter_version(self, name: str) -> str:
        """The checkpoint id the adapter ``name`` serves ("" when it is not loaded)."""
        return ""

    @abc.abstractmethod
    def num_unfinished(self) -> int:
        """Requests the engine still holds (queued or decoding); cancelled ones leave promptly."""

    def is_down(self) -> bool:
        """Whether the process this engine decodes in died (engines with one: the next call, or :meth:`revive`,
        starts a new one)."""
        return False

    async def revive(self) -> None:
        """Starts the engine's process again when it died, on the weights and adapters it served; raises
        UNAVAILABLE/ENGINE_ERROR when it cannot (then not again for REVIVE_BACKOFF_S)."""

    async def close(self) -> None:
        """Releases threads, processes and memory."""

    def expect(self) -> contextlib.AbstractContextManager[Any]:
        """Says, for the length of the block, that a request is on its way (its prompt is being made: a rollout's
        episode starting in its environment) and ends when this task submits it: an engine that gathers a burst
        of requests before it starts a batch (the torch engine) starts once none is on its way, instead of
        waiting for a pause in arrivals. Engines that do not gather ignore it."""
        return contextlib.nullcontext()

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise UnavailableError("no weights loaded yet", reason="ENGINE_NOT_READY")
        return self.tokenizer

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer has a chat template (a base model's often has none)."""
        return bool(getattr(self._require_tokenizer(), "chat_template", None))

    def fits_text(self, chars: int) -> bool:
        """Whether text of ``chars`` characters could fit the context (no tokenizer's token is longer than
        MAX_CHARS_PER_TOKEN): longer text need not be tokenized to know it does not."""
        return chars <= self.max_model_len * MAX_CHARS_PER_TOKEN

    def check_text(self, chars: int) -> None:
        """PROMPT_TOO_LONG, before any tokenizing, for text that cannot fit the context whatever its tokens."""
        if not self.fits_text(chars):
            raise InvalidArgumentError(
                f"a prompt of {chars} characters cannot fit the {self.max_model_len}-token context",
                reason="PROMPT_TOO_LONG",
                field="prompt",
            )

    @staticmethod
    async def off_loop(chars: int, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, in a worker thread when it works on ``chars`` >= OFFLOAD_CHARS characters (tokenizing
        megabytes takes seconds: the event loop serves every other call meanwhile)."""
        if chars >= OFFLOAD_CHARS:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    async def render_chat_async(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[int]:
        """:meth:`render_chat` for a request: PROMPT_TOO_LONG first when the text cannot fit, off the loop."""
        chars = chat_chars(messages, tools)
        self.check_text(chars)
        return await self.off_loop(chars, self.render_chat, messages, tools)

    async def render_raw_async(self, text: str) -> list[int]:
        self.check_text(len(text))
        return await self.off_loop(len(text), self.render_raw, text)

    async def encode_async(self, text: str) -> list[int]:
        self.check_text(len(text))
        return await self.off_loop(len(text), self.encode, text)

    def render_raw(self, text: str) -> list[int]:
        """Prompt ids for raw text, with the special tokens the tokenizer adds to a sequence (e.g. BOS)."""
        return self._renders_of(self._require_tokenizer()).raw(text)

    def _renders_of(self, tokenizer: Any) -> ChatRenders:
        if self._renders is None or self._renders.tokenizer is not tokenizer:  # a load brought another tokenizer
            self._renders = ChatRenders(tokenizer)
        return self._renders

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Prompt ids for chat messages (and tools, OpenAI function format) through the chat template.

        Raises:
            InvalidArgumentError: NO_CHAT_TEMPLATE when the model's tokenizer has none.
        """
        if not messages:
            raise invalid_field("messages", "a chat needs at least one message")
        if not self.has_chat_template:
            raise InvalidArgumentError(
                "this model's tokenizer has no chat template: send raw text or token ids",
                reason="NO_CHAT_TEMPLATE",
                field="messages",
            )
        return self._renders_of(self._require_tokenizer()).render(messages, tools, add_generation_prompt)

    def render_chat_text(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = False,
    ) -> str:
        """The chat template's text for ``messages`` (the agent loop diffs two of these)."""
        return self._require_tokenizer().apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special tokens added (special-token text is still matched)."""
        return list(self._require_tokenizer().encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of token ids (special tokens dropped unless asked for)."""
        return self._require_tokenizer().decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    @property
    def eos_token_id(self) -> int:
        return self._require_tokenizer().eos_token_id

    def validate_request(self, prompt_ids: Sequence[int], sampling: SamplingConfig, adapter: str = "") -> None:
        """Typed errors for a request this engine cannot serve: its prompt, its sampling values, an adapter that
        is not loaded."""
        self.validate_prompt(prompt_ids)
        sampling.validate()
        if adapter and not self.adapter_version(adapter):
            raise UnavailableError(f"adapter {adapter!r} is not loaded", reason="ENGINE_NOT_READY")

    def require_ready(self) -> None:
        """UNAVAILABLE/ENGINE_NOT_READY until weights are loaded."""
        if not self.weight_version:
            raise UnavailableError("no weights loaded yet", reason="ENGINE_NOT_READY")

    def validate_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Typed errors for prompts the engine cannot serve."""
        self.require_ready()
        if not prompt_ids:
            raise invalid_field("prompt", "the prompt is empty")
        vocab_size = self.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
            bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
            raise InvalidArgumentError(
                f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                reason="TOKEN_OUT_OF_VOCAB",
                field="prompt_token_ids",
            )
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidArgumentError(
                f"prompt of {len(prompt_ids)} tokens leaves no room in the {self.max_model_len}-token context",
                reason="PROMPT_TOO_LONG",
                field="prompt",
            )


class AdapterEngine(Engine):
    """One LoRA adapter served by its base's engine, seen as an engine of its own: loading weights loads the
    adapter, ``generate`` runs on the base with the adapter applied, the weight version is the adapter's.

    Args:
        base: The engine holding the frozen base weights.
        adapter: The name the adapter is loaded under (unique on ``base``).
    """

    def __init__(self, base: Engine, adapter: str) -> None:
        self.base = base
        self.adapter = adapter
        self.name = base.name

    @property  # type: ignore[override]
    def tokenizer(self) -> Any:
        return self.base.tokenizer

    @property
    def weight_version(self) -> str:
        return self.base.adapter_version(self.adapter)

    @property
    def vocab_size(self) -> int:
        return self.base.vocab_size

    @property  # type: ignore[override]
    def weight_loads(self) -> int:
        return self.base.weight_loads

    @property
    def max_model_len(self) -> int:
        return self.base.max_model_len

    async def load_weights(self, folder: pathlib.Path, version: str) -> None:
        await self.base.load_adapter(self.adapter, folder, version)

    def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingConfig, adapter: str = ""
    ) -> AsyncIterator[TokenDelta]:
        return self.base.generate(prompt_ids, sampling, adapter=self.adapter)

    def num_unfinished(self) -> int:
        return self.base.num_unfinished()

    def is_down(self) -> bool:
        return self.base.is_down()

    async def revive(self) -> None:
        await self.base.revive()

    async def close(self) -> None:
        await self.base.unload_adapter(self.adapter)
