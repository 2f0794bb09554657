"""``yieldloop plan MODEL``: the memory arithmetic of each plane for a model, and the smallest layout that fits.

Reads a model's ``config.json`` (a local folder or file, a hub id in the local Hugging Face cache, or a model in
the store) and works out, per GPU:

- **trainer**: weights, gradients, AdamW moments, activations and transient buffers for the one-process trainer
  (bf16 weights, gradients and moments, every activation kept) and for FSDP over N >= 2 GPUs (``--trainer-shard
  fsdp``: the same bf16 tensors sharded, gradients reduced in fp32, activation checkpointing per layer), or a
  LoRA adapter over frozen bf16 weights. The layout chosen is the one with the fewest GPUs.
- **rollout**: bf16 weights and KV cache per GPU at each tensor-parallel degree; the degree chosen is the
  smallest whose KV cache holds ``concurrency`` sequences at half ``seq_len`` on average with 25% headroom
  (vLLM preempts sequences when its cache is full), and one server per ``4 x concurrency`` environments (an
  agent's episode spends most of its time in its tools, not in a generation).
- **environments**: CPU instances at 128-256 environments each.

The figures are estimates written out term by term (``--json`` prints them all); the weights, gradient and
optimizer terms are exact byte counts of the trainer's tensors (tests check them against a trainer's own).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any

GIB = 1024**3
GPUS_GIB = {"h100": 81559 / 1024, "h200": 143771 / 1024}
"""Memory of each GPU model as nvidia-smi reports it (MiB / 1024)."""
GPUS_PER_NODE = 8
RESERVE_GIB = 2.0
"""Per trainer GPU: CUDA context, communication buffers, allocator fragmentation."""
ROLLOUT_OVERHEAD_GIB = 4.0
"""Per rollout GPU: vLLM's activation peak and CUDA graphs."""
KV_HEADROOM = 1.25
ENVS_PER_INSTANCE = (128, 256)
"""Environments one CPU instance runs (the sizing guide's range)."""
LOGITS_CHUNK_BYTES = 1 << 30
"""The trainer's fp32 logprob chunk (``trainer._chunk_rows``: 256M floats)."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the arithmetic needs of a decoder-only transformer's ``config.json``."""

    architecture: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool
    max_positions: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Shape:
        text = config.get("text_config", config)  # multimodal configs nest the language model's
        hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
        return cls(
            architecture=(config.get("architectures") or [config.get("model_type", "?")])[0],
            hidden=hidden,
            layers=int(text["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            intermediate=int(text["intermediate_size"]),
            vocab=int(text["vocab_size"]),
            tied=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            qkv_bias=text.get("model_type", config.get("model_type")) in ("qwen2",) or bool(text.get("attention_bias")),
            max_positions=int(text.get("max_position_embeddings", 0)),
        )

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_parameters(self) -> int:
        h = self.hidden
        attention = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        bias = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        return attention + bias + 3 * h * self.intermediate + 2 * h

    @property
    def embedding_parameters(self) -> int:
        return self.vocab * self.hidden

    @property
    def parameters(self) -> int:
        head = 0 if self.tied else self.embedding_parameters
        return self.layers * self.layer_parameters + self.embedding_parameters + head + self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 keys and values of one token over every layer."""
        return 2 * self.layers * self.kv_dim * 2

    def lora_parameters(self, rank: int) -> int:
        """A LoRA adapter of ``rank`` on every attention and MLP projection (peft's ``all-linear``)."""
        h, i = self.hidden, self.intermediate
        per_layer = rank * ((h + self.q_dim) * 2 + 2 * (h + self.kv_dim) + 2 * (h + i) + (i + h))
        return self.layers * per_layer


def load_config(source: str, store_url: str = "") -> tuple[dict[str, Any], str]:
    """A model's config.json and where it came from: a file, a folder, a hub id in the local cache, or a model
    slug in the store at ``store_url`` (its HEAD checkpoint; a LoRA fork: its base's, with its rank)."""
    from yieldloop.errors import NotFoundError
    from yieldloop_server.checkpoint.importer import resolve_source

    path = pathlib.Path(source).expanduser()
    if path.is_file():
        return json.loads(path.read_text()), str(path)
    folder = resolve_source(source)
    if folder is not None and (folder / "config.json").is_file():
        return json.loads((folder / "config.json").read_text()), str(folder)
    if store_url:
        found = _config_in_store(source, store_url)
        if found is not None:
            return found
    raise NotFoundError(
        f"no config.json for {source!r}: give a folder or config.json file, a hub id already in the local Hugging "
        f"Face cache, or a model in the store (--store, or --data-dir of a `yieldloop up`)",
        reason="MODEL_NOT_FOUND",
    )


def _config_in_store(slug: str, store_url: str) -> tuple[dict[str, Any], str] | None:
    from yieldloop_server.checkpoint.registry import CheckpointRegistry
    from yieldloop_server.store import open_store

    registry = CheckpointRegistry(open_store(store_url))
    head = registry.find_head(slug) if slug in {m.slug for m in registry.list_models()} else None
    if head is None:
        return None
    manifest = registry.get_manifest(slug, head.checkpoint_id)
    files = {obj.name: obj.key for obj in manifest.objects}
    if "config.json" in files:
        data, _ = registry.store.get_bytes(files["config.json"])
        return json.loads(data), f"{slug}@{head.checkpoint_id}"
    if "adapter_config.json" in files:  # a LoRA fork: its base's shape, its own rank
        data, _ = registry.store.get_bytes(files["adapter_config.json"])
        base = registry.get_model(slug).base
        found = _config_in_store(base, store_url)
        if found is not None:
            config, where = found
            return {**config, "_lora_rank": int(json.loads(data).get("r", 0))}, f"{slug} (LoRA over {where})"
    return None


@dataclasses.dataclass(frozen=True)
class Inputs:
    gpu_gib: float
    gpu: str
    seq_len: int = 8192
    micro_batch_tokens: int = 0
    """Tokens per micro-batch on each rank (0: seq_len)."""
    group: int = 8
    envs: int = 2048
    lora_rank: int = 0
    concurrency: int = 256
    """Sequences a rollout server runs at once (vLLM's max_num_seqs default)."""
    gpu_memory_utilization: float = 0.85
    trainer_dtype_bytes: int = 2
    """Bytes per value of the trainer's weights, gradients and moments (bf16 on a GPU; 4 on CPU)."""

    def validate(self) -> Inputs:
        """INVALID_ARGUMENT naming the flag of any value out of range."""
        from yieldloop.errors import invalid_field

        for name in ("seq_len", "group", "envs", "concurrency"):
            if getattr(self, name) < 1:
                raise invalid_field(name, f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("micro_batch_tokens", "lora_rank"):
            if getattr(self, name) < 0:
                raise invalid_field(name, f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise invalid_field(
                "gpu_memory_utilization",
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}",
            )
        return self


def gpu_gib(name: str) -> float:
    """h100, h200, or a number of GiB."""
    if name.lower() in GPUS_GIB:
        return GPUS_GIB[name.lower()]
    try:
        value = float(name)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        from yieldloop.errors import invalid_field

        raise invalid_field("gpu", f"--gpu takes h100, h200 or a number of GiB, got {name!r}")
    return value


def trainer_layout(shape: Shape, inputs: Inputs, gpus: int, shard: str) -> dict[str, Any]:
    """Per-GPU memory (GiB) of one trainer layout: ``shard`` "none" (one process, every activation kept) or
    "fsdp" (weights, gradients and moments sharded over ``gpus``, activation checkpointing per layer), the
    trainer's dtype throughout (bf16 on a GPU), a LoRA adapter's moments in fp32."""
    p, h, t = shape.parameters, shape.hidden, inputs.micro_batch_tokens or inputs.seq_len
    lora = inputs.lora_rank > 0
    trained = shape.lora_parameters(inputs.lora_rank) if lora else p
    per_layer_token = (6 * h + 3 * shape.intermediate) * 2  # bf16 activations of one layer, one token
    b = inputs.trainer_dtype_bytes
    weights = p * b / gpus
    gradients, moments = trained * (4 if lora else b) / gpus, trained * (8 if lora else 2 * b) / gpus
    if shard == "none":
        activations = shape.layers * t * per_layer_token
        transient = 0
    else:
        # checkpointed: each layer's input kept, one layer's activations (and their gradients) at a time
        activations = shape.layers * t * h * 2 + t * per_layer_token * 2
        # the largest group unsharded (bf16, the next one prefetched) and its gradients (bf16 + fp32 to reduce)
        largest = max(shape.layer_parameters, shape.embedding_parameters)
        transient = largest * (2 * 2 + (0 if lora else 6)) if gpus > 1 else 0
    logits = t * shape.vocab * 4 + min(LOGITS_CHUNK_BYTES, t * shape.vocab * 4)  # bf16 logits + grad, fp32 chunk
    parts = {
        "weights": weights,
        "gradients": gradients,
        "optimizer": moments,
        "activations": activations + logits,
        "transient": transient,
        "reserve": RESERVE_GIB * GIB,
    }
    total = sum(parts.values())
    return {
        "gpus": gpus,
        "nodes": math.ceil(gpus / GPUS_PER_NODE),
        "shard": shard,
        "per_gpu_gib": {k: round(v / GIB, 2) for k, v in parts.items()} | {"total": round(total / GIB, 2)},
        "per_gpu_bytes": {k: round(v) for k, v in parts.items()},
        "fits": total <= inputs.gpu_gib * GIB,
    }


def plan_trainer(shape: Shape, inputs: Inputs) -> dict[str, Any]:
    layouts = [trainer_layout(shape, inputs, 1, "none")]
    layouts += [trainer_layout(shape, inputs, gpus, "fsdp") for gpus in (2, 4, 8, 16, 32, 64)]
    choice = next((layout for layout in layouts if layout["fits"]), None)  # fewest GPUs first
    return {"choice": choice, "layouts": layouts}


def plan_rollout(shape: Shape, inputs: Inputs) -> dict[str, Any]:
    usable = inputs.gpu_gib * inputs.gpu_memory_utilization * GIB
    need_kv = inputs.concurrency * (inputs.seq_len / 2) * shape.kv_bytes_per_token * KV_HEADROOM
    degrees = []
    tp = 1
    while tp <= 64:
        if shape.heads % tp == 0:
            weights = shape.parameters * 2 / tp
            kv_budget = usable - weights - ROLLOUT_OVERHEAD_GIB * GIB
            kv_split = min(tp, shape.kv_heads)  # past the KV heads, each GPU holds one head (replicated)
            kv_per_gpu_token = shape.kv_bytes_per_token / kv_split
            sequences = int(max(0.0, kv_budget) / (kv_per_gpu_token * inputs.seq_len))
            degrees.append(
                {
                    "tensor_parallel": tp,
                    "per_gpu_gib": {
                        "weights": round(weights / GIB, 2),
                        "kv_cache": round(max(0.0, kv_budget) / GIB, 2),
                        "overhead": ROLLOUT_OVERHEAD_GIB,
                    },
                    "full_length_sequences": sequences,
                    "fits": kv_budget >= need_kv / kv_split,
                }
            )
        tp *= 2
    choice = next((d for d in degrees if d["fits"]), None)
    servers = max(1, math.ceil(inputs.envs / (4 * inputs.concurrency)))
    return {
        "choice": None
        if choice is None
        else choice | {"servers": servers, "gpus": servers * choice["tensor_parallel"]},
        "kv_cache_needed_gib": round(need_kv / GIB, 1),
        "degrees": degrees,
    }


def plan_envs(inputs: Inputs) -> dict[str, Any]:
    low, high = ENVS_PER_INSTANCE
    return {
        "instances": math.ceil(inputs.envs / high),
        "instances_at_most": math.ceil(inputs.envs / low),
        "envs_per_instance": [low, high],
    }


def make_plan(config: dict[str, Any], inputs: Inputs, source: str = "") -> dict[str, Any]:
    shape = Shape.from_config(config)
    if not inputs.lora_rank and config.get("_lora_rank"):
        inputs = dataclasses.replace(inputs, lora_rank=int(config["_lora_rank"]))
    trainer, rollout, envs = plan_trainer(shape, inputs), plan_rollout(shape, inputs), plan_envs(inputs)
    return {
        "model": {
            "source": source,
            "architecture": shape.architecture,
            "parameters": shape.parameters,
            "lora_parameters": shape.lora_parameters(inputs.lora_rank) if inputs.lora_rank else 0,
            "kv_bytes_per_token": shape.kv_bytes_per_token,
        },
        "inputs": dataclasses.asdict(inputs),
        "trainer": trainer,
        "rollout": rollout,
        "environments": envs,
        "commands": commands(trainer["choice"], rollout["choice"], envs, inputs),
    }


def commands(trainer: dict | None, rollout: dict | None, envs: dict, inputs: Inputs) -> dict[str, Any]:
    """The flags and deploy/ overlay values of the chosen layout."""
    out: dict[str, Any] = {}
    if trainer is not None:
        flags = []
        if trainer["shard"] == "fsdp":
            flags += ["--trainer-shard", "fsdp"]
        flags += ["--trainer-micro-batch-tokens", str(inputs.micro_batch_tokens or inputs.seq_len)]
        per_node = min(trainer["gpus"], GPUS_PER_NODE)
        if trainer["nodes"] == 1:
            out["trainer"] = " ".join(["yieldloop serve trainer", f"--nproc {per_node}", *flags])
        else:
            out["trainer"] = " ".join(
                [
                    f"torchrun --nnodes {trainer['nodes']} --nproc-per-node {per_node}",
                    "-m yieldloop.cli serve trainer",
                    *flags,
                ]
            )
    if rollout is not None:
        out["rollout"] = (
            f"yieldloop serve rollout --rollout-engine vllm --rollout-tensor-parallel {rollout['tensor_parallel']} "
            f"--rollout-gpu-memory-utilization {inputs.gpu_memory_utilization} --rollout-max-model-len {inputs.seq_len}"
            f"  (x{rollout['servers']}: the client spreads requests over their addresses)"
        )
    out["deploy"] = {
        "yieldloop-env.replicas": envs["instances"],
        "yieldloop-rollout.replicas": None if rollout is None else rollout["servers"],
        "yieldloop-rollout.nvidia.com/gpu": None if rollout is None else rollout["tensor_parallel"],
        "yieldloop-trainer.replicas (nodes)": None if trainer is None else trainer["nodes"],
        "yieldloop-trainer.nvidia.com/gpu": None if trainer is None else min(trainer["gpus"], GPUS_PER_NODE),
    }
    return out


def render(plan: dict[str, Any]) -> str:
    """The plan as a short text report."""
    model, inputs = plan["model"], plan["inputs"]
    lines = [
        f"{model['architecture']} {model['parameters'] / 1e9:.2f}B parameters ({model['source']})"
        + (
            f", LoRA rank {inputs['lora_rank']}: {model['lora_parameters'] / 1e6:.1f}M trained"
            if inputs["lora_rank"]
            else ""
        ),
        f"GPU {inputs['gpu']} ({inputs['gpu_gib']:.1f} GiB), sequences of {inputs['seq_len']} tokens, "
        f"{inputs['envs']} environments, groups of {inputs['group']}",
        "",
        "trainer (GiB per GPU: weights + gradients + optimizer + activations + transient + reserve = total):",
    ]
    choice = plan["trainer"]["choice"]
    shown = max(8, 2 * choice["gpus"]) if choice else 64
    for layout in plan["trainer"]["layouts"]:
        if layout["gpus"] > shown:
            continue
        g = layout["per_gpu_gib"]
        name = "1 GPU, one process" if layout["shard"] == "none" else f"FSDP x{layout['gpus']}"
        mark = "<- chosen" if layout is choice else ("fits" if layout["fits"] else "")
        lines.append(
            f"  {name:<46} {g['weights']:7.1f} {g['gradients']:7.1f} {g['optimizer']:7.1f} {g['activations']:6.1f} "
            f"{g['transient']:5.1f} {g['reserve']:4.1f} = {g['total']:7.1f}  {mark}"
        )
    rollout = plan["rollout"]
    lines += ["", f"rollout (KV cache needed per server: {rollout['kv_cache_needed_gib']} GiB):"]
    for d in rollout["degrees"][:5]:
        g = d["per_gpu_gib"]
        mark = "<- chosen" if rollout["choice"] and d["tensor_parallel"] == rollout["choice"]["tensor_parallel"] else ""
        lines.append(
            f"  tensor parallel {d['tensor_parallel']:<2}  weights {g['weights']:6.1f}  "
            f"KV cache {g['kv_cache']:6.1f} GiB/GPU"
            f"  ({d['full_length_sequences']} full-length sequences)  {mark}"
        )
    envs = plan["environments"]
    lines += [
        "",
        f"environments: {envs['instances']}-{envs['instances_at_most']} CPU instances "
        f"({envs['envs_per_instance'][0]}-{envs['envs_per_instance'][1]} environments each)",
        "",
        "smallest layout:",
    ]
    t, r = plan["trainer"]["choice"], rollout["choice"]
    lines.append(
        f"  trainer: {t['gpus']} GPU ({t['nodes']} node)" if t else "  trainer: does not fit on 64 GPUs of this size"
    )
    lines.append(
        f"  rollout: {r['servers']} server x {r['tensor_parallel']} GPU = {r['gpus']} GPU" if r else "  rollout: no fit"
    )
    for name in ("trainer", "rollout"):
        if name in plan["commands"]:
            lines.append(f"  $ {plan['commands'][name]}")
    lines.append("  deploy/ overlay: " + ", ".join(f"{k}={v}" for k, v in plan["commands"]["deploy"].items()))
    return "\n".join(lines)
