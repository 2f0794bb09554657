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


def _add_attach(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--attach",
        type=pathlib.Path,
        default=None,
        help="data directory of a running `yieldloop up` (default: $YIELDLOOP_DATA_DIR or .yieldloop)",
    )


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Any]]:
    """The parser of every subcommand, and each server subcommand's handler."""
    parser = argparse.ArgumentParser(
        prog="yieldloop", description="Self-hosted closed loop from agent evals to RL training data."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    handlers: dict[str, Any] = {}

    models = commands.add_parser("models", help="models, checkpoints and heads of a running stack")
    _add_attach(models)
    model_commands = models.add_subparsers(dest="models_command", required=True)
    model_commands.add_parser("list", help="every model, with its base, parent, owner and whether it is trainable")
    imported = model_commands.add_parser(
        "import",
        help="a Hugging Face model (a folder, or a hub id in the local cache: nothing is downloaded) as a new "
        "base slug; its weights become the checkpoint 'base'",
    )
    imported.add_argument(
        "source",
        help="a model folder on this machine (uploaded), or a hub id (org/name) in the "
        "checkpoint service's Hugging Face cache",
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
    fork.add_argument("--name", required=True)
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
    delete.add_argument("model")
    delete.add_argument("--force", action="store_true", help="delete even though forks exist (they keep working)")
    checkpoints = model_commands.add_parser("checkpoints", help="a model's checkpoint tree, oldest first (> = HEAD)")
    checkpoints.add_argument("model")
    discard = model_commands.add_parser(
        "discard-gradients",
        help="forget the gradients accumulated for a model since its last step (every "
        "caller's), e.g. after a step refused as NON_FINITE or HEAD_CONFLICT",
    )
    discard.add_argument("model")
    head = model_commands.add_parser("head", help="show a model's head, or move it with --set (rollback, branch)")
    head.add_argument("model")
    head.add_argument("--set", dest="set_to", metavar="CHECKPOINT")
    head.add_argument("--expect", default="", metavar="CHECKPOINT", help="only if the head is this (compare-and-swap)")

    keys = commands.add_parser("keys", help="API keys of a running stack (needs an admin key)")
    _add_attach(keys)
    key_commands = keys.add_subparsers(dest="keys_command", required=True)
    created = key_commands.add_parser("create", help="a new key for a team; printed once, stored only hashed")
    created.add_argument("--team", required=True)
    created.add_argument(
        "--role",
        required=True,
        choices=("sample", "train", "admin"),
        help="sample: roll out and sample the team's and public models; train: also fork, import, "
        "train and move the head of the team's models; admin: keys and every model",
    )
    created.add_argument("--name", default="", help="a label for `keys list`")
    key_commands.add_parser("list", help="every key (never a secret), revoked ones marked")
    key_commands.add_parser(
        "mint",
        help="print a new key, offline, for a deployment's Secret (YIELDLOOP_ADMIN_KEY, "
        "YIELDLOOP_SERVICE_KEY: the services register it at start)",
    )
    revoked = key_commands.add_parser("revoke", help="revoke a key: every service refuses it within seconds")
    revoked.add_argument("key_id")

    evaluate = commands.add_parser("eval", help="run a taskset against a model as a job (group rollouts per task)")
    evaluate.add_argument("tasks", help="taskset: a .py/.json/.jsonl file or module:attr")
    evaluate.add_argument("model", help="model slug the rollout service serves")
    evaluate.add_argument("--group", type=int, default=8, help="episodes per task (default 8)")
    evaluate.add_argument("--max-concurrent", type=int, default=0, help="episodes in flight at once (0: all)")
    evaluate.add_argument("--max-tokens", type=int, default=16, help="tokens per model turn (default 16)")
    evaluate.add_argument("--temperature", type=float, default=1.0)
    evaluate.add_argument("--max-steps", type=int, default=0, help="model turns per episode (0: 8)")
    evaluate.add_argument("--checkpoint", default="", help="sample this checkpoint instead of the head")
    evaluate.add_argument("--name", default="", help="job name")
    _add_attach(evaluate)

    train = commands.add_parser("train", help="the closed loop from a config file (.toml or .json), on a running stack")
    train.add_argument("config", type=pathlib.Path)
    _add_attach(train)

    jobs = commands.add_parser("jobs", help="recorded jobs (evals and training sessions), oldest first")
    _add_attach(jobs)

    trace = commands.add_parser(
        "trace",
        help="print a recorded run (prompt, turns, reward) by trace id, and where its time went when spans were "
        "recorded",
    )
    trace.add_argument("trace_id")
    trace.add_argument("--json", action="store_true", help="the run as JSON")
    _add_attach(trace)

    export = commands.add_parser("export", help="write a job's graded runs as RFT JSONL or token-level JSONL/Parquet")
    export.add_argument("job")
    export.add_argument("--format", default="jsonl", choices=("jsonl", "parquet"))
    export.add_argument(
        "--kind",
        default="",
        choices=("", "rft", "tokens"),
        help="rft: prompt/completion/reward; tokens: token ids, logprobs, masks, rewards, group ids "
        "(default: rft for jsonl, tokens for parquet)",
    )
    export.add_argument("--out", type=pathlib.Path, help="output file (default: <job>.<kind>.<format>)")
    _add_attach(export)

    report = commands.add_parser("report", help="write report.png and report.html for a training run")
    report.add_argument("run", help="a run directory, or the job id of a `yieldloop train` run in --attach/runs/")
    _add_attach(report)

    handlers.update(_plugins(commands))
    for name, text in SERVER_COMMANDS.items():
        if name not in handlers:
            commands.add_parser(name, help=f"{text} (needs the server distribution)", add_help=False)
            handlers[name] = _needs_server
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


async def run_loop(client: Any, config: Any, run_root: pathlib.Path, console: Any, **tasks: Any) -> dict[str, Any]:
    """Runs the closed loop with a progress bar and per-step lines; writes the report; returns a summary."""
    import time

    from yieldloop.loop import Baseline, closed_loop
    from yieldloop.report import write_report

    baseline: list[Baseline] = []
    steps = []
    started = time.perf_counter()
    with _progress(console) as progress:
        bar = progress.add_task("training steps", total=config.steps)
        async for report in closed_loop(client, config, runs_dir=run_root, baseline=baseline, **tasks):
            if not steps and baseline:
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
    elapsed = time.perf_counter() - started
    job_id = steps[-1].job_id
    png, page = write_report(run_root / job_id)
    return {
        "steps": steps,
        "baseline": baseline[0] if baseline else None,
        "elapsed_s": elapsed,
        "report": page,
        "png": png,
        "job_id": job_id,
    }


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
    async with _client(args) as client:
        await client.get_head(config.model)
        summary = await run_loop(client, config, data_dir_of(args.attach) / "runs", console, **tasks)
    print_summary(console, summary, config.target_heldout_reward)


async def _eval(args: argparse.Namespace) -> None:
    import collections

    from rich.console import Console
    from rich.table import Table

    from yieldloop.loop import load_tasks
    from yieldloop.training import Agent, Job, mean_reward, report_groups_without_spread, run_tasks
    from yieldloop.types import RunStatus

    tasks = load_tasks(args.tasks)
    console = Console()
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
    table = Table("task", "runs", "mean reward", "rewards")
    for name, task_runs in by_task.items():
        table.add_row(
            name,
            str(len(task_runs)),
            f"{mean_reward(task_runs):.3f}",
            " ".join(f"{r.reward:.2f}" if r.status == RunStatus.GRADED else "err" for r in task_runs),
        )
    console.print(table)
    flat = report_groups_without_spread(runs)
    errors = sum(run.status != RunStatus.GRADED for run in runs)
    console.print(
        f"job {job.id}: {len(runs)} runs, mean reward {mean_reward(runs):.3f}, "
        f"{len(flat)} group(s) without reward spread, {errors} not graded"
    )
    console.print(f"export: yieldloop export {job.id} --format jsonl", markup=False)


async def _jobs(args: argparse.Namespace) -> None:
    import datetime

    from rich.console import Console
    from rich.table import Table

    async with _client(args, timeout=60) as client:
        jobs = await client.list_jobs()
    table = Table("job", "name", "model", "group", "runs", "created")
    for job in jobs:
        created = datetime.datetime.fromtimestamp(job.created_time).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(job.job_id, job.name, job.model, str(job.group_size or "-"), str(job.num_runs), created)
    Console().print(table)


async def _export(args: argparse.Namespace) -> None:
    from rich.console import Console

    from yieldloop.export import export_runs

    console = Console()
    kind = args.kind or ("rft" if args.format == "jsonl" else "tokens")
    out = args.out or pathlib.Path(f"{args.job}.{kind}.{args.format}")
    async with _client(args) as client:
        with console.status(f"reading the runs of {args.job}..."):
            runs = [run async for run in client.job_runs(args.job)]
    count = export_runs(runs, out, args.format, kind)
    console.print(f"wrote {count} graded run(s) of {len(runs)} to {out} ({kind}, {args.format})")


def cmd_report(args: argparse.Namespace) -> int:
    from yieldloop.errors import YieldloopError
    from yieldloop.report import write_report
    from yieldloop.training import data_dir_of

    run_dir = pathlib.Path(args.run)
    if not run_dir.is_dir():
        run_dir = data_dir_of(args.attach) / "runs" / args.run
    if not run_dir.is_dir():
        print(f"yieldloop: no run directory {args.run!r} (nor {run_dir})", file=sys.stderr)
        return 1
    try:
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
            table = Table("key id", "team", "role", "name", "created", "revoked")
            for key in await client.list_api_keys():
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
            table = Table(
                "model",
                "base",
                "parent",
                "owner",
                "public",
                "trainable",
                "kind",
                "architecture",
                "parameters",
                "dtype",
                "chat template",
                "size",
            )
            for m in await client.list_models():
                table.add_row(
                    m.slug,
                    m.base,
                    m.parent or "-",
                    m.owner or "-",
                    "yes" if m.public else "no",
                    "yes" if m.trainable else "no",
                    m.kind,
                    m.architecture or "-",
                    f"{m.num_parameters:,}",
                    m.dtype or "-",
                    "yes" if m.has_chat_template else "no",
                    f"{m.size_bytes / 1e6:.3f} MB",
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
            table = Table("", "checkpoint", "parent", "step", "stored", "promotion")
            for c in await client.list_checkpoints(args.model):
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
    console.print(f"answer: {run.answer!r}  reward {run.reward:.3f}  info {run.info_json}", markup=False)
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


def with_errors(coro: Any) -> int:
    """Runs a client command; a yieldloop error becomes one line on stderr and exit status 1."""
    from yieldloop.errors import YieldloopError

    try:
        run_async(coro)
    except YieldloopError as err:
        print(f"yieldloop: {err}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser, handlers = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and handlers.get(args.command) is not _needs_server:  # a stub takes any arguments
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    quiet_libraries()
    if args.command in handlers:
        return handlers[args.command](args)
    if args.command == "report":
        return cmd_report(args)
    commands = {
        "models": _models,
        "keys": _keys,
        "trace": _trace,
        "eval": _eval,
        "train": _train,
        "jobs": _jobs,
        "export": _export,
    }
    return with_errors(commands[args.command](args))


if __name__ == "__main__":
    sys.exit(main())
