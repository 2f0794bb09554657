"""LoRA forks against full weights: serving memory and throughput, checkpoint size, commit -> first token,
and trainer step time. Everything is measured in this run, on one locally built Qwen2 model (random weights,
``--hidden``/``--layers``; default ~25M parameters, 100 MB in fp32).

1. ``serve``: per engine (torch; vLLM when installed), the base alone (an engine holding no adapter) against
   8 LoRA forks (r=8, every linear layer of the blocks, random B) served by one engine of that base (for vLLM
   also its LoRA mode with base requests only), each in a fresh process: resident memory the engine's
   processes added once loaded and while serving, and tokens/s at 64 streams of ``--max-tokens`` tokens each
   (``ignore_eos``, spread evenly over the 8 adapters). 8 full forks would hold 8 copies of the weights.
2. ``commit``: a full fork and a LoRA fork of that model in an in-process stack (torch engine): the checkpoint
   each optimizer step writes (bytes), the step with its commit (``OptimStep``), and commit -> the first token
   sampled by the new weights (the rollout's download, verification and reload, then one token).
3. ``train``: ``Trainer.forward_backward`` + ``optim_step`` on the same batch, full against LoRA (r=8), and
   ``save`` (the checkpoint folder).

Usage: ``python loadtest/lorabench.py [--parts serve,commit,train] [--engines torch,vllm] [--out lorabench.json]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from trainerbench import build_model, make_batch

STREAMS = 64
FORKS = 8


def rss_mb(pid: int | None = None) -> float:
    """Resident memory of a process and all its descendants (vLLM's engine core runs in a child), MB."""
    pid = pid or os.getpid()
    children: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        try:
            for line in pathlib.Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def make_adapters(base: pathlib.Path, out: pathlib.Path, count: int, rank: int = 8) -> list[pathlib.Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folders = []
    for i in range(count):
        torch.manual_seed(i)
        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
            LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0),
        )
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.02)
        model.save_pretrained(out / f"fork-{i}")
        folders.append(out / f"fork-{i}")
    return folders


async def _throughput(engine, prompt: list[int], adapters: list[str], max_tokens: int) -> float:
    from yieldloop_server.rollout.engines import SamplingConfig

    async def one(i: int) -> int:
        sampling = SamplingConfig(max_tokens=max_tokens, temperature=1.0, seed=1000 + i, ignore_eos=True)
        adapter = adapters[i % len(adapters)] if adapters else ""
        return sum([len(d.token_ids) async for d in engine.generate(prompt, sampling, adapter=adapter)])

    best = 0.0
    for _ in range(2):
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(STREAMS))))
        best = max(best, tokens / (time.perf_counter() - start))
    return best


async def serve_one(kind: str, lora: bool, base: pathlib.Path, adapters: list[pathlib.Path], max_tokens: int) -> dict:
    """One configuration, in a fresh process (memory freed by an earlier engine would blur the figures)."""
    from yieldloop_server.rollout.engines import create_engine

    before = rss_mb()
    engine = create_engine(kind, lora=lora)
    try:
        await engine.load_weights(base, "base")
        prompt = engine.render_chat([{"role": "user", "content": "Write the letter a over and over."}])
        for i, folder in enumerate(adapters):
            await engine.load_adapter(f"fork-{i}", folder, f"v{i}")
        names = [f"fork-{i}" for i in range(len(adapters))]
        loaded = rss_mb() - before
        await _throughput(engine, prompt, names, 4)  # warm up
        tok_s = await _throughput(engine, prompt, names, max_tokens)
        serving = rss_mb() - before
    finally:
        await engine.close()
    label = f"{len(names)} LoRA forks, one engine" if names else "LoRA-enabled, base requests" if lora else "base alone"
    return {
        "part": "serve",
        "engine": kind,
        "config": label,
        "streams": STREAMS,
        "max_tokens": max_tokens,
        "tok_s": round(tok_s, 1),
        "rss_loaded_mb": round(loaded, 1),
        "rss_serving_mb": round(serving, 1),
    }


def bench_serve(kind: str, base: pathlib.Path, adapters: list[pathlib.Path], max_tokens: int) -> list[dict]:
    import subprocess

    rows = []
    configs = [(False, []), (True, adapters)]
    if kind == "vllm":  # vLLM's LoRA mode costs something even for requests without an adapter
        configs.insert(1, (True, []))
    for lora, loaded in configs:
        spec = json.dumps(
            {
                "kind": kind,
                "lora": lora,
                "base": str(base),
                "adapters": [str(a) for a in loaded],
                "max_tokens": max_tokens,
            }
        )
        done = subprocess.run([sys.executable, __file__, "--serve-one", spec], capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            raise RuntimeError(f"serve {kind} lora={lora} failed:\n{done.stderr[-3000:]}")
        row = json.loads(lines[-1])
        rows.append(row)
        print(
            f"serve  {kind:5} {row['config']:28} {row['tok_s']:8.1f} tok/s at {STREAMS} streams   RSS of the "
            f"engine loaded {row['rss_loaded_mb']:7.1f} MB, serving {row['rss_serving_mb']:7.1f} MB",
            flush=True,
        )
    return rows


async def bench_commit(base: pathlib.Path, data_dir: pathlib.Path, repeats: int) -> list[dict]:
    from yieldloop.client import Client, sampling_params
    from yieldloop.types import LoraConfig
    from yieldloop_server.config import StackConfig
    from yieldloop_server.stack import InProcessStack

    stack = InProcessStack(StackConfig(data_dir=data_dir, model=str(base)))
    await stack.start()
    rows = []
    try:
        async with Client(**stack.addresses, api_key=stack.api_key, timeout=600) as client:
            slug = stack.config.model
            vocab = json.loads((base / "config.json").read_text())["vocab_size"]
            datums = make_batch(8, 64, vocab)
            for name, lora in (("full", None), ("lora r=8", LoraConfig(8))):
                fork = "bench-" + name.split()[0]
                await client.fork_model(slug, fork, lora=lora)
                step_s, first_token_s, sizes = [], [], []
                for _ in range(repeats + 1):
                    await client.forward_backward(datums=datums, model=fork)
                    start = time.perf_counter()
                    step = await client.optim_step(1e-4, model=fork)
                    committed = time.perf_counter()
                    head = step.checkpoint.checkpoint_id
                    while True:  # the first token sampled by the new weights
                        done = await client.generate([1, 40, 41], model=fork, sampling=sampling_params(max_tokens=1))
                        if done.weight_version == head:
                            break
                    first = time.perf_counter()
                    step_s.append(committed - start)
                    first_token_s.append(first - committed)
                    sizes.append(sum(o.size for o in (await client.get_checkpoint(fork, head)).objects))
                row = {
                    "part": "commit",
                    "kind": name,
                    "checkpoint_bytes": sizes[-1],
                    "optim_step_with_commit_s": round(statistics.median(step_s[1:]), 4),
                    "commit_to_first_token_s": round(statistics.median(first_token_s[1:]), 4),
                }
                rows.append(row)
                print(
                    f"commit {name:9} checkpoint {sizes[-1] / 1e6:8.2f} MB   OptimStep+commit "
                    f"{row['optim_step_with_commit_s']:.3f} s   commit -> first token "
                    f"{row['commit_to_first_token_s']:.3f} s",
                    flush=True,
                )
    finally:
        await stack.stop()
    return rows


def bench_train(base: pathlib.Path, scratch: pathlib.Path, steps: int, batch: int, tokens: int) -> list[dict]:
    import json as _json

    from yieldloop.types import LoraConfig
    from yieldloop_server.common.lora import adapter_config
    from yieldloop_server.trainer.trainer import AdamConfig, AdapterSetup, Trainer

    adapter_dir = scratch / "fresh-adapter"
    adapter_dir.mkdir(parents=True, exist_ok=True)
    (adapter_dir / "adapter_config.json").write_text(_json.dumps(adapter_config(LoraConfig(8))))
    rows = []
    for name, adapter in (("full", None), ("lora r=8", AdapterSetup(adapter_dir, 0))):
        trainer = Trainer(base, adapter=adapter)
        datums = make_batch(batch, tokens, trainer.vocab_size)
        times, save_times = [], []
        for i in range(steps + 1):
            start = time.perf_counter()
            trainer.forward_backward(datums, "importance_sampling", {})
            trainer.optim_step(AdamConfig(1e-4))
            elapsed = time.perf_counter() - start
            start = time.perf_counter()
            trainer.save(scratch / f"{name[:4]}-{i}")
            if i:
                times.append(elapsed)
                save_times.append(time.perf_counter() - start)
        row = {
            "part": "train",
            "kind": name,
            "batch": batch,
            "tokens": tokens,
            "trainable_parameters": trainer.num_trainable_parameters,
            "step_s": round(statistics.median(times), 4),
            "save_s": round(statistics.median(save_times), 4),
        }
        rows.append(row)
        print(
            f"train  {name:9} {row['trainable_parameters']:>12,} trainable   forward_backward+optim_step "
            f"{row['step_s']:.3f} s   save {row['save_s']:.3f} s",
            flush=True,
        )
    return rows


def main() -> None:
    from yieldloop_server.rollout.engines.vllm_engine import vllm_available

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="serve,commit,train")
    parser.add_argument("--engines", default="torch,vllm", help="comma-separated (vllm skipped when not installed)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", type=pathlib.Path, help="write the results as JSON here")
    parser.add_argument("--serve-one", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_one:
        spec = json.loads(args.serve_one)
        row = asyncio.run(
            serve_one(
                spec["kind"],
                spec["lora"],
                pathlib.Path(spec["base"]),
                [pathlib.Path(a) for a in spec["adapters"]],
                spec["max_tokens"],
            )
        )
        print(json.dumps(row), flush=True)
        return
    parts = args.parts.split(",")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        base = build_model(pathlib.Path(tmp) / "model", args.hidden, args.layers)
        print(
            f"model: hidden {args.hidden}, {args.layers} layers, "
            f"{(base / 'model.safetensors').stat().st_size / 1e6:.1f} MB of weights",
            flush=True,
        )
        if "serve" in parts:
            adapters = make_adapters(base, pathlib.Path(tmp) / "adapters", FORKS)
            print(
                f"adapter: {(adapters[0] / 'adapter_model.safetensors').stat().st_size / 1e6:.2f} MB each", flush=True
            )
            for kind in [e for e in args.engines.split(",") if e != "vllm" or vllm_available()]:
                rows += bench_serve(kind, base, adapters, args.max_tokens)
        if "commit" in parts:
            rows += asyncio.run(bench_commit(base, pathlib.Path(tmp) / "stack", args.repeats))
        if "train" in parts:
            rows += bench_train(base, pathlib.Path(tmp) / "train", args.steps, args.batch, args.tokens)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
