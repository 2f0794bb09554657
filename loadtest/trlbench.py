"""yieldloop against TRL's GRPOTrainer: steps, wall seconds and tokens/s to a held-out target, in one run.

Two tasks (``--tasks``), each from one base model folder both systems load:

- ``letters``: the embedded ``letters`` environment (``yieldloop.envs.letters``) on the built-in tiny model: write
  a given letter at least eight times, partial credit for shorter or mixed answers; training letters a-p,
  held-out letters q-z; prompts through the model's chat template; at most 12 new tokens.
- ``short``: episodes of the common short shape (``shorttask``): a 0.5M-parameter model with a character
  tokenizer and no chat template, raw prompts of 3-4 characters, answers of ~4 tokens then EOS, a binary reward;
  at most 8 new tokens.

Both systems use the same prompts, 8 completions per prompt, all 16 training prompts per step (128 episodes),
temperature 1, AdamW at lr 1e-3 with betas (0.9, 0.95), constant schedule, no gradient clipping, no KL penalty,
advantages = reward - group mean (no std scaling). The held-out metric is the mean reward of greedy answers to the
held-out prompts, evaluated after every step by each system's own means (yieldloop: RolloutService on the
candidate checkpoint; TRL: one batched ``model.generate``). Runs alternate between the systems (seed 0 of each,
then seed 1, ...).

Two times to the target: **wall** seconds, everything each loop did from its start (yieldloop: the evaluation of
the starting head its promotion gate compares against, then every step with its evaluation; TRL: every step with
its evaluation), and seconds of **training only** (evaluations left out). The goal is judged on wall seconds:
yieldloop's next batch samples while the candidate is evaluated (with overlap, by the head; on-policy, by the
candidate itself), so leaving evaluations out would also leave out part of its sampling (TRL does nothing else
while it evaluates).

- yieldloop: ``yieldloop up``'s stack (four processes, torch engine) and the closed loop (``yieldloop.loop``),
  every candidate promoted; ``--off-policy`` lists the overlap settings to run (``max_off_policy``).
- TRL: ``GRPOTrainer`` (``loss_type="bnpo"``, one optimizer step per generation batch), on CPU, in a process of its
  own that runs every TRL run and nothing else.

Each step's CPU is recorded in every process (each service of the stack with its children, the loop's client; TRL's
process) and reported as milliseconds of CPU per episode (``cpu_ms_per_episode``); TRL runs with torch's default
threads and with one (``--trl-threads``), and each side runs to the target (``--max-steps`` is only a bound).

The TRL settings that reproduce yieldloop's defaults (``LoopConfig``, ``importance_sampling``), where TRL 1.16's
own defaults differ (the learning rate is the run's, 1e-3, on both sides):

=======================  ==================  ===========================================  =====================
GRPOConfig field         TRL's default       yieldloop's default                          set here
=======================  ==================  ===========================================  =====================
``lr_scheduler_type``    ``linear`` (decay)  constant                                     ``constant``
``adam_beta2``           0.999               0.95 (AdamW betas (0.9, 0.95), eps 1e-8)     0.95
``max_grad_norm``        1.0                 no clipping (``max_grad_norm=0``)            0
``scale_rewards``        ``group`` (std)     reward - group mean (no std)                 ``none``
``loss_type``            ``dapo``            sum over tokens                              ``bnpo``
=======================  ==================  ===========================================  =====================

Unchanged because they agree: ``beta`` 0 (no KL), ``num_iterations`` 1 (so the ratio is 1 and ``epsilon``
clipping never acts, as yieldloop's ratio to the sampler's logprobs is 1 up to float error), temperature 1, top-p
1, top-k 0, ``weight_decay`` 0, eps 1e-8, truncated completions kept. Loss normalisation is the one difference
left: ``bnpo``/``dapo`` divide by the batch's completion tokens, a near-constant factor per step that AdamW's
per-parameter scaling takes out (up to eps and the second moment's memory); steps to the target agree with these
settings (``steps_ratio_*``). TRL generates with ``transformers``' ``generate`` in the training process, yieldloop
with its rollout engine in another process.

Usage: ``pip install -e '.[bench]'`` then ``python loadtest/trlbench.py [--tasks letters short] [--seeds 2]
[--target 0.8] [--max-steps 60] [--off-policy 0 1] [--trl-threads 0 1] [--out r.json]``
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import functools
import multiprocessing
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from envbench import tree_cpu_s
from loopbench import own_cpu_s
from scratch import scratch_dir
from trainerbench import run_and_report

LEARNING_RATE = 1e-3
GROUP = 8
PROBES = 5
"""Rollouts of the training batch timed after each run, on its final weights (see :func:`yieldloop_rollout_probe_s`)."""


@dataclasses.dataclass
class BenchTask:
    """One task both systems train on, from the same base model folder."""

    name: str
    model: pathlib.Path
    """The base model's folder (Hugging Face format): TRL loads it, the stack serves it."""
    stack_model: str
    """What the stack is given (``StackConfig.model``) and the slug the loop trains."""
    loop_model: str
    env_specs: tuple[str, ...]
    tasks: dict[str, str]
    """The loop's tasksets (``LoopConfig.train_tasks``/``heldout_tasks``)."""
    max_tokens: int
    train_rows: list[dict]
    """TRL's dataset: a ``prompt`` (chat messages or raw text) and the reward's own columns."""
    reward: Callable[..., list[float]]
    """TRL's reward function: (completion texts, the rows' columns) -> rewards."""
    heldout_texts: list[str]
    """The held-out prompts as the model reads them (chat template applied, or raw)."""
    heldout_score: Callable[[list[str]], float]
    """Mean reward of the held-out answers, in ``heldout_texts``' order."""


def completion_text(completion: object) -> str:
    """A TRL completion's text: a conversational completion is a list of messages."""
    return completion[0]["content"] if isinstance(completion, list) else str(completion)  # type: ignore[index]


def letters_task(root: pathlib.Path) -> BenchTask:
    """The embedded default's ``letters`` task on the built-in tiny model, prompts through its chat template."""
    from transformers import AutoTokenizer

    from yieldloop.envs.letters import HELDOUT_LETTERS, TASKS, TRAIN_LETTERS, letter_reward
    from yieldloop_server.config import DEFAULT_ENV_SPEC
    from yieldloop_server.stack import ensure_model
    from yieldloop_server.store import open_store

    store_dir = root / "base-store"
    ensure_model(open_store(str(store_dir)), "tiny")
    model = store_dir / "models" / "tiny" / "checkpoints" / "base"
    tokenizer = AutoTokenizer.from_pretrained(model)

    def prompt(letter: str) -> str:
        return f'Write the letter "{letter}" at least eight times.'

    def reward(completions: list, letter: list, **_: object) -> list[float]:
        return [letter_reward(completion_text(c), t) for c, t in zip(completions, letter, strict=True)]

    return BenchTask(
        name="letters",
        model=model,
        stack_model="tiny",
        loop_model="tiny",
        env_specs=(DEFAULT_ENV_SPEC,),
        tasks=TASKS,
        max_tokens=12,
        train_rows=[{"prompt": [{"role": "user", "content": prompt(c)}], "letter": c} for c in TRAIN_LETTERS],
        reward=reward,
        heldout_texts=[
            tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt(c)}], add_generation_prompt=True, tokenize=False
            )
            for c in HELDOUT_LETTERS
        ],
        heldout_score=lambda answers: statistics.mean(
            letter_reward(a, c) for a, c in zip(answers, HELDOUT_LETTERS, strict=True)
        ),
    )


def short_task(root: pathlib.Path) -> BenchTask:
    """The short-episode task (``shorttask``): a character-tokenizer model, raw prompts, binary reward."""
    import shorttask

    from yieldloop_server.checkpoint.importer import slug_for

    model = root / "short-model"
    if not (model / "config.json").exists():
        shorttask.build_model(model)

    def reward(completions: list, prompts: list, **_: object) -> list[float]:
        return [shorttask.reward(completion_text(c), p) for c, p in zip(completions, prompts, strict=True)]

    return BenchTask(
        name="short",
        model=model,
        stack_model=str(model),
        loop_model=slug_for(str(model)),
        env_specs=(shorttask.ENV_SPEC,),
        tasks=shorttask.TASKS,
        max_tokens=8,
        train_rows=[{"prompt": p} for p in shorttask.TRAIN_PROMPTS],
        reward=reward,
        heldout_texts=list(shorttask.HELDOUT_PROMPTS),
        heldout_score=lambda answers: statistics.mean(
            shorttask.reward(a, p) for a, p in zip(answers, shorttask.HELDOUT_PROMPTS, strict=True)
        ),
    )


TASK_BUILDERS = {"letters": letters_task, "short": short_task}


def to_target(per_step: list[dict], target: float, before_s: float = 0.0) -> dict:
    """Steps, seconds and sampled tokens until the held-out reward first reached ``target``: ``seconds`` counts
    training only, ``wall_seconds`` everything the loop did (``before_s``, its evaluations included)."""
    seconds = tokens = 0.0
    wall = before_s
    for i, step in enumerate(per_step, 1):
        seconds += step["train_s"]
        wall += step["train_s"] + step["eval_s"]
        tokens += step["tokens"]
        if step["heldout"] >= target:
            return {
                "reached": True,
                "steps": i,
                "seconds": round(seconds, 2),
                "wall_seconds": round(wall, 2),
                "tokens_per_s": round(tokens / seconds, 1),
            }
    return {
        "reached": False,
        "steps": len(per_step),
        "seconds": round(seconds, 2),
        "wall_seconds": round(wall, 2),
        "tokens_per_s": round(tokens / seconds, 1) if seconds else 0.0,
    }


async def run_yieldloop(
    task: BenchTask, data_dir: pathlib.Path, args: argparse.Namespace, off_policy: int, seed: int
) -> dict:
    from yieldloop.client import Client
    from yieldloop.loop import LoopConfig, closed_loop
    from yieldloop_server.config import EnvOptions, RolloutOptions, StackConfig
    from yieldloop_server.stack import ProcessStack

    stack = ProcessStack(
        StackConfig(
            data_dir=data_dir,
            model=task.stack_model,
            env=EnvOptions(specs=task.env_specs),
            rollout=RolloutOptions(engine_process=args.engine_process),
        )
    )
    addresses = await stack.start()
    pids = {name: service.process.pid for name, service in stack.services.items() if service.process is not None}

    def cpu_now() -> dict[str, float]:
        """CPU seconds so far of each service process (with its children: the engine's, env workers) and of this
        one (the loop's client)."""
        return {name: tree_cpu_s(pid) for name, pid in pids.items()} | {"client": own_cpu_s()}

    config = LoopConfig(
        **task.tasks,
        model=task.loop_model,
        steps=args.max_steps,
        group_size=GROUP,
        learning_rate=LEARNING_RATE,
        max_tokens=task.max_tokens,
        promotion_tolerance=1.0,
        max_off_policy=off_policy,
        seed=seed,
        target_heldout_reward=args.target,
        name=f"trlbench-{task.name}-{seed}",
    )
    per_step = []
    baseline: list = []
    try:
        async with Client(**addresses, timeout=300, api_key=stack.api_key) as client:
            cpu = cpu_now()
            async for report in closed_loop(client, config, baseline=baseline):
                cpu, before = cpu_now(), cpu
                per_step.append(
                    {
                        "heldout": report.heldout_reward,
                        "train_s": report.total_s - report.heldout_s,
                        "eval_s": report.heldout_s,
                        "tokens": report.completion_tokens,
                        "rollout_s": report.rollout_s,
                        "forward_backward_s": report.forward_backward_s,
                        "optim_s": report.optim_s,
                        "reload_s": report.reload_s,
                        "off_policy_runs": report.off_policy_runs,
                        "episodes": report.num_runs,
                        "cpu_s": {name: round(cpu[name] - before[name], 4) for name in cpu},
                    }
                )
            probe = await yieldloop_rollout_probe_s(client, task, config)
    finally:
        await stack.stop()
    before = baseline[0].heldout_s if baseline else 0.0  # the loop's first evaluation (the gate's reference)
    return {
        "per_step": per_step,
        "baseline_s": before,
        "rollout_probe_s": probe,
        **to_target(per_step, args.target, before),
    }


async def yieldloop_rollout_probe_s(client: object, task: BenchTask, config: object) -> float:
    """The rollout of one training batch (every training prompt x GROUP, the loop's sampling) through the stack,
    on the run's final head: the median of PROBES, each a StreamRollouts to its last run.

    The loop's own steps do not show it: on-policy, a batch samples the candidate while the gate evaluates it (one
    engine decoding both), so a step waits for no rollout; with overlap it samples beside the training."""
    from yieldloop.loop import load_tasks
    from yieldloop.training import Agent, Job, run_tasks

    model, temperature, max_tokens = config.model, config.temperature, config.max_tokens  # type: ignore[attr-defined]
    tasks = load_tasks(task.tasks["train_tasks"])
    job = await Job.start(model, GROUP, name="rollout-probe", client=client)  # type: ignore[arg-type]
    agent = Agent(model=model, temperature=temperature, max_tokens=max_tokens)
    times = []
    for _ in range(PROBES):
        started = time.perf_counter()
        await run_tasks(tasks, agent, job=job)
        times.append(time.perf_counter() - started)
    return round(statistics.median(times), 4)


def run_trl(
    task_name: str, task_root: pathlib.Path, out: pathlib.Path, args: argparse.Namespace, threads: int, seed: int
) -> dict:
    """TRL's run with ``threads`` torch threads (0: torch's default), in the bench's TRL process: a process of its
    own, where nothing of yieldloop's runs ever ran (run in a thread of the bench's process, TRL took 0.25 s per
    letters step in some runs and 0.16 s in others; in a process of its own, 0.16 s in every run)."""
    import torch

    task = TASK_BUILDERS[task_name](task_root)  # (the model folders exist: the bench's process made them)
    default = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _train_trl(task, out, args, seed)
    finally:
        torch.set_num_threads(default)


def _train_trl(task: BenchTask, out: pathlib.Path, args: argparse.Namespace, seed: int) -> dict:
    import torch
    from datasets import Dataset  # pyright: ignore[reportMissingImports] (the bench extra)
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer  # pyright: ignore[reportMissingImports]

    tokenizer = AutoTokenizer.from_pretrained(task.model)
    model = AutoModelForCausalLM.from_pretrained(task.model, dtype=torch.float32)
    dataset = Dataset.from_list(task.train_rows)
    tokens = [0]

    def reward(completions: list, completion_ids: list | None = None, **columns: object) -> list[float]:
        tokens[0] += sum(len(ids) for ids in completion_ids or [])
        return task.reward(completions, **columns)

    def heldout() -> float:
        """The held-out prompts answered greedily in one batch (left-padded), as fast as ``generate`` goes."""
        model.eval()
        side, tokenizer.padding_side = tokenizer.padding_side, "left"
        try:
            with torch.no_grad():
                batch = tokenizer(task.heldout_texts, return_tensors="pt", padding=True, add_special_tokens=False)
                generated = model.generate(
                    **batch,
                    max_new_tokens=task.max_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                )
            answers = tokenizer.batch_decode(generated[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        finally:
            tokenizer.padding_side = side
        model.train()
        return task.heldout_score(answers)

    per_step: list[dict] = []
    sampled = [0.0]  # seconds in TRL's generate + reward (+ advantages): what yieldloop's rollout_s stands for

    class Measure(TrainerCallback):
        def on_step_begin(self, *_: object, **__: object) -> None:
            self.started, self.tokens, self.cpu, self.sampled = time.perf_counter(), tokens[0], own_cpu_s(), sampled[0]

        def on_step_end(self, _args: object, state: object, control: object, **__: object) -> None:
            train_s = time.perf_counter() - self.started
            cpu_s = own_cpu_s() - self.cpu  # the step's generate, reward, forward/backward and optimizer
            score = heldout()
            per_step.append(
                {
                    "heldout": score,
                    "train_s": train_s,
                    "eval_s": time.perf_counter() - self.started - train_s,
                    "tokens": tokens[0] - self.tokens,
                    "episodes": GROUP * len(task.train_rows),
                    "rollout_s": sampled[0] - self.sampled,
                    "cpu_s": {"trl": round(cpu_s, 4)},
                }
            )
            if score >= args.target:
                control.should_training_stop = True

    config = GRPOConfig(
        output_dir=str(out),
        max_steps=args.max_steps,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=0.0,
        per_device_train_batch_size=GROUP * len(task.train_rows),
        gradient_accumulation_steps=1,
        num_generations=GROUP,
        max_completion_length=task.max_tokens,
        temperature=1.0,
        beta=0.0,
        scale_rewards="none",
        loss_type="bnpo",
        num_iterations=1,
        use_cpu=True,
        bf16=False,
        seed=seed,
        report_to="none",
        logging_steps=1000,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Measure()],
    )
    generate_and_score = trainer._generate_and_score_completions

    def timed(inputs: object) -> object:
        started = time.perf_counter()
        try:
            return generate_and_score(inputs)
        finally:
            sampled[0] += time.perf_counter() - started

    trainer._generate_and_score_completions = timed
    trainer.train()
    batch = [row for row in task.train_rows for _ in range(GROUP)]  # what TRL's sampler gives one step
    times = []
    for _ in range(PROBES):  # as yieldloop_rollout_probe_s: the training batch's generate + reward, final weights
        started = time.perf_counter()
        generate_and_score(batch)
        times.append(time.perf_counter() - started)
    probe = round(statistics.median(times), 4)
    return {"per_step": per_step, "rollout_probe_s": probe, **to_target(per_step, args.target)}


async def bench(args: argparse.Namespace) -> dict:
    root = scratch_dir("yl-trlbench-")
    trl_runs = {trl_name(n): n for n in args.trl_threads}
    summary: dict[str, object] = {
        "target_heldout_reward": args.target,
        "seeds": args.seeds,
        "cpu_threads": os.cpu_count(),
    }
    loop = asyncio.get_running_loop()
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as trl_process:
        for name in args.tasks:
            task = TASK_BUILDERS[name](root / name)
            results: dict[str, list[dict]] = {f"yieldloop_off_policy_{n}": [] for n in args.off_policy}
            results |= {system: [] for system in trl_runs}
            for seed in range(args.seeds):
                for n in args.off_policy:
                    data_dir = root / name / f"yl-{n}-{seed}"
                    results[f"yieldloop_off_policy_{n}"].append(await run_yieldloop(task, data_dir, args, n, seed))
                for system, threads in trl_runs.items():
                    out = root / name / f"{system}-{seed}"
                    run = functools.partial(run_trl, name, root / name, out, args, threads, seed)
                    results[system].append(await loop.run_in_executor(trl_process, run))
            summary[name] = summarize(results, args, trl_runs)
    return summary


def summarize(results: dict[str, list[dict]], args: argparse.Namespace, trl_runs: dict[str, int]) -> dict:
    """Each system's medians over its runs, the ratios of yieldloop's to TRL's, and the runs themselves."""
    summary: dict[str, object] = {}
    for name, runs in results.items():
        reached = [r for r in runs if r["reached"]]
        steps = [s for r in runs for s in r["per_step"]]
        parts = (
            ("rollout_s", "forward_backward_s", "optim_s", "reload_s")
            if name.startswith("yieldloop")
            else ("rollout_s",)
        )
        summary[name] = {
            "reached": f"{len(reached)}/{len(runs)}",
            "median_steps": statistics.median(r["steps"] for r in reached) if reached else None,
            "mean_steps": round(statistics.mean(r["steps"] for r in reached), 2) if reached else None,
            "heldout_curve": heldout_curve(runs),
            "median_seconds": statistics.median(r["seconds"] for r in reached) if reached else None,
            "median_wall_seconds": statistics.median(r["wall_seconds"] for r in reached) if reached else None,
            "median_eval_s": round(statistics.median(s["eval_s"] for s in steps), 3),
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "median_s_per_step": round(statistics.median(s["train_s"] for s in steps), 3),
            "cpu_ms_per_episode": cpu_per_episode(steps),
            "per_step_split_s": {part: round(statistics.median(s[part] for s in steps), 3) for part in parts},
            "median_rollout_probe_s": round(statistics.median(r["rollout_probe_s"] for r in runs), 4),
        }
    probes = {name: split["median_rollout_probe_s"] for name, split in summary.items()}  # type: ignore[index]
    for trl_run in trl_runs:  # the rollout of a batch against TRL's generate + reward of one, on final weights
        for n in args.off_policy:
            ratio = probes[f"yieldloop_off_policy_{n}"] / probes[trl_run]
            summary[f"rollout_ratio_yieldloop_off_policy_{n}_to_{trl_run}"] = round(ratio, 2)
    for n in args.off_policy:
        for trl_run in trl_runs:
            for key, label in (
                ("median_wall_seconds", "wall_ratio"),
                ("median_seconds", "training_only_ratio"),
                ("median_steps", "steps_ratio"),
                ("mean_steps", "mean_steps_ratio"),
            ):
                ours, trl = summary[f"yieldloop_off_policy_{n}"][key], summary[trl_run][key]  # type: ignore[index]
                if ours and trl:
                    summary[f"{label}_yieldloop_off_policy_{n}_to_{trl_run}"] = round(ours / trl, 2)
    summary["runs"] = results
    return summary


def heldout_curve(runs: list[dict]) -> list[float]:
    """The mean held-out reward after each step over the runs, a run that stopped at the target counted at its
    last value: the learning curves compared step for step (the target's step count is one threshold on them, and
    a run a hair below it at one step takes a step more)."""
    longest = max(len(r["per_step"]) for r in runs)
    return [
        round(statistics.mean(r["per_step"][min(i, len(r["per_step"]) - 1)]["heldout"] for r in runs), 3)
        for i in range(longest)
    ]


def trl_name(threads: int) -> str:
    """The result's name of TRL run with ``threads`` torch threads (0: torch's default)."""
    return "trl" if threads == 0 else f"trl_{threads}_thread"


def cpu_per_episode(steps: list[dict]) -> dict[str, float]:
    """Milliseconds of CPU per episode, per process and summed over them: the CPU of every step of the runs over
    their episodes (what one episode costs the whole system, sampling and training included). Summed over the runs,
    not a median of steps: a step's CPU is counted in clock ticks of 10 ms, ~0.08 ms per episode of a step."""
    names = sorted({name for s in steps for name in s["cpu_s"]})
    episodes = sum(s["episodes"] for s in steps)
    per = {name: round(sum(s["cpu_s"][name] for s in steps) / episodes * 1e3, 3) for name in names}
    per["total"] = round(sum(sum(s["cpu_s"].values()) for s in steps) / episodes * 1e3, 3)
    return per


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASK_BUILDERS), default=["letters", "short"])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--max-steps", type=int, default=60, help="steps at most: a run stops at the target")
    parser.add_argument(
        "--trl-threads",
        type=int,
        nargs="*",
        default=[0, 1],
        help="TRL runs with these torch thread counts (0: torch's default, one per core)",
    )
    parser.add_argument("--off-policy", type=int, nargs="*", default=[0, 1])
    parser.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        help="the rollout service's torch engine in a process of its own, or in a thread (default: "
        "yieldloop up's choice, a thread where the rollout service gets one core)",
    )
    parser.add_argument("--out", type=pathlib.Path)
    run_and_report(bench, parser.parse_args())


if __name__ == "__main__":
    main()
