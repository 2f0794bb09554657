"""The torch engine: a transformers model with a KV cache and batched sampling.

The light default for tiny models and for GPU images without vLLM. One worker
thread owns the model: requests that arrive within ``batch_wait_s`` of each
other are decoded together (left-padded, one shared ``DynamicCache``), and
weights are swapped only between batches, so every token of a request is
sampled by the one weight version its deltas report.

Legend: B batch, L prompt length, V vocabulary.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import pathlib
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from yieldloop.errors import FailedPreconditionError, UnavailableError
from yieldloop_server.rollout.engines.base import Engine, SamplingConfig, TokenDelta

log = logging.getLogger(__name__)
_WAKE = object()


@dataclasses.dataclass
class _Weights:
    model: Any
    tokenizer: Any
    version: str
    eos_ids: frozenset[int]
    max_model_len: int
    hooked: bool = False
    """Whether the LoRA hooks are installed on the model's linear layers."""


@dataclasses.dataclass
class _Adapter:
    version: str
    layers: dict[str, tuple[Any, Any]]
    """Module name -> (A^T (in, r), scaling * B^T (r, out)); empty for a fresh adapter (B = 0: the base's
    output)."""


@dataclasses.dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingConfig
    out: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    generator: Any
    adapter: str = ""
    cancelled: bool = False

    def emit(self, item: TokenDelta | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


def load_hf_weights(folder: pathlib.Path, version: str, device: str, dtype: str) -> _Weights:
    """Loads an HF checkpoint folder for inference (eager attention: left padding stays NaN-free)."""
    from yieldloop_server.common.hf import load_causal_lm

    model, tokenizer = load_causal_lm(folder, dtype, device, attn_implementation="eager")
    model.eval()
    eos = model.generation_config.eos_token_id if model.generation_config else None
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    return _Weights(model, tokenizer, version, frozenset(eos_ids), model.config.max_position_embeddings)


def sample_token(logits_V: Any, sampling: SamplingConfig, generator: Any) -> tuple[int, float]:
    """Samples one token; returns it with its logprob under the distribution it was drawn from.

    That is softmax(logits / temperature), restricted to top-k / top-p and
    renormalised when those are set (vLLM's ``processed_logprobs``); greedy
    (temperature 0) reports the raw log-softmax.
    """
    import torch

    if sampling.temperature == 0:
        logprobs_V = torch.log_softmax(logits_V, dim=-1)
        token = int(torch.argmax(logprobs_V))
        return token, float(logprobs_V[token])
    logprobs_V = torch.log_softmax(logits_V / sampling.temperature, dim=-1)
    probs_V = logprobs_V.exp()
    truncated = False
    if sampling.top_k and sampling.top_k < probs_V.numel():
        kth = torch.topk(probs_V, sampling.top_k).values[-1]
        probs_V = torch.where(probs_V >= kth, probs_V, torch.zeros_like(probs_V))
        truncated = True
    if sampling.top_p < 1:
        sorted_probs, order = torch.sort(probs_V, descending=True)
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < sampling.top_p * sorted_probs.sum()
        probs_V = torch.zeros_like(probs_V).scatter(0, order[keep], sorted_probs[keep])
        truncated = True
    token = int(torch.multinomial(probs_V, 1, generator=generator))
    if truncated:
        return token, float(logprobs_V[token] - torch.log(probs_V.double().sum()))
    return token, float(logprobs_V[token])


class TorchEngine(Engine):
    """Batched decoding with transformers on CPU or CUDA.

    Args:
        device: torch device string.
        dtype: torch dtype name for inference ("float32" keeps sampler/trainer
            logprobs within 1e-4 of each other).
        max_batch_size: Requests decoded together at most.
        batch_wait_s: How long the worker waits for more requests to batch.

    LoRA adapters (:meth:`load_adapter`) are applied per request: each linear layer an adapter targets adds
    that adapter's low-rank update to the rows of the batch that use it, so requests for several forks of
    one base decode in one batch over one copy of the base weights.
    """

    name = "torch"

    def __init__(
        self, device: str = "cpu", dtype: str = "float32", max_batch_size: int = 64, batch_wait_s: float = 0.005
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self._weights: _Weights | None = None
        self._swaps: list[tuple[_Weights, asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._adapters: dict[str, _Adapter] = {}
        """LoRA adapters by name (changed by the worker thread between batches only)."""
        self._adapter_swaps: list[tuple[str, _Adapter | None, asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._active: list[tuple[dict[str, tuple[Any, Any]], int, int]] = []
        """The batch being decoded: (adapter layers, first row, end row) of each adapter in it."""
        self._swap_lock = threading.Lock()
        self._pending: queue.Queue = queue.Queue()
        self._stopping = False
        self._live = 0
        """Requests of the batch being decoded that are not done yet (written by the worker thread)."""
        self._thread = threading.Thread(target=self._worker, name="torch-engine", daemon=True)
        self._thread.start()

    @property
    def weight_version(self) -> str:
        return self._weights.version if self._weights else ""

    @property
    def vocab_size(self) -> int:
        assert self._weights is not None
        return self._weights.model.config.vocab_size

    @property
    def max_model_len(self) -> int:
        assert self._weights is not None
        return self._weights.max_model_len

    async def load_weights(self, folder: pathlib.Path, version: str) -> None:
        weights = await asyncio.to_thread(load_hf_weights, folder, version, self.device, self.dtype)
        loop = asyncio.get_running_loop()
        swapped = loop.create_future()
        with self._swap_lock:
            self._swaps.append((weights, loop, swapped))
        self._pending.put(_WAKE)
        await swapped

    async def load_adapter(self, name: str, folder: pathlib.Path, version: str) -> None:
        from yieldloop_server.common.lora import read_adapter

        layers = await asyncio.to_thread(read_adapter, folder, self.device, self.dtype)
        self._check_adapter(name, layers)
        prepared = {m: (a.T.contiguous(), (b * scaling).T.contiguous()) for m, (a, b, scaling) in layers.items()}
        await self._swap_adapter(name, _Adapter(version, prepared))

    async def unload_adapter(self, name: str) -> None:
        await self._swap_adapter(name, None)

    def adapter_version(self, name: str) -> str:
        adapter = self._adapters.get(name)
        return adapter.version if adapter else ""

    def _check_adapter(self, name: str, layers: dict[str, tuple[Any, Any, float]]) -> None:
        """CHECKPOINT_CORRUPT for an adapter whose modules or shapes do not fit the base weights."""
        if self._weights is None:
            raise UnavailableError("no base weights loaded yet", reason="ENGINE_NOT_READY")
        modules = dict(self._weights.model.named_modules())
        for module_name, (a, b, _) in layers.items():
            module = modules.get(module_name)
            if module is None or (a.shape[1], b.shape[0]) != (module.in_features, module.out_features):
                raise FailedPreconditionError(
                    f"adapter {name}: module {module_name} is not a linear layer of that shape in the base model",
                    reason="CHECKPOINT_CORRUPT",
                )

    async def _swap_adapter(self, name: str, adapter: _Adapter | None) -> None:
        loop = asyncio.get_running_loop()
        swapped = loop.create_future()
        with self._swap_lock:
            self._adapter_swaps.append((name, adapter, loop, swapped))
        self._pending.put(_WAKE)
        await swapped

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingConfig, adapter: str = ""
    ) -> AsyncIterator[TokenDelta]:
        import torch

        self.validate_prompt(prompt_ids)
        sampling.validate()
        generator = torch.Generator(device="cpu")
        if sampling.seed:
            generator.manual_seed(sampling.seed)
        else:
            generator.seed()
        if adapter and not self.adapter_version(adapter):
            raise UnavailableError(f"adapter {adapter!r} is not loaded", reason="ENGINE_NOT_READY")
        request = _Request(list(prompt_ids), sampling, asyncio.Queue(), asyncio.get_running_loop(), generator, adapter)
        self._pending.put(request)
        try:
            while True:
                item = await request.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            request.cancelled = True

    def num_unfinished(self) -> int:
        return self._pending.qsize() + self._live

    async def close(self) -> None:
        self._stopping = True
        self._pending.put(_WAKE)
        await asyncio.to_thread(self._thread.join, 10)

    # Worker thread ------------------------------------------------------------------

    def _apply_swaps(self) -> None:
        with self._swap_lock:
            swaps, self._swaps = self._swaps, []
            adapter_swaps, self._adapter_swaps = self._adapter_swaps, []
        for weights, loop, future in swaps:
            self._weights = weights
            self.weight_loads += 1
            self.tokenizer = weights.tokenizer
            log.info("serving weights %s", weights.version)
            loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_result(None))
        for name, adapter, loop, future in adapter_swaps:
            if adapter is None:
                self._adapters.pop(name, None)
            else:
                self._adapters[name] = adapter
                log.info("serving adapter %s at %s", name, adapter.version)
            loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_result(None))
        if self._adapters and self._weights is not None and not self._weights.hooked:
            self._install_lora_hooks(self._weights)

    def _install_lora_hooks(self, weights: _Weights) -> None:
        """Adds each adapter's ``scaling * B @ A @ x`` to the output of its target linear layers, for the rows
        of the batch that use that adapter (peft's LoRA forward, per request; a batch is ordered by adapter, so
        each adapter's rows are one slice)."""
        import torch

        def hook_for(name: str) -> Any:
            def hook(module: Any, args: tuple[Any, ...], output: Any) -> Any:
                for layers, start, end in self._active:
                    entry = layers.get(name)
                    if entry is not None:
                        a_t, b_t = entry
                        output[start:end] += (args[0][start:end] @ a_t) @ b_t
                return output

            return hook

        for name, module in weights.model.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(hook_for(name))
        weights.hooked = True

    def _worker(self) -> None:
        while not self._stopping:
            first = self._pending.get()
            batch = [] if first is _WAKE else [first]
            deadline = time.monotonic() + self.batch_wait_s
            while batch and len(batch) < self.max_batch_size:
                try:
                    item = self._pending.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is not _WAKE:
                    batch.append(item)
            self._apply_swaps()  # the step boundary: no request is mid-decode here
            batch = [r for r in batch if not r.cancelled]
            for request in [r for r in batch if r.adapter and r.adapter not in self._adapters]:
                request.emit(UnavailableError(f"adapter {request.adapter!r} was unloaded", reason="ENGINE_NOT_READY"))
                batch.remove(request)
            if not batch:
                continue
            batch.sort(key=lambda r: r.adapter)  # each adapter's rows in one slice
            try:
                self._decode(batch)
            except Exception as exc:  # deliberate degrade: fail this batch (retryably), keep serving
                log.exception("decode failed")
                error = UnavailableError(f"torch engine error: {exc}", reason="ENGINE_ERROR")
                for request in batch:
                    request.emit(error)
            finally:
                self._live = 0
                self._active = []

    def _decode(self, batch: list[_Request]) -> None:
        import torch
        from transformers import DynamicCache

        weights = self._weights
        assert weights is not None
        model = weights.model
        versions = [self._adapters[r.adapter].version if r.adapter else weights.version for r in batch]
        rows: dict[str, list[int]] = {}
        for i, request in enumerate(batch):
            if request.adapter and self._adapters[request.adapter].layers:
                rows.setdefault(request.adapter, []).append(i)
        self._active = [(self._adapters[name].layers, ix[0], ix[-1] + 1) for name, ix in rows.items()]
        pad = weights.tokenizer.pad_token_id or 0
        num_seqs = len(batch)
        max_len = max(len(r.prompt_ids) for r in batch)
        tokens_BL = torch.full((num_seqs, max_len), pad, dtype=torch.long)
        mask_BL = torch.zeros((num_seqs, max_len), dtype=torch.long)
        for i, request in enumerate(batch):
            tokens_BL[i, max_len - len(request.prompt_ids):] = torch.tensor(request.prompt_ids)
            mask_BL[i, max_len - len(request.prompt_ids):] = 1
        positions_BL = (mask_BL.cumsum(-1) - 1).clamp(min=0)
        budgets = [min(r.sampling.max_tokens, weights.max_model_len - len(r.prompt_ids)) for r in batch]
        generated: list[list[int]] = [[] for _ in batch]
        done = [False] * num_seqs
        cache = DynamicCache(config=model.config)
        device = self.device
        with torch.inference_mode():
            out = model(
                input_ids=tokens_BL.to(device),
                attention_mask=mask_BL.to(device),
                position_ids=positions_BL.to(device),
                past_key_values=cache,
                use_cache=True,
            )
            logits_BV = out.logits[:, -1, :].float().cpu()
            next_pos_B = positions_BL[:, -1] + 1
            for _ in range(max(budgets)):
                step_tokens = []
                for i, request in enumerate(batch):
                    if not done[i] and request.cancelled:
                        done[i] = True
                        request.emit(TokenDelta([], [], versions[i], finished=True, stop_reason="cancelled"))
                    if done[i]:
                        step_tokens.append(pad)
                        continue
                    try:
                        token, logprob = sample_token(logits_BV[i], request.sampling, request.generator)
                        if not math.isfinite(logprob):
                            raise ValueError(f"the sampled token's logprob is {logprob}")
                        generated[i].append(token)
                        reason = self._stop_reason(weights, request, generated[i], budgets[i])
                    except Exception as exc:  # deliberate degrade: this request fails, the batch goes on
                        log.exception("sampling failed for one request")
                        done[i] = True
                        request.emit(UnavailableError(f"torch engine error: {exc}", reason="ENGINE_ERROR"))
                        step_tokens.append(pad)
                        continue
                    done[i] = bool(reason)
                    request.emit(TokenDelta([token], [logprob], versions[i], finished=done[i], stop_reason=reason))
                    step_tokens.append(token)
                self._live = num_seqs - sum(done)
                if all(done):
                    return
                mask_BL = torch.cat([mask_BL, torch.ones((num_seqs, 1), dtype=torch.long)], dim=1)
                out = model(
                    input_ids=torch.tensor(step_tokens, device=device)[:, None],
                    attention_mask=mask_BL.to(device),
                    position_ids=next_pos_B[:, None].to(device),
                    past_key_values=cache,
                    use_cache=True,
                )
                logits_BV = out.logits[:, -1, :].float().cpu()
                next_pos_B = next_pos_B + 1

    @staticmethod
    def _stop_reason(weights: _Weights, request: _Request, generated: list[int], budget: int) -> str:
        if generated[-1] in weights.eos_ids and not request.sampling.ignore_eos:
            return "eos"
        if request.sampling.stop:
            text = weights.tokenizer.decode(generated, skip_special_tokens=True)
            if any(s in text for s in request.sampling.stop):
                return "stop_string"
        if len(generated) >= request.sampling.max_tokens:
            return "length"
        if len(generated) >= budget:
            return "context"
        return ""
