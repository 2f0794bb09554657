"""The training state of one model: weights, AdamW, gradient accumulation, checkpoints.

Plain Python + torch, no grpc. Calls are synchronous; the servicer runs them
on one dedicated thread so they apply in order.

Legend: B datums in a micro-batch, T tokens, V vocabulary, N flattened valid tokens, M = B x T (padding
included).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import tempfile
from collections.abc import Sequence
from typing import Any, Protocol

from yieldloop.errors import FailedPreconditionError, InvalidArgumentError, invalid_field
from yieldloop.types import Datum
from yieldloop_server.trainer import losses, sharding

MAX_LEARNING_RATE = 10.0
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"
STATE_FILES = (OPTIMIZER_FILE, STATE_FILE, "optimizer-dcp-")
"""What resuming training needs beyond the sampler weights (a name ending in "-" names every file it begins:
the sharded optimizer's files)."""


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    device: str = "cpu"
    """torch device for the weights."""
    dtype: str = "float32"
    """Training dtype: float32 on CPU, bfloat16 on GPU (float64 for exact comparisons in tests)."""
    micro_batch_tokens: int = 8192
    """Computed tokens per forward/backward micro-batch (bounds activation memory)."""
    packed: bool = True
    """Micro-batches pack several datums per row (position ids restarting per datum, attention kept within each
    datum; :func:`micro_batches`), so compute goes to real tokens. Off: one right-padded row per datum."""
    shard: str = "none"
    """"fsdp": every weight, gradient and moment sharded over the process group's ranks (:mod:`.sharding`);
    "hsdp": sharded within groups of ``shard_group`` ranks, replicated across them; "none": this process holds
    them all."""
    shard_group: int = 0
    """HSDP: ranks per shard group (0: the ranks of one node, torchrun's LOCAL_WORLD_SIZE)."""
    compute_dtype: str = ""
    """Sharded: the dtype layers compute in (bf16 on GPUs over fp32 master weights); "": ``dtype``."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's input through the forward; recompute the layer in the backward."""
    compile: bool = False
    """``torch.compile`` the model (fuses its norms, rotary and activations; the first steps of each new
    batch shape compile first)."""


@dataclasses.dataclass(frozen=True)
class AdamConfig:
    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 0.0
    """0 disables clipping."""

    def validate(self) -> AdamConfig:
        """INVALID_ARGUMENT naming the field for any NaN, infinite or out-of-range value."""
        if not (math.isfinite(self.learning_rate) and 0 < self.learning_rate <= MAX_LEARNING_RATE):
            raise invalid_field(
                "adam.learning_rate", f"learning_rate must be in (0, {MAX_LEARNING_RATE}], got {self.learning_rate}"
            )
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:  # False for NaN
                raise invalid_field(f"adam.{name}", f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not (math.isfinite(self.eps) and 0 < self.eps <= 1):
            raise invalid_field("adam.eps", f"eps must be in (0, 1], got {self.eps}")
        if not 0 <= self.weight_decay <= 1:
            raise invalid_field("adam.weight_decay", f"weight_decay must be in [0, 1], got {self.weight_decay}")
        if not (math.isfinite(self.max_grad_norm) and self.max_grad_norm >= 0):
            raise invalid_field(
                "adam.max_grad_norm",
                f"max_grad_norm must be finite and >= 0 (0: no clipping), got {self.max_grad_norm}",
            )
        return self


Rows = list[list[int]]
"""A micro-batch: rows of datum indices, each row the datums laid end to end."""


def micro_batches(lengths: Sequence[int], max_tokens: int, packed: bool) -> list[Rows]:
    """Datums (by length) grouped into micro-batches of rows of equal width, each micro-batch computing at most
    ``max_tokens`` positions (rows x width; a longer datum goes alone).

    Padded: consecutive datums, one per row, the width that of the longest. Packed: the datums longest first,
    each micro-batch as wide as its first (longest) datum, every datum placed in the first row with room for
    it (first-fit decreasing), a new row opened while the budget allows: a row's attention costs no more than
    one padded row's, and rows fill with real tokens instead of padding.
    """
    batches: list[Rows] = []
    if not packed:
        current: Rows = []
        longest = 0
        for i, length in enumerate(lengths):
            if current and max(longest, length) * (len(current) + 1) > max_tokens:
                batches.append(current)
                current, longest = [], 0
            current.append([i])
            longest = max(longest, length)
        return [*batches, current] if current else batches
    width = 0
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if row is None and batches and (len(room) + 1) * width <= max_tokens:
            batches[-1].append([])
            room.append(width)
            row = len(room) - 1
        if row is None:  # a new micro-batch, as wide as this datum (the longest left)
            batches.append([[]])
            width, room, row = lengths[i], [lengths[i]], 0
        batches[-1][row].append(i)
        room[row] -= lengths[i]
    return batches


def computed_tokens(batch: Rows, lengths: Sequence[int]) -> int:
    """The positions a micro-batch's forward computes: rows x the widest row."""
    return len(batch) * max(sum(lengths[i] for i in row) for row in batch)


@dataclasses.dataclass(frozen=True)
class AdapterSetup:
    """A LoRA fork's adapter checkpoint folder (config, weights once trained, optimizer state) and the seed a
    fresh adapter's A matrices are drawn from."""

    folder: pathlib.Path
    seed: int


def attach_adapter(model: Any, adapter: AdapterSetup) -> Any:
    """``model`` wrapped by peft with the adapter's LoRA layers (only they train), its weights loaded when it
    has any; a fresh adapter's A is drawn from ``adapter.seed`` (B is zero), the same on every load."""
    import torch
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    from yieldloop_server.common import lora

    config = LoraConfig.from_pretrained(str(adapter.folder))
    config.inference_mode = False
    config.base_model_name_or_path = getattr(model, "name_or_path", "")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(adapter.seed)
        model = get_peft_model(model, config)
    weights = adapter.folder / lora.WEIGHTS_FILE
    if weights.is_file():
        result = set_peft_model_state_dict(model, load_file(weights))
        missing = [k for k in result.missing_keys if "lora_" in k]
        if missing or result.unexpected_keys:
            raise FailedPreconditionError(
                f"adapter {adapter.folder.name} does not fit its base: missing {missing[:3]}, unexpected "
                f"{list(result.unexpected_keys)[:3]}",
                reason="CHECKPOINT_CORRUPT",
            )
    return model


class ModelTrainer(Protocol):
    """What a training session drives: one process's :class:`Trainer`, or rank 0's
    :class:`~yieldloop_server.trainer.distributed.DistributedTrainer` (every call run on every rank)."""

    num_pending_datums: int
    """Datums whose gradients wait for the next optimizer step."""
    spoiled: bool
    """A refused step left the weights unusable (reload them)."""

    @property
    def step(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def model(self) -> Any:
        """The transformers model (its config: the context length)."""
        ...

    def logprobs(self, datums: Sequence[Datum]) -> list[list[float]]: ...

    def forward_backward(
        self, datums: Sequence[Datum], loss_fn: str, loss_config: dict[str, float]
    ) -> dict[str, float]: ...

    def optim_step(self, adam: AdamConfig, revocable: bool = False) -> float: ...

    def finish_step(self, committed: bool) -> None: ...

    def drop_gradients(self) -> None: ...

    def save(self, folder: pathlib.Path, with_state: bool = True) -> pathlib.Path: ...

    def save_state(self, folder: pathlib.Path) -> pathlib.Path: ...

    def close(self) -> None: ...


class Trainer:
    """Loads an HF checkpoint folder and trains it: every weight, or with ``adapter`` a LoRA adapter over
    those frozen weights (the adapter folder then holds the optimizer state and step)."""

    def __init__(
        self, folder: pathlib.Path, config: TrainerConfig = TrainerConfig(), adapter: AdapterSetup | None = None
    ) -> None:
        import torch

        from yieldloop_server.common.hf import load_causal_lm

        self.config = config
        self.adapter = adapter
        self.source = folder
        """The folder the model was loaded from (its tokenizer files are what checkpoints hold)."""
        self.model, self.tokenizer = load_causal_lm(folder, config.dtype, config.device)
        if adapter is not None:
            self.model = attach_adapter(self.model, adapter)
            folder = adapter.folder
        self._kept = _KeptPositions(self.model)
        self.model.train()
        if config.activation_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.sharded = config.shard in ("fsdp", "hsdp")
        if self.sharded:
            import os

            group = config.shard_group or int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
            sharding.shard_model(
                self.model, config.device, config.compute_dtype, group if config.shard == "hsdp" else 0
            )
        if config.compile:
            self.model.compile()  # in place: parameter names and state_dict keys stay the model's own
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        # On CUDA one fused kernel per step; elsewhere tensor by tensor (no foreach copies of every moment).
        fused = {"fused": True} if config.device.startswith("cuda") else {"foreach": False}
        self.optimizer = torch.optim.AdamW(trainable, lr=1e-5, **fused)
        state_path = folder / STATE_FILE
        self.step = json.loads(state_path.read_text())["step"] if state_path.exists() else 0
        if sharding.has_optimizer(folder):  # written sharded, at whatever world size: resharded to this one
            sharding.load_optimizer(self.model, self.optimizer, folder)
        elif (folder / OPTIMIZER_FILE).exists():
            state = torch.load(folder / OPTIMIZER_FILE, map_location=config.device)
            if self.sharded:  # written by one process (or data parallel): each rank keeps its shards of it
                sharding.load_whole_optimizer(self.model, self.optimizer, state)
            else:
                self.optimizer.load_state_dict(state)
        self.num_pending_datums = 0
        self._stash: list[Any] | None = None
        """The gradients accumulated before the call in progress (kept apart until it is known finite)."""
        self._before_step: tuple[list[Any], dict, int] | None = None
        """Weights, optimizer state and step before the last step, until :meth:`finish_step`."""
        self.spoiled = False
        """A step without a kept copy produced non-finite weights: reload from a checkpoint before any use."""
        self._direct_save: tuple[dict[str, bytes], dict[str, str]] | None = None
        """What later saves write directly (:meth:`_save_hf`), once the first showed it is what transformers
        writes: the files other than the weights (their bytes) and the weights file's metadata."""
        self._saved_once = False
        self._tokenizer_bytes: dict[str, bytes] | None = None

    @property
    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def _to_device(self, host: Any) -> Any:
        """A host tensor on the trainer's device without a stream sync (copies from pinned memory are
        asynchronous; from pageable memory CUDA first waits for the queued work)."""
        if not self.config.device.startswith("cuda"):
            return host
        return host.pin_memory().to(self.config.device, non_blocking=True)

    def _logprobs_N(
        self, rows: Sequence[Sequence[Datum]], with_entropy: bool = False, start: int = 0
    ) -> tuple[Any, Any | None]:
        """Learner logprobs of each datum's target tokens from position ``start`` on, flattened (N: those
        positions, row after row, datum after datum), and optionally their entropies (N).

        The rows go through the model as one (R, W) batch: a row's datums end to end, position ids restarting at
        0 for each (transformers then keeps attention within each datum: a block-diagonal causal mask, or
        variable-length kernels where the attention implementation has them), a row's tail padded (padding comes
        after every real token of its row: causal attention hides it). Only the N kept positions reach the output
        layer (:class:`_KeptPositions`).
        """
        import torch

        width = max(sum(len(d.input_tokens) for d in row) for row in rows)
        tokens: list[int] = []
        positions: list[int] = []
        kept: list[int] = []
        for r, row in enumerate(rows):
            offset = 0
            for datum in row:
                n = len(datum.input_tokens)
                tokens += datum.input_tokens
                positions += range(n)
                kept += range(r * width + offset + start, r * width + offset + n)
                offset += n
            tokens += [0] * (width - offset)
            positions += range(positions[-1] + 1, positions[-1] + 1 + width - offset)  # the last datum's, going on
        host = (
            torch.tensor(tokens).view(len(rows), width),
            torch.tensor(positions).view(len(rows), width),
            torch.tensor(kept),
            torch.tensor([t for row in rows for d in row for t in d.target_tokens[start:]]),
        )
        tokens_RW, positions_RW, kept_N, targets_N = (self._to_device(t) for t in host)
        logits_NV = self._kept.logits(self.model, tokens_RW, positions_RW, kept_N)
        return target_logprobs().apply(logits_NV, targets_N, with_entropy)

    def logprobs(self, datums: Sequence[Datum]) -> list[list[float]]:
        """Per-token learner logprobs of each datum (no gradient)."""
        import torch

        out: list[list[float]] = [[] for _ in datums]
        lengths = [len(d.input_tokens) for d in datums]
        batches = micro_batches(lengths, self.config.micro_batch_tokens, self.config.packed)
        missing = self._missing_passes(len(batches))  # before any pass: every rank agrees on the count first
        with torch.no_grad():
            for batch in batches:
                logprobs_N, _ = self._logprobs_N([[datums[i] for i in row] for row in batch])
                flat, start = logprobs_N.tolist(), 0
                for i in (i for row in batch for i in row):
                    out[i] = flat[start : start + lengths[i]]
                    start += lengths[i]
            for _ in range(missing):
                self._logprobs_N([[_IDLE]])
        return out

    def _missing_passes(self, passes: int) -> int:
        """Sharded, every rank runs as many forward passes as the busiest (each pass gathers every layer's weights
        from all ranks): how many empty ones this rank adds. 0 unsharded."""
        if not self.sharded:
            return 0
        import torch
        import torch.distributed as dist

        most = torch.tensor([passes], device=self.config.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most) - passes

    def _all_ranks(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (sharded: a collective; each rank sees only its shards)."""
        if not self.sharded:
            return ok
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if ok else 0], device=self.config.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag)

    def forward_backward(
        self, datums: Sequence[Datum], loss_fn: str, loss_config: dict[str, float]
    ) -> dict[str, float]:
        """Accumulates the gradient of the summed loss over ``datums``; returns metrics.

        Raises:
            InvalidArgumentError: NON_FINITE when the loss or a gradient of this call is NaN or infinite: the
                call's gradients are discarded and those accumulated before it are kept as they were.
        """
        if not datums:
            raise invalid_field("items", "the batch is empty")
        totals = self.forward_backward_totals(datums, loss_fn, loss_config)
        self.end_call(totals)
        self.num_pending_datums += len(datums)
        return metrics_from_totals(totals)

    def _trainable(self) -> list[Any]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def end_call(self, totals: dict[str, float]) -> None:
        """Adds this call's gradients to those accumulated before it, or, when ``totals`` say the call was not
        finite (on any rank), discards them and raises NON_FINITE."""
        finite = not totals.get("nonfinite")
        self._settle(keep=finite)
        if not finite:
            raise InvalidArgumentError(
                "the loss or a gradient of this batch is NaN or infinite, or adding it would make the accumulated "
                "gradient's norm overflow (e.g. sampling logprobs far below the learner's, or huge advantages or "
                "weights): nothing was accumulated, earlier gradients are kept",
                reason="NON_FINITE",
                field="items",
            )

    def _merge(self) -> bool:
        """Adds the stashed earlier gradients into this call's (in place: the earlier tensors stay as they were,
        so :meth:`_settle` can still put them back); returns whether the sum and its norm are finite, the test
        every later optimizer step applies."""
        import torch

        grads = []
        for param, before in zip(self._trainable(), self._stash or (), strict=True):
            if before is not None:
                param.grad = before if param.grad is None else param.grad.add_(before)
            if param.grad is not None:
                grads.append(param.grad)
        return not grads or math.isfinite(float(torch.nn.utils.get_total_norm(grads)))

    def _settle(self, keep: bool) -> None:
        """Keeps the merged gradients (``keep``), or puts the earlier ones back."""
        stash, self._stash = self._stash, None
        for param, before in zip(self._trainable(), stash, strict=True) if stash is not None and not keep else ():
            param.grad = before

    def forward_backward_totals(
        self, datums: Sequence[Datum], loss_fn: str, loss_config: dict[str, float]
    ) -> dict[str, float]:
        """Computes this call's gradients apart from the accumulated ones; returns additive totals (so shards on
        several ranks can be summed), with ``nonfinite`` > 0 when a loss or gradient was not finite. Follow with
        :meth:`end_call` on the summed totals (every rank), which keeps or discards them."""
        spec, knobs = losses.resolve(loss_fn, loss_config)
        self._stash = [p.grad for p in self._trainable()]
        for param in self._trainable():
            param.grad = None
        try:
            totals = self._accumulate(datums, spec, knobs)
            if not totals["nonfinite"] and not self._merge():
                totals["nonfinite"] = 1.0
            return totals
        except BaseException:
            self._settle(keep=False)  # the earlier gradients as they were; the error itself goes up
            raise

    def _accumulate(self, datums: Sequence[Datum], spec: losses.LossSpec, knobs: dict[str, float]) -> dict[str, float]:
        """Forward/backward over the micro-batches with every total kept on the device: the host queues work
        and waits once, at the end (a non-finite loss shows in the totals and the gradients)."""
        import torch

        sums = torch.zeros(len(_DEVICE_TOTALS), dtype=torch.float64, device=self.config.device)
        # Only action tokens count: every loss, and its gradient, is 0 on the others (losses.py). A datum without
        # one is not computed at all (e.g. a group without reward spread), and a micro-batch's logits start at
        # its first action token (not over the prompts).
        first = {id(d): next((t for t, v in enumerate(getattr(d, spec.acts_on)) if v != 0), -1) for d in datums}
        active = [d for d in datums if first[id(d)] >= 0]
        lengths = [len(d.input_tokens) for d in active]
        useful, computed = sum(lengths), 0
        batches = micro_batches(lengths, self.config.micro_batch_tokens, self.config.packed)
        for _ in range(self._missing_passes(len(batches))):  # sharded: an empty pass (its gradient 0) per missing one
            lp_N, _ = self._logprobs_N([[_IDLE]])
            (lp_N.sum() * 0).backward()
        for batch in batches:
            computed += computed_tokens(batch, lengths)
            rows = [[active[i] for i in row] for row in batch]
            start = min(first[id(d)] for row in rows for d in row)
            lp_N, entropy_N = self._logprobs_N(rows, with_entropy=True, start=start)

            def flat(name: str) -> Any:
                values = [v for row in rows for d in row for v in getattr(d, name)[start:]]
                return self._to_device(torch.tensor(values, dtype=lp_N.dtype))

            q_N, A_N, w_N = flat("sampling_logprobs"), flat("advantages"), flat("weights")
            loss = spec.fn(lp_N, q_N, A_N, w_N, **knobs)
            loss.backward()
            with torch.no_grad():
                action_N = (w_N if spec.acts_on == "weights" else A_N) != 0
                ratio_N = (lp_N - q_N).exp()

                def over_actions(values_N: Any) -> Any:
                    return torch.where(action_N, values_N, 0).sum()

                parts = [
                    loss.detach().reshape(()),
                    action_N.sum(),
                    over_actions(ratio_N),
                    over_actions(q_N - lp_N),
                    over_actions(entropy_N),
                ]
                if spec.clipped_by is not None:
                    low, high = spec.clipped_by
                    outside = (ratio_N < knobs[low]) | (ratio_N > knobs[high])
                    parts.append((outside & action_N).sum())
                sums[: len(parts)] += torch.stack([p.to(torch.float64) for p in parts])
        finite = all_finite([sums[:1]])  # the loss; the gradients are checked merged (_merge)
        totals = zero_totals()
        totals.update(zip(_DEVICE_TOTALS, sums.tolist(), strict=True))
        totals["nonfinite"] = 0.0 if finite else 1.0
        totals["tokens_useful"], totals["tokens_computed"] = float(useful), float(computed)
        return totals

    def optim_step(self, adam: AdamConfig, revocable: bool = False) -> float:
        """Applies the accumulated gradients; returns the global grad norm (before clipping). A ``revocable``
        step stays open until :meth:`finish_step` keeps or reverts it (a commit that may fail)."""
        adam.validate()
        if self.num_pending_datums == 0:
            raise FailedPreconditionError("no gradients accumulated since the last step", reason="NO_GRADIENTS")
        grad_norm = self.apply_step(adam, keep=revocable)
        if not revocable:
            self.finish_step(committed=True)
        return grad_norm

    def apply_step(self, adam: AdamConfig, keep: bool = True) -> float:
        """The AdamW step itself (no precondition checks; data-parallel ranks call it in lockstep).

        Refused with FAILED_PRECONDITION/NON_FINITE, nothing changed, when the gradient norm is not finite. With
        ``keep``, what the step replaced (weights, gradients, optimizer state, step: a host copy) is kept until
        :meth:`finish_step` commits or reverts it, and a step whose updated weights are not finite is reverted.
        Without (steps that commit nothing: no copy, no cost), such a step marks the trainer ``spoiled``: its
        owner reloads the last checkpoint (with finite gradients and checked hyperparameters AdamW cannot
        produce one short of overflow: the check is a last line).
        """
        import torch

        params = [p for p in self._trainable() if p.grad is not None]
        grad_norm = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
        if not math.isfinite(grad_norm):
            raise FailedPreconditionError(
                "the accumulated gradient's norm is NaN or infinite: the step was not applied (the gradients are "
                "kept: DiscardGradients, `yieldloop models discard-gradients MODEL`, drops them)",
                reason="NON_FINITE",
            )
        self._before_step = self._snapshot() if keep else None
        if adam.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, adam.max_grad_norm, torch.tensor(grad_norm))
        for group in self.optimizer.param_groups:
            group.update(
                lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps, weight_decay=adam.weight_decay
            )
        self.optimizer.step()
        self.step += 1
        if not self._all_ranks(all_finite([sharding.local(p) for p in params])):
            if self._before_step is None:
                self.spoiled = True
                raise FailedPreconditionError(
                    "the step made weights NaN or infinite: the trainer goes back to the model's last checkpoint "
                    "(steps and gradients since it are lost)",
                    reason="NON_FINITE",
                )
            self.finish_step(committed=False)
            raise FailedPreconditionError(
                "the step made weights NaN or infinite: it was reverted (weights, optimizer state and gradients "
                "are as before it)",
                reason="NON_FINITE",
            )
        return grad_norm

    def finish_step(self, committed: bool) -> None:
        """Ends the last :meth:`apply_step`: committed, its gradients are cleared; otherwise the trainer goes back
        to exactly the state before it (weights, optimizer state, step and the accumulated gradients)."""
        before, self._before_step = self._before_step, None
        if committed:
            self.drop_gradients()
            return
        if before is None:
            return
        weights, grads, optimizer_state, step = before
        for param, weight, grad in zip(self._trainable(), weights, grads, strict=True):
            sharding.local(param.data).copy_(weight)
            param.grad = None if grad is None else sharding.like(param, grad)
        self.optimizer.load_state_dict(optimizer_state)
        self.step = step

    def drop_gradients(self) -> None:
        """Forgets the accumulated gradients."""
        self.optimizer.zero_grad(set_to_none=True)
        self.num_pending_datums = 0

    def _snapshot(self) -> tuple[list[Any], list[Any], dict, int]:
        """Host copies of the trainable weights, their gradients and the optimizer state (3-4x the trainable
        parameters' bytes while a step is open: small for LoRA, large for full fine-tuning)."""
        import torch

        def host(t: Any) -> Any:  # sharded: this rank's shard
            return sharding.local(t).detach().to("cpu", copy=True) if torch.is_tensor(t) else t

        def host_state(t: Any) -> Any:  # kept sharded: the optimizer loads its moments as it holds them
            return t.detach().to("cpu", copy=True) if torch.is_tensor(t) else t

        params = self._trainable()
        state = self.optimizer.state_dict()
        state = {
            "state": {k: {n: host_state(v) for n, v in s.items()} for k, s in state["state"].items()},
            "param_groups": [dict(g) for g in state["param_groups"]],
        }
        return ([host(p) for p in params], [None if p.grad is None else host(p.grad) for p in params], state, self.step)

    def close(self) -> None:
        """Nothing to release beyond the objects themselves (a :class:`ModelTrainer` method: ranks have more)."""

    def save(self, folder: pathlib.Path, with_state: bool = True) -> pathlib.Path:
        """Writes the sampler weights: an HF checkpoint (safetensors, config, tokenizer), or for a LoRA fork
        peft's adapter files only; ``with_state``, also the training state (:meth:`save_state`). Sharded, every
        rank calls it with the same folder: each tensor is gathered in turn and rank 0 writes the sampler files,
        every rank its shards of the training state."""
        if self.sharded:
            return self._save_sharded(folder, with_state)
        folder.mkdir(parents=True, exist_ok=True)
        if self.adapter is None:
            self._save_hf(folder)
        else:
            self.model.save_pretrained(folder, safe_serialization=True)
            (folder / "README.md").unlink(missing_ok=True)  # peft's model card: not part of the checkpoint
        if with_state:
            self.save_state(folder)
        return folder

    def _save_hf(self, folder: pathlib.Path) -> None:
        """The model as ``save_pretrained`` writes it, and its tokenizer. When the first save, by transformers,
        wrote one weights file holding exactly the model's own weights (their names, shapes and dtypes: no
        conversion on the way), later saves write the same files directly: the others' bytes as first written
        (the config and tokenizer never change while training), the weights with safetensors, as transformers
        does, without its bookkeeping around it (~4 ms a save on a small model: each step's). The tokenizer's
        files are always those the model was loaded with (:meth:`_write_tokenizer`)."""
        from safetensors.torch import save_file

        if self._direct_save is not None:
            files, metadata = self._direct_save
            for name, data in files.items():
                (folder / name).write_bytes(data)
            weights = {name: sharding.full(tensor) for name, tensor in sharding.unique_weights(self.model)}
            save_file(weights, folder / WEIGHTS_FILE, metadata=metadata)
            return
        self.model.save_pretrained(folder, safe_serialization=True)
        self._write_tokenizer(folder)
        if not self._saved_once:
            self._saved_once = True
            self._direct_save = _direct_save_of(self.model, folder)

    def _write_tokenizer(self, folder: pathlib.Path) -> None:
        """The tokenizer's files (those ``save_pretrained`` writes) as the folder the model was loaded from holds
        them, byte for byte (transformers writes them back in its own words: a checkpoint would hold another
        tokenizer file than its parent's, stored again and read again by every engine, which reloads in full
        instead of only the weights); a file that folder lacks as transformers writes it."""
        if self._tokenizer_bytes is None:
            with tempfile.TemporaryDirectory() as scratch:
                written = [pathlib.Path(p) for p in self.tokenizer.save_pretrained(scratch)]
                self._tokenizer_bytes = {
                    path.name: (self.source / path.name if (self.source / path.name).is_file() else path).read_bytes()
                    for path in written
                    if path.is_file()
                }
        for name, data in self._tokenizer_bytes.items():
            (folder / name).write_bytes(data)

    def _save_sharded(self, folder: pathlib.Path, with_state: bool) -> pathlib.Path:
        folder.mkdir(parents=True, exist_ok=True)
        self._write_sampler_files(folder if sharding.writes_files() else None)
        if with_state:
            self.save_state(folder)
        return folder

    def _write_sampler_files(self, folder: pathlib.Path | None) -> None:
        """Sharded: the sampler files, each tensor gathered in turn; ``folder`` None on the ranks that only
        join the gathers."""
        if self.adapter is None:
            sharding.write_safetensors(sharding.unique_weights(self.model), folder)
            if folder is not None:
                self.model.config.save_pretrained(folder)
                if getattr(self.model, "generation_config", None) is not None and self.model.can_generate():
                    self.model.generation_config.save_pretrained(folder)
                self._write_tokenizer(folder)
        else:  # the adapter is small: gathered whole, written by peft as the unsharded trainer's is
            from peft import get_peft_model_state_dict

            whole = {name: sharding.full(t) for name, t in self.model.state_dict().items() if "lora_" in name}
            if folder is not None:
                self.model.save_pretrained(folder, state_dict=get_peft_model_state_dict(self.model, state_dict=whole))
                (folder / "README.md").unlink(missing_ok=True)

    def save_state(self, folder: pathlib.Path) -> pathlib.Path:
        """Writes the training state (:data:`STATE_FILES`: optimizer moments and step) into ``folder``."""
        import torch

        folder.mkdir(parents=True, exist_ok=True)
        if self.sharded:  # every rank its shards; the step once, by rank 0 (not every rank into one file)
            sharding.save_optimizer(self.model, self.optimizer, folder)
            if not sharding.writes_files():
                return folder
        else:
            torch.save(self.optimizer.state_dict(), folder / OPTIMIZER_FILE)
        (folder / STATE_FILE).write_text(json.dumps({"step": self.step}))
        return folder


def metrics_from_totals(totals: dict[str, float]) -> dict[str, float]:
    """Per-call metrics from the additive totals of :meth:`Trainer.forward_backward_totals`."""
    num_action = max(totals["num_action_tokens"], 1.0)
    return {
        "loss_sum": totals["loss_sum"],
        "num_action_tokens": totals["num_action_tokens"],
        "mean_ratio": totals["ratio_sum"] / num_action,
        "kl_sampler_learner": totals["kl_sum"] / num_action,
        "clip_fraction": totals["clipped"] / num_action,
        "entropy": totals["entropy_sum"] / num_action,
        "tokens_useful": totals["tokens_useful"],
        "tokens_computed": totals["tokens_computed"],
    }


_DEVICE_TOTALS = ("loss_sum", "num_action_tokens", "ratio_sum", "kl_sum", "entropy_sum", "clipped")
"""The totals :meth:`Trainer._accumulate` sums on the device, in order."""


def zero_totals() -> dict[str, float]:
    return dict.fromkeys((*_DEVICE_TOTALS, "nonfinite", "tokens_useful", "tokens_computed"), 0.0)


WEIGHTS_FILE = "model.safetensors"
_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64"}


def _direct_save_of(model: Any, folder: pathlib.Path) -> tuple[dict[str, bytes], dict[str, str]] | None:
    """What :meth:`Trainer._save_hf` may write directly after ``save_pretrained`` wrote ``folder``: the other
    files' bytes and the weights' metadata, when its only weights file holds the model's unique weights under
    their own names, shapes and dtypes; None when transformers wrote anything else (shards, converted names)."""
    from safetensors import safe_open

    written = sorted(p.name for p in folder.iterdir() if ".safetensors" in p.name)
    if written != [WEIGHTS_FILE]:
        return None
    own = dict(sharding.unique_weights(model))
    with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as weights:
        if set(weights.keys()) != set(own):
            return None
        for name, tensor in own.items():
            stored = weights.get_slice(name)
            dtype = _SAFETENSORS_DTYPES.get(str(tensor.dtype).removeprefix("torch."))
            if list(stored.get_shape()) != list(tensor.shape) or stored.get_dtype() != dtype:
                return None
        metadata = weights.metadata() or {}
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != WEIGHTS_FILE}
    return files, metadata


def all_finite(tensors: Sequence[Any]) -> bool:
    """Whether every element of every tensor is finite: one device sync, not one per tensor."""
    import torch

    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all()) if tensors else True


@functools.cache
def target_logprobs() -> Any:
    """The autograd function ``apply(logits_NV, targets_N, with_entropy) -> (logprobs_N, entropy_N or None)``
    (defined on first use: torch is imported only by the processes that need it)."""
    import torch

    class _TargetLogprobs(torch.autograd.Function):
        """Logprobs (N,) of target tokens under logits (N, V), and optionally the entropies (N,), computed a
        chunk of rows at a time in float32 (float64 logits stay float64): neither pass materialises an fp32
        (N, V) tensor, and backward recomputes the softmax from the logits instead of keeping it (fused
        kernels that cast as they read: about as many bytes moved as a plain log_softmax, a fraction of its
        memory)."""

        @staticmethod
        def forward(ctx: Any, logits_NV: Any, targets_N: Any, with_entropy: bool) -> tuple[Any, Any]:
            dtype = torch.promote_types(logits_NV.dtype, torch.float32)
            rows = _chunk_rows(logits_NV.shape[-1])
            logprobs_N = torch.empty(logits_NV.shape[0], dtype=dtype, device=logits_NV.device)
            entropy_N = torch.empty_like(logprobs_N) if with_entropy else None
            for s in range(0, logits_NV.shape[0], rows):
                logp = torch.log_softmax(logits_NV[s : s + rows], dim=-1, dtype=dtype)  # one pass, cast inside
                logprobs_N[s : s + rows] = logp.gather(-1, targets_N[s : s + rows, None])[:, 0]
                if entropy_N is not None:
                    entropy_N[s : s + rows] = -torch.linalg.vecdot(logp.exp(), logp)
            ctx.save_for_backward(logits_NV, targets_N)
            if entropy_N is not None:
                ctx.mark_non_differentiable(entropy_N)
            return logprobs_N, entropy_N

        @staticmethod
        def backward(ctx: Any, grad_N: Any, _grad_entropy: Any) -> tuple[Any, None, None]:
            logits_NV, targets_N = ctx.saved_tensors
            grad_NV = torch.empty_like(logits_NV)
            rows = _chunk_rows(logits_NV.shape[-1])
            for s in range(0, logits_NV.shape[0], rows):
                g = grad_N[s : s + rows, None]
                # d logprob[t] / d logit[v] = 1[v == t] - softmax[v]
                probs = torch.softmax(logits_NV[s : s + rows], dim=-1, dtype=grad_N.dtype).mul_(-g)
                grad_NV[s : s + rows] = probs.scatter_add_(-1, targets_N[s : s + rows, None], g)
            return grad_NV, None, None

    return _TargetLogprobs


class _KeptPositions:
    """Makes the model's output layer compute the logits of chosen positions only: a pre-hook on it replaces its
    input (R, W, H) by the rows picked from the flattened positions (1, N, H), so no logits are computed for
    prompts, padding or anything else no loss reads (and peft, torch.compile and FSDP see the model's own
    forward). A model without an output layer to hook computes every position's logits, then picks."""

    def __init__(self, model: Any) -> None:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.hooked = head is not None
        self._index: Any = None
        if head is not None:
            head.register_forward_pre_hook(self._pick)

    def _pick(self, _module: Any, args: tuple) -> tuple | None:
        if self._index is None:
            return None
        hidden = args[0]
        return (hidden.reshape(-1, hidden.shape[-1]).index_select(0, self._index)[None], *args[1:])

    def logits(self, model: Any, tokens_RW: Any, positions_RW: Any, kept_N: Any) -> Any:
        """The logits (N, V) of the flat positions ``kept_N`` of the batch."""
        if not self.hooked:
            logits = model(input_ids=tokens_RW, position_ids=positions_RW, use_cache=False).logits
            return logits.flatten(0, 1).index_select(0, kept_N)
        self._index = kept_N
        try:
            return model(input_ids=tokens_RW, position_ids=positions_RW, use_cache=False).logits[0]
        finally:
            self._index = None


def _chunk_rows(vocab_size: int) -> int:
    """Rows per chunk: about 256M float32 elements (1 GB) at a time."""
    return max(1, (1 << 28) // max(vocab_size, 1))


_IDLE = Datum(input_tokens=[0], target_tokens=[0], sampling_logprobs=[0.0], advantages=[0.0], weights=[0.0])
"""The one-token datum of a sharded rank's empty pass (its loss is multiplied by 0)."""
