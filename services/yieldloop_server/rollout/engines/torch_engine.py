"""The torch engine: a transformers model with a KV cache and continuous batching.

The light default for tiny models and for GPU images without vLLM. One worker thread owns the model and a
running batch: at every decode step requests that finished leave it (their rows of the KV cache are dropped)
and waiting requests join it (prefilled together, their cache rows left-padded to the batch's length), up to
``max_batch_size`` rows. Sampling is one set of tensor operations for the whole batch; each request draws its
randomness from its own generator, so a seeded request samples the same tokens whatever it is batched with.
Base weights are swapped only when the running batch is empty (new requests wait meanwhile), so every token of
a request is sampled by the one weight version its deltas report; a LoRA adapter's rows keep the adapter
version they started with.

Legend: B batch, L prompt length, T cached length, V vocabulary.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import dataclasses
import inspect
import logging
import math
import pathlib
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from yieldloop.errors import FailedPreconditionError, UnavailableError
from yieldloop_server.rollout.engines import lean
from yieldloop_server.rollout.engines.base import Engine, SamplingConfig, TokenDelta, folder_signature, merge_deltas

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
    signature: tuple[tuple[str, bytes], ...] | None = None
    """Digests of the folder's files other than the weights (config, tokenizer, chat template): a later checkpoint
    with the same ones can be loaded into this model in place (see :func:`reload_in_place`)."""
    plain: bool = False
    """Whether every layer is plain full attention (no sliding window): batches then pass the model ready 4D masks
    (see _Batch._attention) and it runs SDPA; otherwise eager attention and transformers' masks."""
    last_logits: dict[str, int] = dataclasses.field(default_factory=dict)
    """``{"logits_to_keep": 1}`` when the model takes it: a prefill computes the output layer at each prompt's last
    position only (the logits a batch samples from), not at every position (prompt x vocabulary floats)."""
    lean: bool = False
    """Whether the model runs :func:`~yieldloop_server.rollout.engines.lean.forward` (a plain Llama-shaped model:
    its forward pass without transformers' per-call layers) instead of its own forward."""


@dataclasses.dataclass
class _Adapter:
    version: str
    layers: dict[str, tuple[Any, Any]]
    """Module name -> (A^T (in, r), scaling * B^T (r, out)); empty for a fresh adapter (B = 0: the base's
    output)."""


class Sink:
    """Where the worker thread hands requests' deltas (and errors): ``deliver`` gets one decode step's items of
    every request of this sink at once, as (the request's key, item) pairs."""

    def deliver(self, items: list[tuple[Any, TokenDelta | BaseException]]) -> None:
        raise NotImplementedError


class LoopSink(Sink):
    """Requests awaited on an event loop, each key an asyncio.Queue: one wake-up of the loop per decode step."""

    _by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopSink] = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> LoopSink:
        sink = cls._by_loop.get(loop)
        if sink is None:
            sink = cls._by_loop[loop] = cls(loop)
        return sink

    def deliver(self, items: list[tuple[Any, TokenDelta | BaseException]]) -> None:
        with contextlib.suppress(RuntimeError):  # that loop is closed: nobody is waiting
            self.loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for out, item in items:
        out.put_nowait(item)


async def drain(out: asyncio.Queue) -> AsyncIterator[TokenDelta]:
    """A request's deltas from its queue until the finishing one (an error put there is raised); deltas that
    queued while the consumer was busy (writing the last one) go out as one."""
    while True:
        item = await out.get()
        while isinstance(item, TokenDelta) and not item.finished and not out.empty():
            following = out.get_nowait()
            if not isinstance(following, TokenDelta):
                yield item
                item = following
                break
            item = merge_deltas(item, following)
        if isinstance(item, BaseException):
            raise item
        yield item
        if item.finished:
            return


UNIFORM_DRAWS = 32
"""Numbers a request draws from its generator at once (see :meth:`_Request.uniform`)."""


@dataclasses.dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingConfig
    sink: Sink
    key: Any
    generator: Any
    adapter: str = ""
    cancelled: bool = False
    expected: bool = False
    """Submitted under :meth:`TorchEngine.expect`: its batch knows when no more are on their way."""
    drawn: list[float] = dataclasses.field(default_factory=list)
    """Numbers drawn from ``generator`` and not used yet (last first)."""

    def emit(self, item: TokenDelta | BaseException) -> None:
        self.sink.deliver([(self.key, item)])

    def uniform(self) -> float:
        """The next number of this request's own stream (one per sampled token): drawn from its generator
        UNIFORM_DRAWS at a time, one call per that many tokens instead of one per token."""
        if not self.drawn:
            import torch

            self.drawn = torch.rand(UNIFORM_DRAWS, generator=self.generator, dtype=torch.float64).tolist()[::-1]
        return self.drawn.pop()


class _Expected:
    """One request on its way to an engine (see :meth:`TorchEngine.expect`); released once, when submitted or when
    its block ends."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine
        self.open = True
        with engine._expected_lock:
            engine._expected += 1

    def release(self) -> None:
        engine = self.engine
        with engine._expected_lock:
            if not self.open:
                return
            self.open = False
            engine._expected -= 1
            last = engine._expected == 0
        if last:
            engine._pending.put(_WAKE)  # a batch gathering company starts now


_EXPECTED: contextvars.ContextVar[_Expected | None] = contextvars.ContextVar("yieldloop_expected", default=None)


def load_hf_weights(folder: pathlib.Path, version: str, device: str, dtype: str) -> _Weights:
    """Loads an HF checkpoint folder for inference. Models whose layers are all plain full attention run SDPA
    with the batch's own finite 4D masks; others (sliding windows) eager attention with transformers' masks.
    Either way a prefill's left-padded rows, which attend to nothing, stay NaN-free."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    from yieldloop_server.common.hf import load_causal_lm

    signature = folder_signature(folder)
    model, tokenizer = load_causal_lm(folder, dtype, device, attn_implementation="sdpa")
    plain = all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)
    if not plain:
        model.set_attn_implementation("eager")
    model.eval()
    eos = model.generation_config.eos_token_id if model.generation_config else None
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    return _Weights(
        model,
        tokenizer,
        version,
        frozenset(eos_ids),
        model.config.max_position_embeddings,
        signature=signature,
        plain=plain,
        last_logits={"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {},
        lean=plain and lean.supports(model),
    )


def reload_in_place(
    spare: _Weights, folder: pathlib.Path, version: str, signature: tuple[tuple[str, bytes], ...] | None = None
) -> _Weights | None:
    """``folder``'s weights copied into ``spare``'s model (a model no request uses), when the folder differs from
    the one ``spare`` was loaded from only in its weights: same config, tokenizer and chat template, safetensors
    with exactly the model's tensors (tied ones may be left out). None when it cannot be done that way (then
    ``spare``'s model may hold part of the new weights: drop it and load in full).

    A reload in place costs reading the weights; a full load builds the model and the tokenizer again (~15 ms
    for the tiny model, most of the reload). ``signature``: the folder's :func:`folder_signature`, when its caller
    computed it already."""
    import torch
    from safetensors.torch import load_file

    signature = signature or folder_signature(folder)
    if signature is None or signature != spare.signature:
        return None
    model = spare.model
    params = model.state_dict()
    loaded: dict[str, Any] = {}
    for file in sorted(folder.glob("*.safetensors")):
        loaded.update(load_file(file))
    if not loaded or set(loaded) - set(params):
        return None
    written = {params[name].data_ptr() for name in loaded}
    if any(params[name].data_ptr() not in written for name in set(params) - set(loaded)):
        return None  # a tensor the file does not give (and that is not tied to one it gives)
    try:
        with torch.no_grad():
            for name, tensor in loaded.items():
                params[name].copy_(tensor)
    except RuntimeError:  # shapes differ
        return None
    return dataclasses.replace(spare, version=version)


def _model_bytes(model: Any) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def sample_batch(logits_BV: Any, samplings: Sequence[SamplingConfig], uniforms: Sequence[float]) -> tuple[Any, Any]:
    """Samples one token per row; returns the tokens (B) and their logprobs (B, float64) under the distribution
    each was drawn from.

    That is softmax(logits / temperature), restricted to top-k / top-p and renormalised when those are set
    (vLLM's ``processed_logprobs``); greedy (temperature 0) reports the raw log-softmax. Each row's token is
    where its uniform number (in [0, 1), from its request's own stream: :meth:`_Request.uniform`) falls in its
    distribution's CDF (inverse-CDF sampling), so its token does not depend on its batch.
    """
    import torch

    device = logits_BV.device
    num_rows, vocab = logits_BV.shape
    temps_B = torch.tensor([s.temperature for s in samplings], dtype=torch.float32, device=device)
    greedy_B = temps_B == 0
    logprobs_BV = torch.log_softmax(logits_BV.float() / torch.where(greedy_B, 1.0, temps_B)[:, None], dim=-1)
    probs_BV = logprobs_BV.exp()
    ks_B = torch.tensor([s.top_k if 0 < s.top_k < vocab else 0 for s in samplings], device=device)
    truncated_B = ks_B > 0
    if bool(truncated_B.any()):
        top_BK = torch.topk(probs_BV, int(ks_B.max())).values
        kth_B = top_BK.gather(1, (ks_B.clamp(min=1) - 1)[:, None])
        probs_BV = torch.where(truncated_B[:, None] & (probs_BV < kth_B), 0.0, probs_BV)
    ps_B = torch.tensor([s.top_p for s in samplings], dtype=torch.float32, device=device)
    nucleus_B = ps_B < 1
    if bool(nucleus_B.any()):
        sorted_BV, order_BV = torch.sort(probs_BV, dim=-1, descending=True)
        keep_BV = torch.cumsum(sorted_BV, -1) - sorted_BV < ps_B[:, None] * sorted_BV.sum(-1, keepdim=True)
        kept_BV = torch.zeros_like(probs_BV).scatter(1, order_BV, sorted_BV * keep_BV)
        probs_BV = torch.where(nucleus_B[:, None], kept_BV, probs_BV)
        truncated_B = truncated_B | nucleus_B
    uniform_B = torch.tensor(uniforms, dtype=torch.float64, device=device)
    cdf_BV = torch.cumsum(probs_BV.double(), dim=-1)
    drawn_B = torch.searchsorted(cdf_BV, (uniform_B * cdf_BV[:, -1])[:, None], right=True)[:, 0].clamp(max=vocab - 1)
    tokens_B = torch.where(greedy_B, logprobs_BV.argmax(-1), drawn_B)
    logprobs_B = logprobs_BV.gather(1, tokens_B[:, None])[:, 0].double()
    renorm_B = torch.where(truncated_B & ~greedy_B, cdf_BV[:, -1].log(), 0.0)
    return tokens_B.cpu(), (logprobs_B - renorm_B).cpu()


def sample_token(logits_V: Any, sampling: SamplingConfig, uniform: float) -> tuple[int, float]:
    """One request's token and its logprob (see :func:`sample_batch`)."""
    tokens, logprobs = sample_batch(logits_V[None, :], [sampling], [uniform])
    return int(tokens[0]), float(logprobs[0])


@dataclasses.dataclass
class _Row:
    """A request in the running batch."""

    request: _Request
    version: str
    """The weights (or adapter) version every token of it is sampled by."""
    layers: dict[str, tuple[Any, Any]]
    """Its adapter's layers (empty: the base weights alone)."""
    budget: int
    """Tokens it may generate (max_tokens, bounded by the context left)."""
    position: int
    """Position of its next token."""
    generated: list[int] = dataclasses.field(default_factory=list)
    held: tuple[list[int], list[float]] = dataclasses.field(default_factory=lambda: ([], []))
    """Tokens sampled and not yet streamed, and their logprobs (see SamplingConfig.stream_interval_s)."""
    sent_at: float = -math.inf
    """When it last streamed (time.monotonic)."""


class TorchEngine(Engine):
    """Continuous batching with transformers on CPU or CUDA.

    Args:
        device: torch device string.
        dtype: torch dtype name for inference ("float32" keeps sampler/trainer
            logprobs within 1e-4 of each other).
        max_batch_size: Requests decoded together at most (as vLLM's ``max_num_seqs`` default: a GRPO batch of
            128 or 256 episodes decodes as one batch; at 64 the loop's 128 episodes decoded in two waves, each decode
            step paying the model's fixed cost for half the rows: -20% per loop step on 2 CPU cores at 256);
            0: that default.
        batch_wait_s: When nothing is running, how long the worker waits for another request to start with (each
            arrival waits again, up to ``batch_wait_max_s`` in all).
        batch_wait_max_s: The longest a batch waits for company before it starts.
        spare_max_bytes: Models up to this size stay loaded after a swap, for the next reload to copy its weights
            into (:func:`reload_in_place`); larger ones are freed (the memory of one model copy while serving)
            and built again at each reload, whose time reading the weights dominates anyway.

    LoRA adapters (:meth:`load_adapter`) are applied per request: each linear layer an adapter targets adds
    that adapter's low-rank update to the rows of the batch that use it, so requests for several forks of
    one base decode in one batch over one copy of the base weights.
    """

    name = "torch"
    in_place_loads = 0
    """Reloads that copied new weights into the previous model instead of building one (:func:`reload_in_place`)."""

    def __init__(
        self,
        device: str = "cpu",
        dtype: str = "float32",
        max_batch_size: int = 256,
        batch_wait_s: float = 0.005,
        batch_wait_max_s: float = 0.05,
        spare_max_bytes: int = 4 << 30,
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.spare_max_bytes = spare_max_bytes
        self.max_batch_size = max_batch_size or 256
        self.batch_wait_s = batch_wait_s
        self.batch_wait_max_s = batch_wait_max_s
        self._weights: _Weights | None = None
        self._spare: _Weights | None = None
        """The weights served before the current ones, once nothing uses them: the next reload goes into them."""
        self._origin: TorchEngine | None = None
        """An engine whose weights this one's first load may copy (:meth:`start_from`)."""
        self._swaps: list[tuple[_Weights, asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._adapters: dict[str, _Adapter] = {}
        """LoRA adapters by name (changed by the worker thread between batches only)."""
        self._adapter_swaps: list[tuple[str, _Adapter | None, asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._active: list[tuple[dict[str, tuple[Any, Any]], Any]] = []
        """The rows of the forward pass being run: (adapter layers, row indices) of each adapter in it."""
        self._swap_lock = threading.Lock()
        self._pending: queue.Queue = queue.Queue()
        self._expected = 0
        """Requests on their way (:meth:`expect`)."""
        self._expected_lock = threading.Lock()
        self._stopping = False
        self._live = 0
        """Requests admitted or waiting in the worker that are not done yet (written by the worker thread)."""
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
        with self._swap_lock:
            spare, self._spare = self._spare, None
        weights = await asyncio.to_thread(self._load, spare, folder, version)
        loop = asyncio.get_running_loop()
        swapped = loop.create_future()
        with self._swap_lock:
            self._swaps.append((weights, loop, swapped))
        self._pending.put(_WAKE)
        await swapped

    def start_from(self, other: Engine) -> None:
        if isinstance(other, TorchEngine) and (other.device, other.dtype) == (self.device, self.dtype):
            self._origin = other

    def _copy_served(self, signature: tuple[tuple[str, bytes], ...] | None) -> _Weights | None:
        """A spare for a load that has none (this engine's first reload, or its first load after
        :meth:`start_from`): a copy of the weights served here (or by the engine started from), when the folder to
        load (its ``signature``) differs from theirs only in its weights. Copying a model and then the new weights
        into it costs a fraction of building one (the tiny model: 3 ms against 15), and the weights replaced become
        the spare of the next reload, as they would have. Not for models over ``spare_max_bytes``, nor ones with
        LoRA hooks."""
        served = self._weights or (self._origin._weights if self._origin is not None else None)
        if (
            served is None
            or served.hooked
            or served.signature is None
            or served.signature != signature
            or _model_bytes(served.model) > self.spare_max_bytes
        ):
            return None
        try:
            return dataclasses.replace(served, model=copy.deepcopy(served.model))  # the batches using it only read it
        except Exception:  # deliberate degrade: a model that cannot be copied is built
            log.warning("could not copy the served model; loading in full", exc_info=True)
            return None

    def _load(self, spare: _Weights | None, folder: pathlib.Path, version: str) -> _Weights:
        signature = folder_signature(folder)  # (read once: the copy and the reload both check it)
        spare = spare or self._copy_served(signature)
        self._origin = None
        weights = reload_in_place(spare, folder, version, signature) if spare is not None else None
        if weights is None:
            weights = load_hf_weights(folder, version, self.device, self.dtype)
        else:
            self.in_place_loads += 1
            log.info("weights %s loaded in place", version)
        serving = self._weights
        if serving is not None and weights.signature is not None and weights.signature == serving.signature:
            # The same tokenizer files: keep serving's tokenizer object, and with it the chat renderings it
            # remembers (ChatRenders is per tokenizer object; the spare's own would reset them at every reload).
            weights = dataclasses.replace(weights, tokenizer=serving.tokenizer)
        return weights

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
        self.validate_request(prompt_ids, sampling, adapter)
        out: asyncio.Queue = asyncio.Queue()
        request = self.submit(prompt_ids, sampling, adapter, LoopSink.of(asyncio.get_running_loop()), out)
        try:
            async for delta in drain(out):
                yield delta
        finally:
            request.cancelled = True

    def submit(
        self, prompt_ids: Sequence[int], sampling: SamplingConfig, adapter: str, sink: Sink, key: Any
    ) -> _Request:
        """Queues a validated request whose items go to ``sink`` under ``key``; returns it (setting its
        ``cancelled`` cancels it)."""
        import torch

        generator = torch.Generator(device="cpu")
        if sampling.seed:
            generator.manual_seed(sampling.seed)
        else:
            generator.seed()
        expected = _EXPECTED.get()
        expected = expected if expected is not None and expected.engine is self and expected.open else None
        request = _Request(list(prompt_ids), sampling, sink, key, generator, adapter, expected=expected is not None)
        self._pending.put(request)
        if expected is not None:
            expected.release()
        return request

    @contextlib.contextmanager
    def expect(self) -> Iterator[None]:
        expected = _Expected(self)
        token = _EXPECTED.set(expected)
        try:
            yield
        finally:
            _EXPECTED.reset(token)
            expected.release()

    def num_unfinished(self) -> int:
        return self._pending.qsize() + self._live

    async def close(self) -> None:
        self._stopping = True
        self._pending.put(_WAKE)
        await asyncio.to_thread(self._thread.join, 10)

    # Worker thread ------------------------------------------------------------------

    def _apply_swaps(self, weights_too: bool) -> None:
        """Applies pending adapter swaps, and base weight swaps when ``weights_too`` (nothing is running)."""
        with self._swap_lock:
            swaps, self._swaps = (self._swaps, []) if weights_too else ([], self._swaps)
            adapter_swaps, self._adapter_swaps = self._adapter_swaps, []
        for weights, loop, future in swaps:
            old = self._weights
            if old is not None and old.model is not weights.model and _model_bytes(old.model) <= self.spare_max_bytes:
                with self._swap_lock:  # nothing runs on the old weights any more (swaps wait for an empty batch)
                    self._spare = old
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
        of the batch that use that adapter (peft's LoRA forward, per request)."""
        import torch

        def hook_for(name: str) -> Any:
            def hook(module: Any, args: tuple[Any, ...], output: Any) -> Any:
                for layers, rows in self._active:
                    entry = layers.get(name)
                    if entry is not None:
                        a_t, b_t = entry
                        output.index_add_(0, rows, (args[0][rows] @ a_t) @ b_t)
                return output

            return hook

        for name, module in weights.model.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(hook_for(name))
        weights.hooked = True

    def _worker(self) -> None:
        waiting: list[_Request] = []
        batch = _Batch(self)
        while not self._stopping:
            self._apply_swaps(weights_too=not batch.rows)  # base weights only between requests
            # Block only when nothing runs; then gather company (a burst: a rollout's episodes reach the engine over
            # some milliseconds as their environments start), up to batch_wait_max_s in all: while requests are
            # on their way (expect()), until the last of them came; otherwise while arrivals keep coming, each
            # within batch_wait_s of the previous one. A batch started with the burst's first few would prefill
            # the rest a few at a time, a forward pass each.
            if not batch.rows and not waiting:
                first = self._pending.get()
                if first is not _WAKE:
                    waiting.append(first)
                last = time.monotonic()
                cutoff = last + self.batch_wait_max_s
                told = any(request.expected for request in waiting)
                while waiting and len(waiting) < self.max_batch_size:
                    if self._expected:
                        until = cutoff
                    elif told:
                        break  # the last request on its way came
                    else:
                        until = min(last + self.batch_wait_s, cutoff)
                    try:
                        item = self._pending.get(timeout=max(0.0, until - time.monotonic()))
                    except queue.Empty:
                        break
                    if item is not _WAKE:
                        waiting.append(item)
                        told = told or item.expected
                        last = time.monotonic()
            while True:
                try:
                    item = self._pending.get_nowait()
                except queue.Empty:
                    break
                if item is not _WAKE:
                    waiting.append(item)
            with self._swap_lock:  # a base swap that came meanwhile is applied next turn, once nothing runs
                swap_pending = bool(self._swaps)
            admitting: list[_Request] = []
            try:
                if not swap_pending and waiting and len(batch.rows) < self.max_batch_size and batch.can_join:
                    room = self.max_batch_size - len(batch.rows)
                    admitting, waiting = waiting[:room], waiting[room:]
                    batch.admit(admitting)
                    admitting = []
                self._live = len(batch.rows) + len(waiting)
                if batch.rows:
                    batch.step()
            except Exception as exc:  # deliberate degrade: fail the running batch (retryably), keep serving
                log.exception("decode failed")
                error = UnavailableError(f"torch engine error: {exc}", reason="ENGINE_ERROR")
                for request in {id(r): r for r in [*(row.request for row in batch.rows), *admitting]}.values():
                    request.emit(error)
                batch = _Batch(self)
            self._live = len(batch.rows) + len(waiting)
        for request in waiting:
            request.emit(UnavailableError("the engine stopped", reason="ENGINE_NOT_READY"))

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


def _deliver(outgoing: list[tuple[_Request, Any]]) -> None:
    """Hands each request its item: one delivery per sink (one wake-up of each event loop) per decode step."""
    by_sink: dict[int, tuple[Sink, list[tuple[Any, Any]]]] = {}
    for request, item in outgoing:
        by_sink.setdefault(id(request.sink), (request.sink, []))[1].append((request.key, item))
    for sink, items in by_sink.values():
        sink.deliver(items)


class _Batch:
    """The worker's running batch: its rows, their shared KV cache (rows left-padded to one length), the
    attention mask over it and each row's next-token logits."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine
        self.rows: list[_Row] = []
        self.cache: Any = None
        self.mask_BT: Any = None
        self.logits_BV: Any = None

    @property
    def can_join(self) -> bool:
        """Whether requests can join now: the cache's layers can be padded and merged (plain full-attention
        layers); otherwise they wait until the batch is empty."""
        return not self.rows or self.engine._weights.plain

    def _attention(self, mask_BT: Any, queries: int) -> Any:
        """The attention mask the model gets for ``queries`` new positions at the end of ``mask_BT``'s columns (1: a
        token, 0: padding). When every layer is plain full attention, a ready 4D additive mask: 0 where a query
        may attend, the dtype's lowest finite value elsewhere (finite: a prefill's padded rows, which attend to
        nothing, stay NaN-free), so transformers does not rebuild one at every decode step; otherwise the 2D mask
        (sliding-window layers need masks of their own)."""
        import torch

        if not self.engine._weights.plain:
            return mask_BT
        columns = mask_BT.shape[1]
        allowed = mask_BT.bool()[:, None, None, :]
        if queries > 1:  # causal among the new positions
            allowed = allowed & torch.ones(queries, columns, dtype=torch.bool, device=mask_BT.device).tril(
                columns - queries
            )
        dtype = self.engine._weights.model.dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=mask_BT.device).masked_fill_(
            ~allowed, torch.finfo(dtype).min
        )

    def _forward(self, rows: list[_Row], **inputs: Any) -> Any:
        import torch

        groups: dict[int, tuple[dict[str, tuple[Any, Any]], list[int]]] = {}
        for i, row in enumerate(rows):
            if row.layers:
                groups.setdefault(id(row.layers), (row.layers, []))[1].append(i)
        engine = self.engine
        engine._active = [(layers, torch.tensor(ix, device=engine.device)) for layers, ix in groups.values()]
        try:
            weights = engine._weights
            if weights.lean and not engine._active:  # (LoRA rows need the hooks of the model's layers)
                logits = lean.forward(weights.model, **inputs, **weights.last_logits)
            else:
                logits = weights.model(**inputs, **weights.last_logits, use_cache=True).logits
        finally:
            engine._active = []
        return logits[:, -1, :].float()

    def admit(self, requests: list[_Request]) -> None:
        """Prefills ``requests`` together and joins them to the running batch."""
        import torch
        from transformers import DynamicCache

        engine = self.engine
        weights = engine._weights
        assert weights is not None
        new = []
        for request in requests:
            if request.cancelled:
                continue
            adapter = engine._adapters.get(request.adapter) if request.adapter else None
            if request.adapter and adapter is None:
                request.emit(UnavailableError(f"adapter {request.adapter!r} was unloaded", reason="ENGINE_NOT_READY"))
                continue
            budget = min(request.sampling.max_tokens, weights.max_model_len - len(request.prompt_ids))
            new.append(
                _Row(
                    request,
                    adapter.version if adapter else weights.version,
                    adapter.layers if adapter else {},
                    budget,
                    len(request.prompt_ids),
                )
            )
        if not new:
            return
        # Identical prompts (a GRPO group's episodes) are prefilled once; their rows then share its cache and logits.
        distinct: dict[tuple[str, str, tuple[int, ...]], int] = {}
        firsts: list[_Row] = []
        source: list[int] = []  # each new row's row in the prefill
        for row in new:
            key = (row.request.adapter, row.version, tuple(row.request.prompt_ids))
            if key not in distinct:
                distinct[key] = len(firsts)
                firsts.append(row)
            source.append(distinct[key])
        device = engine.device
        length = max(len(row.request.prompt_ids) for row in firsts)
        tokens_BL = torch.full((len(firsts), length), weights.tokenizer.pad_token_id or 0, dtype=torch.long)
        mask_BL = torch.zeros((len(firsts), length), dtype=torch.long)
        for i, row in enumerate(firsts):
            tokens_BL[i, length - len(row.request.prompt_ids) :] = torch.tensor(row.request.prompt_ids)
            mask_BL[i, length - len(row.request.prompt_ids) :] = 1
        positions_BL = (mask_BL.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=weights.model.config)
        mask_BL = mask_BL.to(device)
        with torch.inference_mode():
            logits_BV = self._forward(
                firsts,
                input_ids=tokens_BL.to(device),
                attention_mask=self._attention(mask_BL, length),
                position_ids=positions_BL.to(device),
                past_key_values=cache,
            )
            if len(firsts) < len(new):
                index = torch.tensor(source, device=device)
                cache.batch_select_indices(index)
                mask_BL, logits_BV = mask_BL[index], logits_BV[index]
        if not self.rows:
            self.rows, self.cache, self.mask_BT, self.logits_BV = new, cache, mask_BL, logits_BV
            return
        width = max(self.mask_BT.shape[1], length)

        def pad(tensor: Any, dim: int) -> Any:  # left-pads the sequence dimension to ``width``
            missing = width - tensor.shape[dim]
            if not missing:
                return tensor
            shape = list(tensor.shape)
            shape[dim] = missing
            return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)

        for old, joined in zip(self.cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([pad(old.keys, 2), pad(joined.keys, 2)])
            old.values = torch.cat([pad(old.values, 2), pad(joined.values, 2)])
        self.mask_BT = torch.cat([pad(self.mask_BT, 1), pad(mask_BL, 1)])
        self.logits_BV = torch.cat([self.logits_BV, logits_BV])
        self.rows += new

    def _sample(self) -> tuple[list[int | None], list[float], list[BaseException | None]]:
        rows = self.rows
        uniforms = [r.request.uniform() for r in rows]
        try:
            tokens_B, logprobs_B = sample_batch(self.logits_BV, [r.request.sampling for r in rows], uniforms)
            return tokens_B.tolist(), logprobs_B.tolist(), [None] * len(rows)
        except Exception:  # deliberate degrade: sample row by row, so that only a failing request fails
            tokens, logprobs, failures = [], [], []
            for i, row in enumerate(rows):
                try:
                    token, logprob = sample_token(self.logits_BV[i], row.request.sampling, uniforms[i])
                    tokens.append(token), logprobs.append(logprob), failures.append(None)
                except Exception as exc:
                    log.exception("sampling failed for one request")
                    tokens.append(None), logprobs.append(math.nan), failures.append(exc)
            return tokens, logprobs, failures

    def step(self) -> None:
        """Samples a token for every row, streams them, drops the rows that finished and runs the next decode
        step for the others."""
        import torch

        engine = self.engine
        weights = engine._weights
        tokens, logprobs, failures = self._sample()
        now = time.monotonic()
        outgoing: list[tuple[_Request, Any]] = []
        keep: list[int] = []
        for i, row in enumerate(self.rows):
            request = row.request
            if request.cancelled:
                outgoing.append((request, TokenDelta([], [], row.version, finished=True, stop_reason="cancelled")))
                continue
            if failures[i] is None and not math.isfinite(logprobs[i]):
                failures[i] = ValueError(f"the sampled token's logprob is {logprobs[i]}")
            if failures[i] is not None:
                outgoing.append(
                    (request, UnavailableError(f"torch engine error: {failures[i]}", reason="ENGINE_ERROR"))
                )
                continue
            row.generated.append(tokens[i])
            reason = engine._stop_reason(weights, request, row.generated, row.budget)
            row.held[0].append(tokens[i]), row.held[1].append(logprobs[i])
            if reason or now - row.sent_at >= request.sampling.stream_interval_s:
                outgoing.append((request, TokenDelta(*row.held, row.version, bool(reason), reason)))
                row.held, row.sent_at = ([], []), now
            if not reason:
                keep.append(i)
        _deliver(outgoing)
        if len(keep) < len(self.rows):
            if not keep:
                self.rows, self.cache, self.mask_BT, self.logits_BV = [], None, None, None
                return
            index = torch.tensor(keep, device=engine.device)
            self.cache.batch_select_indices(index)
            self.mask_BT = self.mask_BT[index]
            self.rows = [self.rows[i] for i in keep]
            lead = int((self.mask_BT.sum(0) > 0).long().argmax())  # columns no remaining row attends to
            if lead:
                self.mask_BT = self.mask_BT[:, lead:]
                for layer in self.cache.layers:
                    layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]
        step_tokens = [tokens[i] for i in keep]
        self.mask_BT = torch.cat([self.mask_BT, self.mask_BT.new_ones((len(self.rows), 1))], dim=1)
        positions_B1 = torch.tensor([row.position for row in self.rows], device=engine.device)[:, None]
        with torch.inference_mode():
            self.logits_BV = self._forward(
                self.rows,
                input_ids=torch.tensor(step_tokens, device=engine.device)[:, None],
                attention_mask=self._attention(self.mask_BT, 1),
                position_ids=positions_B1,
                past_key_values=self.cache,
            )
        for row in self.rows:
            row.position += 1
