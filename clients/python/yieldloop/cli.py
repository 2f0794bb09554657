"""The ``yieldloop`` command line: the loop (``eval``, ``train``), the checkpoint tree (``models``), recorded data
(``jobs``, ``trace``, ``export``) and ``report``, against a running stack.

The server distribution (``yieldloop-server``) plugs its subcommands (``serve``, ``up``, ``demo``) into this
one command through the entry point group ``yieldloop.commands``: an entry point names a
``register(commands)`` function that adds subparsers and returns ``{name: handler(args) -> exit status}``.
Without it, those subcommands say how to install it.

Only argparse is imported up front so ``yieldloop --help`` is instant; each
command imports what it needs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import sys
from typing import Any

SERVER_COMMANDS = {
    "serve": "run one service in this process",
    "up": "start all four services on localhost (the embedded default)",
    "demo": "the closed loop on the embedded default: watch a tiny model learn",
    "plan": "the GPUs and memory each plane needs for a model (config.json): the smallest layout that fits",
}
"""Subcommands the server distribution adds (an entry point in the group ``yieldloop.commands``)."""


def quiet_libraries() -> None:
    """No hub access and no download/progress chatter from the ML libraries."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run_async(coro: Any) -> Any:
    """Runs a coroutine on uvloop when available."""
    try:
        import uvloop
    except ImportError:  # uvloop is optional off Linux/macOS
        import asyncio

        return asyncio.run(coro)
    return uvloop.run(coro)


def add_attach(parser: argparse.ArgumentParser) -> None:
    """``--attach DIR``, accepted before and after a subcommand (each level's default leaves the other's value)."""
    parser.add_argument(
        "--attach",
        type=pathlib.Path,
        default=argparse.SUPPRESS,
        metavar="DATA_DIR",
        help="data directory of a running `yieldloop up` (default: $YIELDLOOP_DATA_DIR or .yieldloop)",
    )


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def _attach_everywhere(parser: argparse.ArgumentParser, skip: tuple[str, ...]) -> None:
    """``--attach`` on ``parser`` and every subcommand under it (but ``skip``, which place a stack themselves)."""
    if not any(a.dest == "attach" for a in parser._actions):
        add_attach(parser)
    for name, sub in _subparsers(parser).items():
        if name not in skip:
            _attach_everywhere(sub, ())


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = []
    for dist in ("yieldloop", "yieldloop-server"):
        try:
            parts.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            parts.append(f"{dist} not installed")
    return ", ".join(parts)


class _Version(argparse.Action):
    """``--version``: the installed distributions' versions (looked up only when asked, so --help stays instant)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=kwargs.get("help"))

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(_version())
        parser.exit()


def _listing(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON (snake_case keys) for scripts")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Any]]:
    """The parser of every subcommand, and each server subcommand's handler."""
    parser = argparse.ArgumentParser(
        prog="yieldloop", description="Self-hosted closed loop from agent evals to RL training data."
    )
    parser.add_argument("--version", action=_Version, help="print the installed versions and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    handlers: dict[str, Any] = {}

    status = commands.add_parser(
        "status", help="where the running stack is: addresses, OpenAI base URL, HUD settings, key file, logs"
    )
    _listing(status)

    models = commands.add_parser("models", help="models, checkpoints and heads of a running stack")
    model_commands = models.add_subparsers(dest="models_command", metavar="SUBCOMMAND")
    listed = model_commands.add_parser(
        "list", help="every model, with its base, owner and whether it is trainable (--wide: everything)"
    )
    _listing(listed)
    listed.add_argument(
        "--wide", action="store_true", help="also parent, public, architecture, dtype, chat template and size"
    )
    imported = model_commands.add_parser(
        "import",
        help="a Hugging Face model (a folder, or a hub id in the local cache: nothing is downloaded) as a new "
        "base slug; its weights become the checkpoint 'base'",
    )
    imported.add_argument(
        "source",
        help="a model folder on this machine (resolved here, relative to this directory, and uploaded), or a hub "
        "id (org/name) in the checkpoint service's Hugging Face cache",
    )
    imported.add_argument("--name", required=True, help="the new slug")
    imported.add_argument("--owner", default="", help="the owning team (admin keys; default: the key's team)")
    imported.add_argument("--public", action="store_true", help="every team may sample and fork it (admin keys)")
    imported.add_argument(
        "--on-server",
        action="store_true",
        help="SOURCE is a folder on the checkpoint service's machine (admin keys; under the service's --import-roots)",
    )
    fork = model_commands.add_parser(
        "fork",
        help="a new model starting from a model's head: full fine-tuning (objects shared until its first "
        "step), or with --lora-rank a LoRA fork training adapters only over the source's frozen weights",
    )
    fork.add_argument("source", help="a model slug (its head) or SLUG@CHECKPOINT")
    fork.add_argument("--name", required=True, help="the new model's slug")
    fork.add_argument("--owner", default="", help="the owning team (admin keys; default: the key's team)")
    fork.add_argument("--lora-rank", type=int, default=None, metavar="R", help="train a LoRA adapter of rank R (> 0)")
    fork.add_argument(
        "--lora-alpha",
        type=float,
        default=0.0,
        metavar="A",
        help="LoRA alpha: the update is scaled by A / R (default 2 R)",
    )
    fork.add_argument(
        "--lora-targets",
        nargs="+",
        default=[],
        metavar="MODULE",
        help="module names to adapt, e.g. q_proj v_proj (default: every linear layer of the blocks)",
    )
    delete = model_commands.add_parser(
        "delete",
        help="delete a model: its head, checkpoints and the objects no other model uses (refused while "
        "forks depend on it, unless --force)",
    )
    delete.add_argument("model", help="the slug to delete")
    delete.add_argument("--force", action="store_true", help="delete even though forks exist (they keep working)")
    checkpoints = model_commands.add_parser("checkpoints", help="a model's checkpoint tree, oldest first (> = HEAD)")
    checkpoints.add_argument("model", help="a model slug")
    _listing(checkpoints)
    discard = model_commands.add_parser(
        "discard-gradients",
        help="forget the gradients accumulated for a model since its last step (every "
        "caller's), e.g. after a step refused as NON_FINITE or HEAD_CONFLICT",
    )
    discard.add_argument("model", help="a model slug")
    head = model_commands.add_parser("head", help="show a model's head, or move it with --set (rollback, branch)")
    head.add_argument("model", help="a model slug")
    head.add_argument("--set", dest="set_to", metavar="CHECKPOINT", help="move the head to this checkpoint")
    head.add_argument("--expect", default="", metavar="CHECKPOINT", help="only if the head is this (compare-and-swap)")

    keys = commands.add_parser("keys", help="API keys of a running stack (needs an admin key)")
    key_commands = keys.add_subparsers(dest="keys_command", metavar="SUBCOMMAND")
    created = key_commands.add_parser("create", help="a new key for a team; printed once, stored only hashed")
    created.add_argument("--team", required=True, help="the team the key acts for")
    created.add_argument(
        "--role",
        required=True,
        choices=("sample", "train", "admin"),
        help="sample: roll out and sample the team's and public models; train: also fork, import, "
        "train and move the head of the team's models; admin: keys and every model",
    )
    created.add_argument("--name", default="", help="a label for `keys list`")
    _listing(key_commands.add_parser("list", help="every key (never a secret), revoked ones marked"))
    key_commands.add_parser(
        "mint",
        help="print a new key, offline, for a deployment's Secret (YIELDLOOP_ADMIN_KEY, "
        "YIELDLOOP_SERVICE_KEY: the services register it at start)",
    )
    revoked = key_commands.add_parser("revoke", help="revoke a key: every service refuses it within seconds")
    revoked.add_argument("key_id", help="the key's id (`keys list`)")

    evaluate = commands.add_parser("eval", help="run a taskset against a model as a job (group rollouts per task)")
    evaluate.add_argument("tasks", help="taskset: a .py/.json/.jsonl file, file.py:attr or module:attr")
    evaluate.add_argument("model", help="model slug the rollout service serves")
    evaluate.add_argument("--group", type=int, default=8, help="episodes per task (default 8)")
    evaluate.add_argument("--max-concurrent", type=int, default=0, help="episodes in flight at once (0: all)")
    evaluate.add_argument("--max-tokens", type=int, default=16, help="tokens per model turn (default 16)")
    evaluate.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    evaluate.add_argument("--max-steps", type=int, default=0, help="model turns per episode (0: 8)")
    evaluate.add_argument("--checkpoint", default="", help="sample this checkpoint instead of the head")
    evaluate.add_argument("--name", default="", help="job name")
    _listing(evaluate)

    train = commands.add_parser(
        "train", help="the closed loop from a config file (.toml or .json), on a running stack (Ctrl-C stops it)"
    )
    train.add_argument("config", type=pathlib.Path, help="the run's config: model, tasksets, steps, loss, ...")
    train.add_argument(
        "--resume",
        default="",
        metavar="JOB",
        help="continue an interrupted `yieldloop train` job (same job and run folder) from its model's head",
    )

    _listing(commands.add_parser("jobs", help="recorded jobs (evals and training sessions), oldest first"))

    trace = commands.add_parser(
        "trace",
        help="print a recorded run (prompt, turns, reward or error) by trace id, and where its time went when "
        "spans were recorded",
    )
    trace.add_argument("trace_id", help="a run's trace id (from export, eval --json or the HUD front)")
    trace.add_argument("--json", action="store_true", help="the run as JSON")

    export = commands.add_parser("export", help="write a job's graded runs as RFT JSONL or token-level JSONL/Parquet")
    export.add_argument("job", help="a job id (`yieldloop jobs`)")
    export.add_argument("--format", default="jsonl", choices=("jsonl", "parquet"), help="file format (default jsonl)")
    export.add_argument(
        "--kind",
        default="",
        choices=("", "rft", "tokens"),
        help="rft: prompt/completion/reward; tokens: token ids, logprobs, masks, rewards, group ids "
        "(default: rft for jsonl, tokens for parquet)",
    )
    export.add_argument("--out", type=pathlib.Path, help="output file (default: <job>.<kind>.<format>)")

    report = commands.add_parser("report", help="write report.png and report.html for a training run")
    report.add_argument("run", help="a run directory, or the job id of a `yieldloop train` run in --attach/runs/")

    handlers.update(_plugins(commands))
    for name, text in SERVER_COMMANDS.items():
        if name not in handlers:
            commands.add_parser(name, help=f"{text} (needs the server distribution)", add_help=False)
            handlers[name] = _needs_server
    _attach_everywhere(parser, skip=tuple(SERVER_COMMANDS))
    return parser, handlers


def _plugins(commands: Any) -> dict[str, Any]:
    """Subcommands of installed distributions (entry points in the group ``yieldloop.commands``)."""
    from importlib.metadata import entry_points

    handlers: dict[str, Any] = {}
    for entry in entry_points(group="yieldloop.commands"):
        handlers.update(entry.load()(commands))
    return handlers


def _needs_server(args: argparse.Namespace) -> int:
    print(
        f"yieldloop: `yieldloop {args.command}` runs the services, which are the server distribution: "
        "install it from a yieldloop checkout with `pip install -e ./clients/python -e .`",
        file=sys.stderr,
    )
    return 1


def _client(args: argparse.Namespace, timeout: float = 300.0) -> Any:
    from yieldloop.training import connect

    return connect(args.attach, timeout=timeout)


@contextlib.contextmanager
def _group_counts_only() -> Any:
    """While a command prints how many groups had no reward spread, the per-group warnings stay quiet."""
    import logging

    logger = logging.getLogger("yieldloop.groups")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _progress(console: Any) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


async def run_loop(
    client: Any,
    config: Any,
    run_root: pathlib.Path,
    console: Any,
    resume: str = "",
    again: str = "",
    **tasks: Any,
) -> dict[str, Any]:
    """Runs the closed loop with a progress bar and per-step lines; writes the report; returns a summary.

    Interrupted (Ctrl-C), it prints one line instead of a traceback: the last committed step, where HEAD is, the
    report of the steps so far and, when ``again`` (the command that started it) is given, how to continue.
    """
    import asyncio
    import time

    from yieldloop.loop import Baseline, closed_loop
    from yieldloop.report import write_report

    baseline: list[Baseline] = []
    steps = []
    job: list[str] = []
    started = time.perf_counter()
    try:
        with _progress(console) as progress, _group_counts_only():
            bar = progress.add_task("training steps", total=config.steps)
            async for report in closed_loop(
                client, config, runs_dir=run_root, baseline=baseline, resume=resume, on_start=job.append, **tasks
            ):
                if not steps and baseline and not resume:
                    progress.console.print(
                        f"held-out reward of {baseline[0].checkpoint_id}: {baseline[0].heldout_reward:.3f}"
                    )
                steps.append(report)
                progress.console.print(report.line(), soft_wrap=True, markup=False)
                if not report.promoted:
                    progress.console.print(f"  kept unpromoted: {report.reason}", markup=False)
                if report.warning:
                    progress.console.print(f"  [bold yellow]warning:[/] {report.warning}", soft_wrap=True)
                progress.advance(bar)
    except (asyncio.CancelledError, KeyboardInterrupt):
        if job:
            await _interrupted(client, config, run_root / job[0], again)
        raise
    elapsed = time.perf_counter() - started
    png, page = write_report(run_root / job[0])
    return {
        "steps": steps,
        "baseline": baseline[0] if baseline else None,
        "elapsed_s": elapsed,
        "report": page,
        "png": png,
        "job_id": job[0],
    }


async def _interrupted(client: Any, config: Any, run_dir: pathlib.Path, again: str) -> None:
    """The one line a stopped loop leaves: what its run folder recorded (a step may have committed after the last
    line printed), where HEAD is, the report, how to go on."""
    from yieldloop.errors import YieldloopError
    from yieldloop.loop import recorded_steps
    from yieldloop.report import write_report

    try:
        head = (await client.get_head(config.model)).checkpoint_id
    except YieldloopError as err:
        head = f"unknown ({err.reason})"
    try:
        report = str(write_report(run_dir)[1])
    except (YieldloopError, OSError, ValueError):
        report = f"none yet ({run_dir})"
    steps = recorded_steps(run_dir)
    last = f"step {steps[-1]['step']} ({steps[-1]['checkpoint_id']})" if steps else "no step"
    resume = f"; continue with `{again} --resume {run_dir.name}`" if again else ""
    print(
        f"interrupted: {len(steps)} step(s) of this job committed, the last {last}; HEAD of "
        f"{config.model} is {head}; report: {report}{resume}",
        file=sys.stderr,
        flush=True,
    )


def print_summary(console: Any, summary: dict[str, Any], target: float = 0.0) -> None:
    steps, baseline = summary["steps"], summary["baseline"]
    if steps and baseline:
        after = steps[-1].head_heldout_reward
        reached = next((i for i, s in enumerate(steps, 1) if target and s.head_heldout_reward >= target), None)
        console.print(
            f"held-out reward {baseline.heldout_reward:.3f} -> {after:.3f} in {len(steps)} steps "
            f"({summary['elapsed_s']:.1f}s of RL" + (f"; reached {target:g} at step {reached}" if reached else "") + ")"
        )
        split = {
            k: sum(getattr(s, k) for s in steps)
            for k in ("rollout_s", "forward_backward_s", "optim_s", "heldout_s", "reload_s")
        }
        console.print("time split: " + ", ".join(f"{k[:-2]} {v:.1f}s" for k, v in split.items()))
    console.print(f"job {summary['job_id']}; report: {summary['report']} (plot {summary['png']})")


async def _train(args: argparse.Namespace) -> None:
    from rich.console import Console

    from yieldloop.loop import LoopConfig, load_tasks
    from yieldloop.training import data_dir_of

    config = LoopConfig.from_file(args.config)
    # Bad task specs and a missing model fail before any work.
    tasks = {"train_tasks": load_tasks(config.train_tasks), "heldout_tasks": load_tasks(config.heldout_tasks)}
    console = Console()
    again = f"yieldloop train {args.config}" + (f" --attach {args.attach}" if args.attach else "")
    async with _client(args) as client:
        await client.get_head(config.model)
        summary = await run_loop(
            client, config, data_dir_of(args.attach) / "runs", console, resume=args.resume, again=again, **tasks
        )
    print_summary(console, summary, config.target_heldout_reward)


async def _eval(args: argparse.Namespace) -> None:
    import collections

    from rich.console import Console
    from rich.table import Table

    from yieldloop.groups import groups_without_spread
    from yieldloop.loop import load_tasks
    from yieldloop.training import (
        Agent,
        Job,
        failure_message,
        failure_reason,
        failures,
        mean_reward,
        run_tasks,
    )
    from yieldloop.types import RunStatus

    tasks = load_tasks(args.tasks)
    console = Console(stderr=args.json)  # --json: stdout is the JSON alone
    async with _client(args) as client:
        job = await Job.start(args.model, args.group, name=args.name or f"eval {args.tasks}", client=client)
        agent = Agent(
            model=args.model, temperature=args.temperature, max_tokens=args.max_tokens, max_steps=args.max_steps
        )
        with _progress(console) as progress:
            bar = progress.add_task(f"eval {len(tasks)} tasks x {args.group}", total=len(tasks) * args.group)
            runs = await run_tasks(
                tasks,
                agent,
                job=job,
                max_concurrent=args.max_concurrent,
                checkpoint_id=args.checkpoint,
                on_run=lambda run: progress.advance(bar),
            )
    by_task: dict[str, list] = collections.defaultdict(list)
    for run in runs:
        by_task[f"{run.task.env}/{run.task.scenario} {run.task.args_json}"].append(run)
    rows = []
    for name, task_runs in by_task.items():
        failed = [r for r in task_runs if r.status != RunStatus.GRADED]
        rows.append(
            {
                "task": name,
                "runs": len(task_runs),
                "graded": len(task_runs) - len(failed),
                "mean_reward": mean_reward(task_runs),
                "rewards": [r.reward for r in task_runs if r.status == RunStatus.GRADED],
                "errors": dict(collections.Counter(failure_reason(r) for r in failed)),
                "first_error": failure_message(failed[0]) if failed else "",
            }
        )
    flat = groups_without_spread(runs)  # counted below, not a warning each
    if args.json:
        print_json(
            {"job_id": job.id, "runs": len(runs), "mean_reward": mean_reward(runs), "groups_without_spread": len(flat)}
            | {"not_graded": sum(r["runs"] - r["graded"] for r in rows), "tasks": rows}
        )
        return
    table = Table("task", "runs", "mean reward", "rewards", "not graded")
    for row in rows:
        errors = ", ".join(f"{n} {reason}" for reason, n in row["errors"].items())
        table.add_row(row["task"], str(row["runs"]), _mean(row["mean_reward"]), histogram(row["rewards"]), errors)
    console.print(table)
    for row in rows:
        if row["first_error"]:
            console.print(f"{row['task']}: first error: {row['first_error']}", markup=False, soft_wrap=True)
    errors = sum(run.status != RunStatus.GRADED for run in runs)
    console.print(
        f"job {job.id}: {len(runs)} runs, mean reward {_mean(mean_reward(runs))}, "
        f"{len(flat)} group(s) without reward spread, {errors} not graded"
        + (f" ({failures(runs).partition(';')[0]})" if errors else ""),
        markup=False,
        soft_wrap=True,
    )
    console.print(f"export: yieldloop export {job.id} --format jsonl", markup=False)


async def _jobs(args: argparse.Namespace) -> None:
    import datetime

    from rich.console import Console
    from rich.table import Table

    async with _client(args, timeout=60) as client:
        jobs = await client.list_jobs()
    if args.json:
        print_json(jobs)
        return
    table = Table("job", "name", "model", "group", "runs", "created")
    for job in jobs:
        created = datetime.datetime.fromtimestamp(job.created_time).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(job.job_id, job.name, job.model, str(job.group_size or "-"), str(job.num_runs), created)
    Console().print(table)


async def _export(args: argparse.Namespace) -> None:
    from rich.console import Console

    from yieldloop.export import export_runs
    from yieldloop.training import failures

    console = Console()
    kind = args.kind or ("rft" if args.format == "jsonl" else "tokens")
    out = args.out or pathlib.Path(f"{args.job}.{kind}.{args.format}")
    async with _client(args) as client:
        with console.status(f"reading the runs of {args.job}..."):
            runs = [run async for run in client.job_runs(args.job)]
    count = export_runs(runs, out, args.format, kind)
    console.print(f"wrote {count} graded run(s) of {len(runs)} to {out} ({kind}, {args.format})", markup=False)
    if count < len(runs):
        console.print(
            f"left out {len(runs) - count} run(s) not graded (no reward to train on): {failures(runs)}; "
            f"see one with `yieldloop trace TRACE_ID`",
            markup=False,
            soft_wrap=True,
        )


def _mean(value: float) -> str:
    """A mean reward for people: "-" when no run was graded."""
    return "-" if value != value else f"{value:.3f}"


def histogram(rewards: list[float]) -> str:
    """Rewards in a few characters: each value's count when there are few values (binary rewards: "1.00 x5, 0.00
    x3"), else their spread (min, median, max)."""
    import statistics

    if not rewards:
        return "-"
    values = sorted({round(r, 2) for r in rewards}, reverse=True)
    if len(values) <= 4:
        return ", ".join(f"{v:.2f} x{sum(round(r, 2) == v for r in rewards)}" for v in values)
    return f"min {min(rewards):.2f}, median {statistics.median(rewards):.2f}, max {max(rewards):.2f}"


def print_json(value: Any) -> None:
    """``value`` as JSON on stdout: dataclasses as objects (snake_case fields), enums by name."""
    import dataclasses
    import enum
    import json

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, enum.Enum):
            return v.name
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [plain(x) for x in v]
        if isinstance(v, float) and v != v:  # a mean over no graded run: JSON has no NaN
            return None
        return v

    print(json.dumps(plain(value), indent=1, allow_nan=False))


def cmd_status(args: argparse.Namespace) -> int:
    from yieldloop.errors import YieldloopError
    from yieldloop.stackdir import card, render_card
    from yieldloop.training import data_dir_of

    try:
        facts = card(data_dir_of(args.attach))
    except YieldloopError as err:
        print(f"yieldloop: {err}", file=sys.stderr)
        return 1
    if args.json:
        print_json(facts)
    else:
        print(render_card(facts))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from yieldloop.errors import NotFoundError, YieldloopError
    from yieldloop.report import write_report
    from yieldloop.training import data_dir_of

    try:
        run_dir = pathlib.Path(args.run)
        if not run_dir.is_dir():
            runs = data_dir_of(args.attach) / "runs"
            run_dir = runs / args.run
            if not run_dir.is_dir():
                known = sorted(p.name for p in runs.iterdir() if p.is_dir()) if runs.is_dir() else []
                raise NotFoundError(
                    f"no run folder {args.run!r} (nor {run_dir}); `yieldloop train` runs there: "
                    f"{', '.join(known[-5:]) or 'none'}",
                    reason="JOB_NOT_FOUND",
                    field="run",
                )
        png, page = write_report(run_dir)
    except YieldloopError as err:
        print(f"yieldloop: {err}", file=sys.stderr)
        return 1
    print(f"report: {page}\nplot: {png}")
    return 0


async def _keys(args: argparse.Namespace) -> None:
    import datetime

    from rich.console import Console
    from rich.table import Table

    console = Console()
    if args.keys_command == "mint":  # nothing to ask a stack: the key's id and secret are random
        import secrets

        print(f"yl_{secrets.token_hex(6)}_{secrets.token_urlsafe(32)}")
        return
    async with _client(args, timeout=60) as client:
        if args.keys_command == "create":
            made = await client.create_api_key(args.team, args.role, args.name)
            console.print(
                f"key {made.info.key_id} for team {made.info.team} ({made.info.role}); it is shown this "
                f"once (stored hashed):",
                markup=False,
            )
            print(made.api_key)
        elif args.keys_command == "list":
            listed = await client.list_api_keys()
            if args.json:
                print_json(listed)
                return
            table = Table("key id", "team", "role", "name", "created", "revoked")
            for key in listed:
                when = [
                    datetime.datetime.fromtimestamp(t).isoformat(" ", "seconds") if t else "-"
                    for t in (key.created_time, key.revoked_time)
                ]
                table.add_row(key.key_id, key.team, key.role, key.name or "-", *when)
            console.print(table)
        else:
            revoked = await client.revoke_api_key(args.key_id)
            console.print(f"revoked {revoked.key_id} (team {revoked.team}, {revoked.role})", markup=False)


async def _models(args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    async with _client(args, timeout=3600 if args.models_command == "import" else 60) as client:
        if args.models_command == "list":
            models = await client.list_models()
            if args.json:
                print_json(models)
                return
            wide = ["parent", "public", "architecture", "dtype", "chat template", "size"] if args.wide else []
            table = Table("model", "base", "owner", "trainable", "kind", "parameters", *wide)
            for m in models:
                more = [
                    m.parent or "-",
                    "yes" if m.public else "no",
                    m.architecture or "-",
                    m.dtype or "-",
                    "yes" if m.has_chat_template else "no",
                    f"{m.size_bytes / 1e6:.3f} MB",
                ]
                table.add_row(
                    m.slug,
                    m.base,
                    m.owner or "-",
                    "yes" if m.trainable else "no",
                    m.kind,
                    f"{m.num_parameters:,}",
                    *(more if args.wide else []),
                )
            console.print(table)
        elif args.models_command == "import":
            done = await client.import_model(args.source, args.name, args.owner, args.public, args.on_server)
            m = done.model
            console.print(
                f"imported {args.source} as {m.slug}: {m.architecture}, {m.num_parameters:,} parameters "
                f"({m.dtype}), chat template {'yes' if m.has_chat_template else 'no'}, "
                f"{m.size_bytes / 1e6:.1f} MB, head {done.head.checkpoint_id}",
                markup=False,
            )
        elif args.models_command == "fork":
            from yieldloop.types import LoraConfig

            lora = None
            if args.lora_rank is not None:
                lora = LoraConfig(args.lora_rank, args.lora_alpha, tuple(args.lora_targets))
            elif args.lora_alpha or args.lora_targets:
                raise SystemExit("yieldloop: --lora-alpha and --lora-targets need --lora-rank")
            forked = await client.fork_model(args.source, args.name, args.owner, lora=lora)
            kind = (
                f"LoRA r={forked.model.lora.rank} over {forked.model.adapter_base_model}@"
                f"{forked.model.adapter_base_checkpoint_id}"
                if forked.model.lora is not None
                else "full"
            )
            console.print(
                f"forked {args.source} -> {forked.model.slug} at {forked.head.checkpoint_id} ({kind})", markup=False
            )
        elif args.models_command == "delete":
            await client.delete_model(args.model, force=args.force)
            console.print(f"deleted {args.model}", markup=False)
        elif args.models_command == "checkpoints":
            listed = await client.list_checkpoints(args.model)
            if args.json:
                print_json(listed)
                return
            table = Table("", "checkpoint", "parent", "step", "stored", "promotion")
            for c in listed:
                decision = {1: "promoted", 2: "not promoted"}.get(c.promotion.state, "") if c.promotion else ""
                if c.promotion and c.promotion.reason:
                    decision += f": {c.promotion.reason}"
                stored = "pending" if c.pending else "weights + state" if c.has_state else "weights"
                table.add_row(
                    ">" if c.is_head else "",
                    c.checkpoint_id,
                    c.parent_checkpoint_id or "-",
                    str(c.step),
                    stored,
                    decision,
                )
            console.print(table)
        elif args.models_command == "discard-gradients":
            dropped = await client.discard_gradients(args.model)
            console.print(f"{args.model}: discarded the gradients of {dropped} datum(s)", markup=False)
        elif args.set_to:
            head = await client.set_head(args.model, args.set_to, expected_checkpoint_id=args.expect)
            console.print(f"{args.model} head -> {head.checkpoint_id} (sequence {head.sequence})")
        else:
            head = await client.get_head(args.model)
            console.print(f"{args.model} head: {head.checkpoint_id} (sequence {head.sequence})")


async def _trace(args: argparse.Namespace) -> None:
    from google.protobuf import json_format
    from rich.console import Console

    from yieldloop.convert import run_to_pb
    from yieldloop.training import failure_message, failure_reason
    from yieldloop.types import RunStatus

    async with _client(args, timeout=60) as client:
        [run] = await client.get_runs([args.trace_id])
        spans = await client.get_trace_spans(run.trace_id) if len(run.trace_id) == 32 else []
    if args.json:
        print(json_format.MessageToJson(run_to_pb(run)))
        return
    console = Console()
    console.print(f"run {run.run_id}  trace {run.trace_id}  group {run.group_id}  model {run.model}")
    console.print(f"task {run.task.env}/{run.task.scenario} {run.task.args_json}", markup=False)
    console.print(f"prompt: {run.prompt}", markup=False)
    for i, turn in enumerate(run.turns):
        console.print(
            f"turn {i}: {len(turn.prompt_token_ids)} prompt + {len(turn.completion_token_ids)} completion "
            f"tokens, weights {turn.weight_version}: {turn.completion_text!r}",
            markup=False,
        )
    if run.status == RunStatus.GRADED:
        console.print(f"answer: {run.answer!r}  reward {run.reward:.3f}  info {run.info_json}", markup=False)
    else:
        console.print(
            f"answer: {run.answer!r}  status {run.status.name} ({failure_reason(run)}): {failure_message(run)}",
            markup=False,
        )
    if spans:
        console.print(span_timeline(spans), markup=False, soft_wrap=True)
    else:
        console.print("no spans recorded for this trace (a stack started with --record-spans records them)")


def span_timeline(spans: list[Any], width: int = 40) -> str:
    """Where the episode's time went: each span (children under their parent) with its start offset, its
    duration, a bar on the episode's time axis, and the service that recorded it."""
    start = min(s.start_time_unix_nano for s in spans)
    total = max(1, max(s.end_time_unix_nano for s in spans) - start)
    children: dict[str, list[Any]] = {}
    ids = {s.span_id for s in spans}
    for s in spans:
        children.setdefault(s.parent_span_id if s.parent_span_id in ids else "", []).append(s)
    lines = [f"spans ({len(spans)}, {total / 1e6:.1f} ms):"]

    def walk(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: s.start_time_unix_nano):
            begin = (s.start_time_unix_nano - start) * width // total
            length = max(1, (s.end_time_unix_nano - s.start_time_unix_nano) * width // total)
            bar = " " * begin + "#" * min(length, width - begin)
            status = f"  {s.status}: {s.error}" if s.status == "ERROR" else ""
            lines.append(
                f"  {(s.start_time_unix_nano - start) / 1e6:8.1f} ms"
                f" {(s.end_time_unix_nano - s.start_time_unix_nano) / 1e6:8.1f} ms"
                f" |{bar:<{width}}| {'  ' * depth}{s.name} [{s.service}]{status}"
            )
            walk(s.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)


def with_errors(coro: Any, attach: pathlib.Path | None = None, suggest: bool = False) -> int:
    """Runs a client command; a yieldloop error becomes one line on stderr and exit status 1 (with ``suggest``, a
    model slug that does not exist gets the closest ones the caller may use)."""
    from yieldloop.errors import YieldloopError

    try:
        run_async(coro)
    except YieldloopError as err:
        hint = run_async(_did_you_mean(err, attach)) if suggest and err.reason == "MODEL_NOT_FOUND" else ""
        print(f"yieldloop: {err}{hint}", file=sys.stderr)
        return 1
    except OSError as err:  # the machine's answer (a file not writable, a disk full): one line too
        print(f"yieldloop: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the command said what it left behind; no traceback
        return 130
    return 0


async def _did_you_mean(err: Any, attach: pathlib.Path | None) -> str:
    """ "; did you mean 'tiny'?" for the slug a MODEL_NOT_FOUND error quotes: the closest of the models the caller's
    key may see ("" when none is close or the stack cannot say)."""
    import difflib
    import re

    from yieldloop.errors import YieldloopError

    quoted = re.search(r"model '([^']+)'", str(err))
    if quoted is None:
        return ""
    try:
        async with _client(argparse.Namespace(attach=attach), timeout=10) as client:
            slugs = [m.slug for m in await client.list_models()]
    except YieldloopError:
        return ""
    close = difflib.get_close_matches(quoted.group(1).partition("@")[0], slugs, n=2, cutoff=0.5)
    return f"; did you mean {' or '.join(repr(c) for c in close)}? (`yieldloop models list`)" if close else ""


def main(argv: list[str] | None = None) -> int:
    parser, handlers = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and handlers.get(args.command) is not _needs_server:  # a stub takes any arguments
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.attach = getattr(args, "attach", None)
    if args.command is None:  # bare `yieldloop`: what there is to do (as git and docker do)
        parser.print_help()
        return 0
    group = _subparsers(parser)[args.command]
    if _subparsers(group) and getattr(args, f"{args.command}_command", None) is None:  # `yieldloop models`
        group.print_help()
        return 0
    quiet_libraries()
    if args.command in handlers:
        return handlers[args.command](args)
    if args.command == "report":
        return cmd_report(args)
    if args.command == "status":
        return cmd_status(args)
    commands = {
        "models": _models,
        "keys": _keys,
        "trace": _trace,
        "eval": _eval,
        "train": _train,
        "jobs": _jobs,
        "export": _export,
    }
    return with_errors(commands[args.command](args), attach=args.attach, suggest=True)


if __name__ == "__main__":
    sys.exit(main())
