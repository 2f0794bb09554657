"""The closed loop's step on `yieldloop up`'s stack: wall seconds and CPU seconds per service per step.

Runs ``--steps`` steps of the closed loop (``yieldloop.loop``) on the letters task (16 prompts x 8 episodes,
12 new tokens, every candidate promoted so that every run takes the same path) against the four services as
``yieldloop up`` starts them, and reports, over the steps after ``--warmup``:

- wall seconds per step, and the loop's own split (medians: waiting for the batch, forward_backward, optimizer
  step and commit, held-out evaluation, head move -> served);
- CPU seconds per step of each service's process tree (``/proc``: a service and its children, e.g. the torch
  engine's own process) and of this process (the loop's client), and their total: how much of the machine's
  cores a step keeps busy.

``--variants`` runs several stacks one after another, alternating ``--rounds`` times, for A/B comparisons of the
rollout service's options on one machine in one run, e.g. the torch engine's running batch:

    python loadtest/loopbench.py --variants max_batch=64 max_batch=256 --rounds 2

A variant is ``name=value`` pairs of ``RolloutOptions`` fields, or of ``TrainerOptions`` fields as
``trainer.name=value`` (``default``: none), e.g. packed against padded micro-batches:

    python loadtest/loopbench.py --variants trainer.pack=true trainer.pack=false --rounds 1

Prints JSON (with the trainer's useful / computed tokens per step); ``--out`` writes it.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from envbench import tree_cpu_s
from scratch import scratch_dir
from trainerbench import run_and_report

SPLIT = ("rollout_s", "forward_backward_s", "optim_s", "heldout_s", "reload_s", "total_s")


def variant_options(variant: str) -> dict[str, object]:
    """``StackConfig`` keyword arguments for a variant (``a=1,trainer.b=x``: ``RolloutOptions`` fields, or
    ``TrainerOptions`` fields after ``trainer.``; ``default``: none)."""
    from yieldloop_server.config import RolloutOptions, TrainerOptions

    values: dict[str, dict[str, object]] = {"rollout": {}, "trainer": {}}
    for pair in filter(None, variant.split(",")):
        if pair == "default":
            continue
        name, _, raw = pair.partition("=")
        plane, _, name = name.rpartition(".")
        plane = plane or "rollout"
        own = {"rollout": RolloutOptions, "trainer": TrainerOptions}[plane]()
        default = getattr(own, name)  # AttributeError names a field the options lack
        is_bool = default is None or isinstance(default, bool)
        values[plane][name] = raw.lower() in ("1", "true", "yes") if is_bool else type(default)(raw)
    return {"rollout": RolloutOptions(**values["rollout"]), "trainer": TrainerOptions(**values["trainer"])}  # type: ignore[arg-type]


async def run_loop(args: argparse.Namespace, variant: str, seed: int) -> dict:
    from yieldloop.client import Client
    from yieldloop.envs.letters import TASKS, heldout_tasks, train_tasks
    from yieldloop.loop import LoopConfig, closed_loop
    from yieldloop_server.config import StackConfig
    from yieldloop_server.stack import ProcessStack

    stack = ProcessStack(StackConfig(data_dir=scratch_dir("yl-loopbench-"), **variant_options(variant)))  # type: ignore[arg-type]
    addresses = await stack.start()
    pids = {name: service.process.pid for name, service in stack.services.items()}
    config = LoopConfig(
        **TASKS,
        steps=args.steps,
        group_size=8,
        learning_rate=1e-3,
        max_tokens=12,
        promotion_tolerance=1.0,
        max_off_policy=args.off_policy,
        seed=seed,
        name=f"loopbench-{seed}",
    )
    reports = []
    before: dict[str, float] = {}
    started = 0.0
    try:
        async with Client(**addresses, timeout=300, api_key=stack.api_key) as client:
            async for report in closed_loop(client, config, train_tasks=train_tasks(), heldout_tasks=heldout_tasks()):
                reports.append(report)
                if len(reports) == args.warmup:  # measure from here
                    started = time.perf_counter()
                    before = {name: tree_cpu_s(pid) for name, pid in pids.items()} | {"loop client": own_cpu_s()}
        wall = time.perf_counter() - started
        after = {name: tree_cpu_s(pid) for name, pid in pids.items()} | {"loop client": own_cpu_s()}
    finally:
        await stack.stop()
    measured = reports[args.warmup :]
    n = len(measured)
    cpu = {name: round((after[name] - before[name]) / n, 3) for name in after if after[name] - before[name] > 0}
    return {
        "variant": variant,
        "steps_measured": n,
        "wall_s_per_step": round(wall / n, 3),
        "cpu_s_per_step": cpu,
        "cpu_s_per_step_total": round(sum(cpu.values()), 3),
        "cores_busy": round(sum(cpu.values()) / (wall / n), 2),
        "split_median_s": {part: round(statistics.median(getattr(r, part) for r in measured), 3) for part in SPLIT},
        "off_policy_runs_per_step": round(statistics.mean(r.off_policy_runs for r in measured), 1),
        "trainer_tokens_per_step": {
            "useful": round(statistics.mean(r.useful_tokens for r in measured), 1),
            "computed": round(statistics.mean(r.computed_tokens for r in measured), 1),
            "useful_over_computed": round(
                sum(r.useful_tokens for r in measured) / max(1, sum(r.computed_tokens for r in measured)), 3
            ),
        },
    }


def own_cpu_s() -> float:
    """User + system CPU seconds of this process so far."""
    times = os.times()
    return times.user + times.system


async def bench(args: argparse.Namespace) -> dict:
    if not 1 <= args.warmup < args.steps:
        raise SystemExit("--warmup must be at least 1 (the first step starts the engines) and below --steps")
    runs: dict[str, list[dict]] = {variant: [] for variant in args.variants}
    for seed in range(args.rounds):
        for variant in args.variants:
            result = await run_loop(args, variant, seed)
            runs[variant].append(result)
            print(
                f"{variant}: {result['wall_s_per_step']} s per step, {result['cpu_s_per_step_total']} CPU s "
                f"({result['cpu_s_per_step']})",
                file=sys.stderr,
                flush=True,
            )
    summary = {
        variant: {
            "wall_s_per_step": [r["wall_s_per_step"] for r in results],
            "cpu_s_per_step_total": [r["cpu_s_per_step_total"] for r in results],
            "median_wall_s_per_step": round(statistics.median(r["wall_s_per_step"] for r in results), 3),
        }
        for variant, results in runs.items()
    }
    return {
        "steps": args.steps,
        "warmup": args.warmup,
        "off_policy": args.off_policy,
        "cpu_threads": os.cpu_count(),
        "summary": summary,
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the figures")
    parser.add_argument("--off-policy", type=int, default=1, help="the loop's max_off_policy")
    parser.add_argument(
        "--variants", nargs="+", default=["default"], help="RolloutOptions settings, e.g. max_batch=64 (default: none)"
    )
    parser.add_argument("--rounds", type=int, default=1, help="runs of every variant, alternating")
    parser.add_argument("--out", type=pathlib.Path)
    run_and_report(bench, parser.parse_args())


if __name__ == "__main__":
    main()
