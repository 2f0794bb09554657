"""Rollout engines: the :class:`~.base.Engine` interface and one module per implementation."""

from __future__ import annotations

from yieldloop_server.rollout.engines.base import AdapterEngine, Engine, SamplingConfig, TokenDelta, whole_completion


def create_engine(kind: str, lora: bool = False, **options: object) -> Engine:
    """The engine named ``kind``: "torch", or "vllm" (``pip install 'yieldloop-server[vllm]'``); with ``lora``
    one that serves LoRA adapters over its weights (the torch engine always can). ``process``: the torch engine
    decodes in a child process (:mod:`.torch_process`); vLLM's engine core always runs in one."""
    process = options.pop("process", False)
    if kind == "torch":
        if process:
            from yieldloop_server.rollout.engines.torch_process import TorchProcessEngine

            return TorchProcessEngine(**options)
        from yieldloop_server.rollout.engines.torch_engine import TorchEngine

        return TorchEngine(**options)
    if kind == "vllm":
        from yieldloop_server.rollout.engines.vllm_engine import VllmEngine, vllm_available

        if not vllm_available():
            raise ValueError("the vllm engine needs vLLM: pip install 'yieldloop-server[vllm]'")
        return VllmEngine(lora=lora, **options)
    raise ValueError(f"unknown engine {kind!r} (available: torch, vllm)")


__all__ = ["AdapterEngine", "Engine", "SamplingConfig", "TokenDelta", "create_engine", "whole_completion"]
