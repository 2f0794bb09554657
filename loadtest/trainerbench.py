"""Trainer step through TrainerService versus a bare torch loop: same model, batch and loss, same run.

A Qwen2 model is built locally (random weights, ``--hidden``/``--layers``), published as the base checkpoint
of a fresh filesystem store, and trained two ways, alternating step by step:

- ``bare``: forward, the loss, backward and AdamW in plain torch with torch's defaults (what a user's own loop
  does: ``log_softmax`` over the whole vocabulary, ``torch.optim.AdamW()``, the loss from
  ``yieldloop_server.trainer.losses``), with logits from the first action token on, as the service computes
  them (``logits_to_keep``: the prompt's quarter of each datum has advantage 0);
- ``service``: ``ForwardBackward`` (datums streamed over gRPC) + ``OptimStep`` through the real client and a
  TrainerService in this process (its own worker thread), without and with the checkpoint commit.

``--vocab`` widens the vocabulary (e.g. Qwen2.5's 151936: the logits then matter), ``--compile`` compiles both
models with ``torch.compile`` (the trainer's ``compile`` option), ``--variants`` picks which of the three run.

``--nproc N [--shard fsdp]`` instead compares data parallel and the sharded trainer over N ranks (rank 0's bytes
of weights, gradients and AdamW moments after a step; step seconds), one layout after the other.

Usage: ``python loadtest/trainerbench.py [--steps 8] [--batch 32] [--tokens 128] [--device cpu|cuda] [--out r.json]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import random
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from scratch import scratch_dir


def build_model(
    folder: pathlib.Path,
    hidden: int,
    layers: int,
    intermediate: int = 0,
    seed: int = 0,
    vocab: int = 0,
    kv_heads: int = 0,
    context: int = 1024,
) -> pathlib.Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from yieldloop_server.common.tiny_model import TinyModelConfig, train_tokenizer

    tokenizer = train_tokenizer(TinyModelConfig())
    config = Qwen2Config(
        vocab_size=max(vocab, len(tokenizer)),
        hidden_size=hidden,
        intermediate_size=intermediate or hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=kv_heads or max(1, hidden // 256),
        head_dim=64,
        max_position_embeddings=context,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_batch(num_datums: int, num_tokens: int, vocab_size: int, seed: int = 0) -> list:
    from yieldloop.types import Datum

    rng = random.Random(seed)
    datums = []
    for _ in range(num_datums):
        tokens = [rng.randrange(vocab_size) for _ in range(num_tokens + 1)]
        prompt = num_tokens // 4
        datums.append(
            Datum(
                tokens[:-1],
                tokens[1:],
                [-rng.uniform(4, 7) for _ in range(num_tokens)],
                [0.0] * prompt + [rng.uniform(-1, 1) for _ in range(num_tokens - prompt)],
                [0.0] * num_tokens,
            )
        )
    return datums


def first_action(datum) -> int:
    """The position of a datum's first action token (advantage != 0)."""
    return next(t for t, a in enumerate(datum.advantages) if a)


def bare_step(model, optimizer, datums, device: str, per_micro_batch: int) -> float:
    """The same work as the service's step (gradients accumulated over micro-batches of ``per_micro_batch``
    datums), with nothing around it."""
    import torch

    from yieldloop_server.trainer.losses import importance_sampling

    started = time.perf_counter()
    for i in range(0, len(datums), per_micro_batch):
        part = datums[i : i + per_micro_batch]
        # Logits from the first action token on (the prompt's advantages are 0), as the service computes them.
        start = min(first_action(d) for d in part)
        tokens = torch.tensor([d.input_tokens for d in part], device=device)
        targets = torch.tensor([d.target_tokens[start:] for d in part], device=device)
        logits = model(input_ids=tokens, logits_to_keep=tokens.shape[1] - start).logits.float()
        lp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0].flatten()
        q = torch.tensor([v for d in part for v in d.sampling_logprobs[start:]], device=device)
        A = torch.tensor([v for d in part for v in d.advantages[start:]], device=device)
        importance_sampling(lp, q, A, None).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - started


async def bench(args: argparse.Namespace) -> dict:
    import torch

    from yieldloop.client import Client
    from yieldloop_server.checkpoint import server as checkpoint_server
    from yieldloop_server.checkpoint.registry import CheckpointRegistry, Manifest, ModelInfo
    from yieldloop_server.common.hf import load_causal_lm
    from yieldloop_server.store import open_store
    from yieldloop_server.trainer import server as trainer_server
    from yieldloop_server.trainer.trainer import TrainerConfig
    from yieldloop_server.weights.files import upload_folder

    root = scratch_dir("yl-trainerbench-")
    folder = build_model(
        root / "model",
        args.hidden,
        args.layers,
        args.intermediate,
        vocab=args.vocab,
        kv_heads=args.kv_heads,
        context=max(1024, args.tokens),
    )
    store = open_store(str(root / "store"))
    registry = CheckpointRegistry(store)
    registry.create_model(ModelInfo(slug="bench", base="bench"))
    registry.commit(Manifest("bench", "base", upload_folder(store, "bench", "base", folder)), set_head=True)
    checkpoints = checkpoint_server.make_server(store)
    address = await checkpoints.start()
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    micro_batch_tokens = args.micro_batch_tokens or args.batch * args.tokens
    config = TrainerConfig(device=args.device, dtype=dtype, micro_batch_tokens=micro_batch_tokens, compile=args.compile)
    server, servicer = await trainer_server.make_server("bench", store, address, root / "trainer", config)
    client = Client(trainer=await server.start(), checkpoint=address, timeout=600)

    model, _ = load_causal_lm(folder, dtype, args.device)
    model.train()
    if args.compile:
        model.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), eps=1e-8)
    num_params = sum(p.numel() for p in model.parameters())
    datums = make_batch(args.batch, args.tokens, model.config.vocab_size)

    async def service_step(checkpoint: bool) -> float:
        started = time.perf_counter()
        await client.forward_backward(datums=datums, loss_fn="importance_sampling")
        await client.optim_step(1e-5, set_head=checkpoint, skip_checkpoint=not checkpoint)
        return time.perf_counter() - started

    async def bare() -> float:
        return bare_step(model, optimizer, datums, args.device, max(1, micro_batch_tokens // args.tokens))

    variants = {
        "bare": bare,
        "service": lambda: service_step(False),
        "service_with_checkpoint": lambda: service_step(True),
    }
    times: dict[str, list[float]] = {name: [] for name in args.variants}
    for i in range(args.warmup + args.steps):  # interleaved, so machine noise hits all of them alike
        for name in args.variants:
            took = await variants[name]()
            if i >= args.warmup:
                times[name].append(took)
    if args.profile:  # one more service step under the profiler: where the GPU time goes
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            await service_step(False)
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=60))
    await client.close()
    await server.stop(1.0)
    await servicer.close()
    await checkpoints.stop(1.0)

    median = {k: statistics.median(v) for k, v in times.items()}
    tokens = args.batch * args.tokens
    result = {
        "device": args.device,
        "dtype": dtype,
        "params": num_params,
        "batch": args.batch,
        "tokens_per_datum": args.tokens,
        "micro_batch_tokens": micro_batch_tokens,
        "steps": args.steps,
        "median_step_s": {k: round(v, 4) for k, v in median.items()},
        "tokens_per_s": {k: round(tokens / v, 1) for k, v in median.items()},
        "compile": args.compile,
        "vocab": model.config.vocab_size,
    }
    if "bare" in median:
        result.update({f"{k}_vs_bare": round(v / median["bare"], 3) for k, v in median.items() if k != "bare"})
    if args.device.startswith("cuda"):
        # forward + backward, dense matmuls; the output layer (tied to the embedding) computes no logits for each
        # datum's prompt (advantage 0: no loss there; every datum's prompt has the same length)
        head_params = model.config.vocab_size * model.config.hidden_size
        flops = 6 * num_params * tokens - 6 * head_params * sum(first_action(d) for d in datums)
        peak = args.peak_tflops * 1e12
        result["mfu"] = {k: round(flops / v / peak, 3) for k, v in median.items()}
    return result


def run_and_report(bench_fn, args: argparse.Namespace) -> dict:
    """Runs an async benchmark quietly, prints its figures as JSON and writes them to ``args.out``."""
    from yieldloop.cli import quiet_libraries

    quiet_libraries()
    result = asyncio.run(bench_fn(args))
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=0, help="MLP width (default 3 x hidden)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kv-heads", type=int, default=0, help="key/value heads (default hidden / 256)")
    parser.add_argument("--vocab", type=int, default=0, help="vocabulary size (default: the tiny tokenizer's)")
    parser.add_argument("--compile", action="store_true", help="torch.compile both models")
    parser.add_argument("--profile", action="store_true", help="print a torch profile of one more service step")
    parser.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=0,
        help="tokens per forward/backward, both loops (default: the whole batch)",
    )
    parser.add_argument(
        "--variants",
        type=lambda s: s.split(","),
        default=["bare", "service", "service_with_checkpoint"],
        help="comma-separated: bare, service, service_with_checkpoint",
    )
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak for MFU (H100 SXM: 989)")
    parser.add_argument("--nproc", type=int, default=1, help="ranks: compare data parallel with --shard over them")
    parser.add_argument("--shard", default="fsdp", choices=["fsdp"], help="with --nproc N: the sharded layout")
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    run_and_report(ranks_bench if args.nproc > 1 else bench, args)


def rank_state_bytes(trainer) -> dict[str, int]:
    """Bytes this rank holds of the trained weights, their gradients and the AdamW moments (its shards, when
    sharded)."""
    import torch

    from yieldloop_server.trainer.sharding import local

    params = [p for p in trainer.model.parameters()]
    return {
        "weights": sum(local(p).numel() * p.element_size() for p in params),
        "gradients": sum(local(p.grad).numel() * p.grad.element_size() for p in params if p.grad is not None),
        "optimizer": sum(
            local(t).numel() * t.element_size()
            for state in trainer.optimizer.state.values()
            for t in state.values()
            if torch.is_tensor(t) and t.dim() > 0
        ),
    }


async def ranks_bench(args: argparse.Namespace) -> dict:
    """``--nproc N``: data parallel (every rank holds the whole model) against ``--shard`` over the same N ranks,
    one layout after the other: rank 0's bytes of weights + gradients + AdamW moments after a step (taken before
    the next step clears the gradients), and the step's seconds (forward_backward + optimizer step)."""
    from yieldloop_server.trainer.distributed import DistributedTrainer
    from yieldloop_server.trainer.trainer import AdamConfig, TrainerConfig

    root = scratch_dir("yl-trainerbench-")
    folder = build_model(root / "model", args.hidden, args.layers, args.intermediate, vocab=args.vocab)
    budget = args.micro_batch_tokens or args.batch * args.tokens
    layouts = {
        name: TrainerConfig(device=args.device, micro_batch_tokens=budget, shard=name) for name in ("none", args.shard)
    }
    times: dict[str, list[float]] = {name: [] for name in layouts}
    held: dict[str, dict[str, int]] = {}
    for name, config in layouts.items():  # one layout's ranks at a time (one process group per process)
        trainer = DistributedTrainer(folder, config, args.nproc)
        try:
            for i in range(args.warmup + args.steps):
                datums = make_batch(args.batch, args.tokens, trainer.vocab_size, seed=i)
                started = time.perf_counter()
                trainer.forward_backward(datums, "importance_sampling", {})
                trainer.optim_step(AdamConfig(learning_rate=1e-5), revocable=True)  # gradients kept until finish
                took = time.perf_counter() - started
                held[name] = rank_state_bytes(trainer.local)
                trainer.finish_step(True)
                if i >= args.warmup:
                    times[name].append(took)
        finally:
            trainer.close()
    total = {name: sum(parts.values()) for name, parts in held.items()}
    return {
        "nproc": args.nproc,
        "batch": args.batch,
        "tokens_per_datum": args.tokens,
        "rank0_bytes": held,
        "rank0_total_mb": {name: round(v / 2**20, 2) for name, v in total.items()},
        f"{args.shard}_over_data_parallel_memory": round(total[args.shard] / total["none"], 3),
        "median_step_s": {name: round(statistics.median(t), 3) for name, t in times.items()},
        f"{args.shard}_over_data_parallel_step": round(
            statistics.median(times[args.shard]) / statistics.median(times["none"]), 3
        ),
    }


if __name__ == "__main__":
    main()
