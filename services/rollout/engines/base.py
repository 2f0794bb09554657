"""The Engine interface: token-in/token-out sampling with logprobs and weight versions."""

from __future__ import annotations

import abc
import dataclasses
import pathlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from yieldloop.errors import InvalidArgumentError, UnavailableError, invalid_field


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

    def validate(self) -> SamplingConfig:
        if self.max_tokens <= 0:
            raise invalid_field("sampling.max_tokens", f"max_tokens must be > 0, got {self.max_tokens}")
        if self.temperature < 0:
            raise invalid_field("sampling.temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise invalid_field("sampling.top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise invalid_field("sampling.top_k", f"top_k must be >= 0, got {self.top_k}")
        return self


@dataclasses.dataclass
class TokenDelta:
    """Newly sampled tokens of one request."""

    token_ids: list[int]
    logprobs: list[float]
    weight_version: str
    finished: bool = False
    stop_reason: str = ""
    """"eos", "length", "stop_string", "context" or "cancelled" when finished."""


class Engine(abc.ABC):
    """A policy engine serving one model's weights.

    Implementations swap weights only at a step boundary, so every token is
    sampled by exactly one weight version, which each delta reports. The
    model's own Hugging Face tokenizer renders chat prompts and decodes, the
    same in every engine.
    """

    name: str = "engine"
    tokenizer: Any = None

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
    def generate(self, prompt_ids: Sequence[int], sampling: SamplingConfig) -> AsyncIterator[TokenDelta]:
        """Streams deltas for one request; closing the iterator cancels it and frees its resources."""

    @abc.abstractmethod
    def num_unfinished(self) -> int:
        """Requests the engine still holds (queued or decoding); cancelled ones leave promptly."""

    async def close(self) -> None:
        """Releases threads, processes and memory."""

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise UnavailableError("no weights loaded yet", reason="ENGINE_NOT_READY")
        return self.tokenizer

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer has a chat template (a base model's often has none)."""
        return bool(getattr(self._require_tokenizer(), "chat_template", None))

    def render_raw(self, text: str) -> list[int]:
        """Prompt ids for raw text, with the special tokens the tokenizer adds to a sequence (e.g. BOS)."""
        return list(self._require_tokenizer()(text, add_special_tokens=True)["input_ids"])

    def render_chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None, *,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Prompt ids for chat messages (and tools, OpenAI function format) through the chat template.

        Raises:
            InvalidArgumentError: NO_CHAT_TEMPLATE when the model's tokenizer has none.
        """
        if not self.has_chat_template:
            raise InvalidArgumentError("this model's tokenizer has no chat template: send raw text or token ids",
                                       reason="NO_CHAT_TEMPLATE", field="messages")
        return list(
            self._require_tokenizer().apply_chat_template(
                list(messages), tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False,
            )
        )

    def render_chat_text(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None, *,
        add_generation_prompt: bool = False,
    ) -> str:
        """The chat template's text for ``messages`` (the agent loop diffs two of these)."""
        return self._require_tokenizer().apply_chat_template(
            list(messages), tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt, tokenize=False,
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

    def validate_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Typed errors for prompts the engine cannot serve."""
        if not self.weight_version:
            raise UnavailableError("no weights loaded yet", reason="ENGINE_NOT_READY")
        if not prompt_ids:
            raise invalid_field("prompt", "the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgumentError(
                f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
                reason="TOKEN_OUT_OF_VOCAB",
                field="prompt_token_ids",
            )
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidArgumentError(
                f"prompt of {len(prompt_ids)} tokens leaves no room in the {self.max_model_len}-token context",
                reason="PROMPT_TOO_LONG",
                field="prompt",
            )
