"""Rollout engines: the :class:`~.base.Engine` interface and one module per implementation."""

from __future__ import annotations

from yieldloop.services.rollout.engines.base import Engine, SamplingConfig, TokenDelta


def create_engine(kind: str, **options: object) -> Engine:
    """The engine named ``kind`` ("torch"; "vllm" arrives with the vLLM extra)."""
    if kind == "torch":
        from yieldloop.services.rollout.engines.torch_engine import TorchEngine

        return TorchEngine(**options)
    raise ValueError(f"unknown engine {kind!r} (available: torch)")


__all__ = ["Engine", "SamplingConfig", "TokenDelta", "create_engine"]
