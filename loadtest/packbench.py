"""Packed against padded micro-batches on a long-tailed mix of lengths: tokens computed per useful token and
step time, same model and datums, alternating step by step in one run.

Builds a Qwen2 model locally (``--hidden``/``--layers``, random weights), draws ``--batch`` datums whose lengths
follow a log-normal (median ``--median`` tokens, ``--sigma``, clipped to ``--max-len``: most short, a few long,
as agent episodes are) with actions from a quarter of each datum on, and runs the trainer's forward/backward
(``importance_sampling``) + AdamW step with ``packed`` on and off. Reports useful / computed tokens per step and
the median step seconds. (The demo's own batches: ``loopbench.py --variants trainer.pack=true
trainer.pack=false``.)

Usage: ``python loadtest/packbench.py [--batch 64] [--median 192] [--sigma 1.0] [--steps 4] [--out r.json]``
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from scratch import scratch_dir
from trainerbench import build_model


def long_tailed_batch(num: int, median: int, sigma: float, max_len: int, vocab: int, seed: int = 0) -> list:
    from yieldloop.types import Datum

    rng = random.Random(seed)
    datums = []
    for _ in range(num):
        n = max(8, min(max_len, round(math.exp(rng.gauss(math.log(median), sigma)))))
        tokens = [rng.randrange(vocab) for _ in range(n + 1)]
        prompt = n // 4
        advantages = [0.0] * prompt + [rng.uniform(-1, 1) for _ in range(n - prompt)]
        datums.append(Datum(tokens[:-1], tokens[1:], [-rng.uniform(4, 7) for _ in range(n)], advantages, [0.0] * n))
    return datums


def bench(args: argparse.Namespace) -> dict:
    from yieldloop_server.trainer.trainer import AdamConfig, Trainer, TrainerConfig

    folder = build_model(scratch_dir("yl-packbench-") / "model", args.hidden, args.layers, context=args.max_len)
    trainers = {
        name: Trainer(folder, TrainerConfig(micro_batch_tokens=args.micro_batch_tokens, packed=packed))
        for name, packed in (("packed", True), ("padded", False))
    }
    datums = long_tailed_batch(args.batch, args.median, args.sigma, args.max_len, trainers["packed"].vocab_size)
    times: dict[str, list[float]] = {name: [] for name in trainers}
    tokens: dict[str, dict] = {}
    for i in range(args.warmup + args.steps):
        for name, trainer in trainers.items():
            started = time.perf_counter()
            metrics = trainer.forward_backward(datums, "importance_sampling", {})
            trainer.optim_step(AdamConfig(learning_rate=1e-5))
            if i >= args.warmup:
                times[name].append(time.perf_counter() - started)
            tokens[name] = {"useful": metrics["tokens_useful"], "computed": metrics["tokens_computed"]}
    lengths = sorted(len(d.input_tokens) for d in datums)
    median = {name: statistics.median(t) for name, t in times.items()}
    return {
        "model": {"hidden": args.hidden, "layers": args.layers},
        "batch": args.batch,
        "lengths": {"min": lengths[0], "median": lengths[len(lengths) // 2], "max": lengths[-1], "sum": sum(lengths)},
        "micro_batch_tokens": args.micro_batch_tokens,
        "tokens_per_step": tokens,
        "useful_over_computed": {n: round(t["useful"] / t["computed"], 3) for n, t in tokens.items()},
        "median_step_s": {n: round(v, 3) for n, v in median.items()},
        "packed_speedup": round(median["padded"] / median["packed"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--median", type=int, default=192)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    result = bench(args)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
