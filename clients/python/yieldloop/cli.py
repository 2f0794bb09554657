"""The ``yieldloop`` command line: ``serve``, ``up`` and ``demo``.

Only argparse is imported up front so ``yieldloop --help`` is instant; each
command imports what it needs.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
from typing import Any

SERVICES = ("checkpoint", "env", "trainer", "rollout")
DEFAULT_ENV_SPEC = "yieldloop.envs.letters:env"


def quiet_libraries() -> None:
    """No hub access and no download/progress chatter from the ML libraries."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _run(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:  # uvloop is optional off Linux/macOS
        import asyncio

        return asyncio.run(coro)
    return uvloop.run(coro)


def _add_stack_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="model slug served and trained (default: tiny)")
    parser.add_argument("--env-spec", action="append", dest="env_specs",
                        help=f"environment module:attr or file.py:attr (repeatable; default {DEFAULT_ENV_SPEC})")
    parser.add_argument("--env-workers", type=int, default=2,
                        help="EnvService worker processes running environment code (0: in-process; default 2)")
    parser.add_argument("--engine", default="torch", choices=("torch", "vllm"),
                        help="rollout engine: torch (default) or vllm (pip install 'yieldloop[vllm]')")
    parser.add_argument("--http-port", type=int, default=0,
                        help="rollout: OpenAI-compatible HTTP endpoint port (0: a free one, -1: off; default 0)")
    parser.add_argument("--device", default="cpu", help="torch device for trainer and engine (default: cpu)")
    parser.add_argument("--nproc", type=int, default=1,
                        help="trainer ranks, data parallel (gloo on CPU, NCCL on CUDA; default 1)")
    parser.add_argument("--trainer-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="trainer weights dtype (auto: bfloat16 on CUDA, float32 elsewhere)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--keep-last", type=int, default=0,
                        help="checkpoint retention: keep the last K plus every one that was ever head (0: all)")
    parser.add_argument("--store", default="",
                        help="object store: a path or s3://bucket/prefix (default: DATA_DIR/store)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="yieldloop", description="Self-hosted closed loop from agent evals to RL training data."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run one service in this process")
    serve.add_argument("service", choices=SERVICES)
    serve.add_argument("--port", type=int, default=0, help="port to bind (0: a free one; see --ready-file)")
    serve.add_argument("--data-dir", type=pathlib.Path, default=pathlib.Path(".yieldloop"))
    serve.add_argument("--checkpoint-address", default="", help="CheckpointService host:port (trainer, rollout)")
    serve.add_argument("--env-address", default="", help="EnvService host:port (rollout)")
    serve.add_argument("--ready-file", type=pathlib.Path, help="write {address} here once serving")
    serve.add_argument("--max-message-bytes", type=int, default=0, help="largest gRPC message accepted (0: 64 MiB)")
    _add_stack_args(serve)

    up = commands.add_parser("up", help="start all four services on localhost (the embedded default)")
    up.add_argument("--data-dir", type=pathlib.Path, default=pathlib.Path(".yieldloop"))
    _add_stack_args(up)

    models = commands.add_parser("models", help="models, checkpoints and heads of a running stack")
    models.add_argument("--attach", type=pathlib.Path, default=pathlib.Path(".yieldloop"),
                        help="data directory of a running `yieldloop up` (default: .yieldloop)")
    model_commands = models.add_subparsers(dest="models_command", required=True)
    model_commands.add_parser("list", help="every model, with its base, parent, owner and whether it is trainable")
    fork = model_commands.add_parser("fork", help="a new model starting from a model's head (objects shared)")
    fork.add_argument("source")
    fork.add_argument("--name", required=True)
    fork.add_argument("--owner", default="")
    checkpoints = model_commands.add_parser("checkpoints", help="a model's checkpoint tree, oldest first")
    checkpoints.add_argument("model")
    head = model_commands.add_parser("head", help="show a model's head, or move it with --set (rollback, branch)")
    head.add_argument("model")
    head.add_argument("--set", dest="set_to", metavar="CHECKPOINT")
    head.add_argument("--expect", default="", metavar="CHECKPOINT", help="only if the head is this (compare-and-swap)")

    trace = commands.add_parser("trace", help="print a recorded run (prompt, turns, reward) by trace id")
    trace.add_argument("trace_id")
    trace.add_argument("--attach", type=pathlib.Path, default=pathlib.Path(".yieldloop"))
    trace.add_argument("--json", action="store_true", help="the run as JSON")

    demo = commands.add_parser("demo", help="run the closed loop on the embedded default and print each iteration")
    demo.add_argument("--data-dir", type=pathlib.Path, help="data directory (default: a new temporary one)")
    demo.add_argument("--attach", type=pathlib.Path, help="use the services of a running `yieldloop up --data-dir DIR`")
    demo.add_argument("--iterations", type=int, default=3)
    demo.add_argument("--group-size", type=int, default=8)
    demo.add_argument("--letters", default="abcdefgh", help="one task per letter (default: abcdefgh)")
    demo.add_argument("--learning-rate", type=float, default=1e-3)
    demo.add_argument("--max-tokens", type=int, default=12)
    _add_stack_args(demo)
    return parser


def _stack_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The options every service of a stack shares (the `_add_stack_args` flags)."""
    return {
        "model": args.model,
        "env_specs": tuple(args.env_specs or (DEFAULT_ENV_SPEC,)),
        "env_workers": args.env_workers,
        "engine": args.engine,
        "http_port": args.http_port,
        "device": args.device,
        "trainer_dtype": args.trainer_dtype,
        "nproc": args.nproc,
        "host": args.host,
        "store": args.store,
        "keep_last": args.keep_last,
    }


def _stack_config(args: argparse.Namespace, data_dir: pathlib.Path) -> Any:
    from yieldloop.services.stack import StackConfig

    return StackConfig(data_dir=data_dir.resolve(), **_stack_fields(args))


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from yieldloop.services.serve import ServeOptions, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    options = ServeOptions(
        service=args.service,
        data_dir=args.data_dir.resolve(),
        port=args.port,
        checkpoint_address=args.checkpoint_address,
        env_address=args.env_address,
        max_message_bytes=args.max_message_bytes,
        ready_file=args.ready_file,
        **_stack_fields(args),
    )
    _run(serve(options))
    return 0


async def _up(args: argparse.Namespace) -> None:
    import asyncio
    import signal

    from rich.console import Console

    from yieldloop.services.stack import ProcessStack

    console = Console()
    stack = ProcessStack(_stack_config(args, args.data_dir))
    with console.status("starting checkpoint, env, trainer and rollout services..."):
        addresses = await stack.start()
    for service, address in addresses.items():
        console.print(f"  {service:<11} {address}")
    console.print(f"data in {stack.config.data_dir}; logs in {stack.config.data_dir / 'logs'}; Ctrl-C stops")
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    with console.status("stopping..."):
        await stack.stop()


def cmd_up(args: argparse.Namespace) -> int:
    _run(_up(args))
    return 0


def _read_addresses(data_dir: pathlib.Path) -> dict[str, str]:
    import json

    return {s: json.loads((data_dir / "run" / f"{s}.json").read_text())["address"] for s in SERVICES}


async def _demo(args: argparse.Namespace) -> None:
    import tempfile

    from rich.console import Console
    from rich.progress import Progress

    from yieldloop.client import Client
    from yieldloop.envs.letters import tasks as letter_tasks
    from yieldloop.loop import closed_loop

    console = Console()
    stack = None
    if args.attach:
        addresses = _read_addresses(args.attach)
    else:
        from yieldloop.services.stack import ProcessStack

        data_dir = args.data_dir or pathlib.Path(tempfile.mkdtemp(prefix="yieldloop-demo-"))
        stack = ProcessStack(_stack_config(args, data_dir))
        with console.status("starting the four services (creating the tiny model offline on first use)..."):
            addresses = await stack.start()
        console.print(f"services up: {addresses}")
    tasks = letter_tasks(args.letters)
    console.print(f"closed loop: {len(tasks)} tasks x group {args.group_size}, {args.iterations} iterations")
    try:
        async with Client(**addresses, timeout=300) as client:
            with Progress(console=console, transient=True) as progress:
                bar = progress.add_task("iterations", total=args.iterations)
                async for report in closed_loop(
                    client, tasks, iterations=args.iterations, group_size=args.group_size,
                    learning_rate=args.learning_rate, max_tokens=args.max_tokens,
                ):
                    progress.console.print(
                        f"iteration {report.iteration}: mean reward {report.mean_reward:.3f}  "
                        f"loss {report.loss_sum:+.4f}  sampled by {','.join(report.sampled_weight_versions)}  "
                        f"-> checkpoint {report.checkpoint_id}  now serving {report.served_weight_version}  "
                        f"(rollout {report.rollout_s:.1f}s, train {report.train_s:.1f}s, reload {report.reload_s:.1f}s)",
                        soft_wrap=True,
                    )
                    progress.advance(bar)
        if stack is not None:
            console.print(f"data kept in {stack.config.data_dir}")
    finally:
        if stack is not None:
            await stack.stop()


async def _models(args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    from yieldloop.client import Client

    console = Console()
    async with Client(**_read_addresses(args.attach), timeout=60) as client:
        if args.models_command == "list":
            table = Table("model", "base", "parent", "owner", "trainable")
            for m in (await client.list_models()).models:
                table.add_row(m.slug, m.base, m.parent or "-", m.owner or "-", "yes" if m.trainable else "no")
            console.print(table)
        elif args.models_command == "fork":
            forked = await client.fork_model(args.source, args.name, args.owner)
            console.print(f"forked {args.source} -> {forked.model.slug} at {forked.head.checkpoint_id}")
        elif args.models_command == "checkpoints":
            table = Table("checkpoint", "parent", "step", "head")
            for c in (await client.list_checkpoints(args.model)).checkpoints:
                table.add_row(c.checkpoint_id, c.parent_checkpoint_id or "-", str(c.step), "*" if c.is_head else "")
            console.print(table)
        elif args.set_to:
            head = await client.set_head(args.model, args.set_to, expected_checkpoint_id=args.expect)
            console.print(f"{args.model} head -> {head.checkpoint_id} (sequence {head.sequence})")
        else:
            head = await client.get_head(args.model)
            console.print(f"{args.model} head: {head.checkpoint_id} (sequence {head.sequence})")


async def _trace(args: argparse.Namespace) -> None:
    from google.protobuf import json_format
    from rich.console import Console

    from yieldloop.client import Client

    async with Client(**_read_addresses(args.attach), timeout=60) as client:
        [run] = await client.get_runs([args.trace_id])
    if args.json:
        print(json_format.MessageToJson(run))
        return
    console = Console()
    console.print(f"run {run.run_id}  trace {run.trace_id}  group {run.group_id}  model {run.model}")
    console.print(f"task {run.task.env}/{run.task.scenario} {run.task.args_json}")
    console.print(f"prompt: {run.prompt}")
    for i, turn in enumerate(run.turns):
        console.print(f"turn {i}: {len(turn.prompt_token_ids)} prompt + {len(turn.completion_token_ids)} completion "
                      f"tokens, weights {turn.weight_version}: {turn.completion_text!r}", markup=False)
    console.print(f"answer: {run.answer!r}  reward {run.reward:.3f}  info {run.info_json}", markup=False)


def _with_errors(coro: Any) -> int:
    """Runs a client command; a yieldloop error becomes one line on stderr and exit status 1."""
    from yieldloop.errors import YieldloopError

    try:
        _run(coro)
    except YieldloopError as err:
        print(f"yieldloop: {err}", file=sys.stderr)
        return 1
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    return _with_errors(_models(args))


def cmd_trace(args: argparse.Namespace) -> int:
    return _with_errors(_trace(args))


def cmd_demo(args: argparse.Namespace) -> int:
    _run(_demo(args))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_libraries()
    handlers = {"serve": cmd_serve, "up": cmd_up, "demo": cmd_demo, "models": cmd_models, "trace": cmd_trace}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
