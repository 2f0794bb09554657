"""The Engine interface: token-in/token-out sampling with logprobs and weight versions."""

from __future__ import annotations

import abc
import dataclasses
import pathlib
from collections.abc import AsyncIterator, Sequence

from yieldloop.errors import InvalidArgumentError, UnavailableError, invalid_field


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Sampling parameters for one request."""

    max_tokens: int = 16
    """Completion tokens at most; must be > 0."""
    temperature: float = 1.0
    """0 samples greedily; logprobs are those of softmax(logits / temperature) (raw at 0)."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    top_k: int = 0
    """0 disables top-k."""
    stop: tuple[str, ...] = ()
    seed: int = 0
    """0: unseeded."""

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
    sampled by exactly one weight version, which each delta reports.
    """

    name: str = "engine"

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
    def render_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Prompt ids for chat messages, with the generation prompt added."""

    @abc.abstractmethod
    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of completion tokens (special tokens dropped)."""

    @abc.abstractmethod
    def generate(self, prompt_ids: Sequence[int], sampling: SamplingConfig) -> AsyncIterator[TokenDelta]:
        """Streams deltas for one request; closing the iterator cancels it."""

    async def close(self) -> None:
        """Releases threads and memory."""

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
