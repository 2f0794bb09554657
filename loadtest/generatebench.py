"""Tokens/s through gRPC ``Generate`` versus the same engine called in process, at several concurrencies.

For each engine (torch; vLLM when installed) one engine is loaded, then for
each concurrency C, C streams each generate exactly ``--max-tokens`` tokens
(``ignore_eos``: the warmed-up tiny model would otherwise end its answers after
a few tokens; fixed seeds, identical requests on both paths), first in process, then through
RolloutService's gRPC ``Generate`` served by that same engine on loopback. Every stream has a prompt of its own
(``--group G``: G streams share each prompt, as a GRPO group's episodes do; the torch engine prefills a prompt
that arrives G times together once).
The figure of merit is the ratio grpc / in-process (goal >= 0.9 at 64).

    python loadtest/generatebench.py                       # tiny model made offline, CPU
    python loadtest/generatebench.py --engines torch --device cuda --model-size 0.5b   # a GPU machine

Prints a table; ``--out`` also writes it as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import tempfile
import time


async def _in_process(engine, prompts: list[list[int]], concurrency: int, max_tokens: int, interval_s: float) -> int:
    from yieldloop_server.rollout.engines import SamplingConfig

    async def one(i: int) -> int:
        sampling = SamplingConfig(
            max_tokens=max_tokens, temperature=1.0, seed=1000 + i, ignore_eos=True, stream_interval_s=interval_s
        )
        return sum([len(d.token_ids) async for d in engine.generate(prompts[i], sampling)])

    return sum(await asyncio.gather(*(one(i) for i in range(concurrency))))


async def _grpc(client, prompts: list[list[int]], concurrency: int, max_tokens: int, messages: list[int]) -> int:
    """Tokens streamed; appends each stream's message count to ``messages``."""
    from yieldloop.client import sampling_params

    async def one(i: int) -> int:
        sampling = sampling_params(max_tokens=max_tokens, temperature=1.0, seed=1000 + i, ignore_eos=True)
        tokens = count = 0
        async for delta in client.generate_stream(prompts[i], sampling=sampling):
            tokens, count = tokens + len(delta.token_ids), count + 1
        messages.append(count)
        return tokens

    return sum(await asyncio.gather(*(one(i) for i in range(concurrency))))


async def _timed(coro_factory, repeats: int) -> tuple[float, int]:
    best = 0.0
    tokens = 0
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = await coro_factory()
        best = max(best, tokens / (time.perf_counter() - start))
    return best, tokens


async def bench_engine(
    kind: str,
    folder: pathlib.Path,
    concurrencies: list[int],
    max_tokens: int,
    repeats: int,
    device: str,
    interval_s: float,
    group: int = 1,
) -> list[dict]:
    from yieldloop.client import Client
    from yieldloop_server.rollout.engines import create_engine
    from yieldloop_server.rollout.server import serve_engine
    from yieldloop_server.serve import settle_heap

    engine = create_engine(kind.removesuffix("-process"), device=device, process=kind.endswith("-process"))
    await engine.load_weights(folder, "bench")
    server = await serve_engine("bench", engine, stream_interval_s=interval_s)
    settle_heap()  # this process serves as `yieldloop serve` would (full GC passes of 0.3-0.6 s otherwise)
    client = Client(rollout=server.address, timeout=600)
    # Stream i sends prompt i // group (every stream its own with group 1).
    prompts = [
        engine.render_chat([{"role": "user", "content": f"Write the letter {chr(97 + j % 26)} over and over ({j})."}])
        for j in (i // group for i in range(max(concurrencies)))
    ]
    rows = []
    try:
        await _in_process(engine, prompts, 2, 4, interval_s)  # warm up both paths
        await _grpc(client, prompts, 2, 4, [])
        for concurrency in concurrencies:
            local, local_tokens = await _timed(
                lambda: _in_process(engine, prompts, concurrency, max_tokens, interval_s), repeats
            )
            counts: list[int] = []
            remote, remote_tokens = await _timed(
                lambda: _grpc(client, prompts, concurrency, max_tokens, counts), repeats
            )
            messages = round(sum(counts) / len(counts), 1)
            rows.append(
                {
                    "engine": kind,
                    "device": device,
                    "concurrency": concurrency,
                    "max_tokens": max_tokens,
                    "group": group,
                    "stream_interval_ms": interval_s * 1000,
                    "messages_per_stream": messages,
                    "tokens_in_process": local_tokens,
                    "tokens_grpc": remote_tokens,
                    "in_process_tok_s": round(local, 1),
                    "grpc_tok_s": round(remote, 1),
                    "ratio": round(remote / local, 3),
                }
            )
            print(
                f"{kind:13} C={concurrency:3} G={group}  in-process {local:9.1f} tok/s  gRPC {remote:9.1f} tok/s  "
                f"ratio {remote / local:.3f}  ({messages} messages per stream)",
                flush=True,
            )
    finally:
        await client.close()
        await server.stop(1.0)
        await engine.close()
    return rows


def make_model(size: str, out: pathlib.Path) -> pathlib.Path:
    from yieldloop_server.common.tiny_model import TinyModelConfig, create_tiny_model

    if size == "tiny":
        return create_tiny_model(out)
    # ~0.5B Qwen2-shaped model (random weights, the tiny tokenizer): Qwen2.5-0.5B's body, not warmed up (on CPU
    # that would take minutes; with ignore_eos the answers' length does not depend on it).
    config = TinyModelConfig(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        warmup_steps=0,
    )
    return create_tiny_model(out, config)


def main() -> None:
    from yieldloop.cli import run_async  # uvloop, as `yieldloop serve` runs the service
    from yieldloop_server.config import RolloutOptions
    from yieldloop_server.rollout.engines.vllm_engine import vllm_available

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--engines",
        default="torch,torch-process,vllm",
        help="comma-separated: torch, torch-process (the torch engine in a process of its own), vllm "
        "(skipped when not installed)",
    )
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--group", type=int, default=1, help="streams sharing each prompt (1: a prompt per stream)")
    parser.add_argument("--repeats", type=int, default=2, help="best of N runs per cell")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model-size", default="tiny", choices=("tiny", "0.5b"))
    parser.add_argument(
        "--stream-interval-ms",
        type=float,
        default=RolloutOptions.stream_interval_ms,
        help="the streams' interval on both paths (the rollout service's default; 0: every token)",
    )
    parser.add_argument("--out", type=pathlib.Path, help="write the results as JSON here")
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    engines = [e for e in args.engines.split(",") if e != "vllm" or vllm_available()]
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_model(args.model_size, pathlib.Path(tmp) / "model")
        rows = []
        for kind in engines:
            rows += run_async(
                bench_engine(
                    kind,
                    folder,
                    concurrencies,
                    args.max_tokens,
                    args.repeats,
                    args.device,
                    args.stream_interval_ms / 1000,
                    args.group,
                )
            )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
