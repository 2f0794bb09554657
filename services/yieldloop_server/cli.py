"""The server subcommands of the ``yieldloop`` command: ``serve``, ``up``, ``demo`` and ``plan``.

The client distribution owns the command; this module is its plugin (entry point group
``yieldloop.commands``). Every flag comes from :mod:`yieldloop_server.config`.
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

from yieldloop.cli import SERVER_COMMANDS, add_attach, print_summary, run_async, run_loop
from yieldloop_server.config import UP_BASE_PORT, ServeOptions, StackConfig, add_arguments, from_arguments


def register(commands: Any) -> dict[str, Any]:
    """Adds ``serve``, ``up`` and ``demo`` to the ``yieldloop`` subparsers; returns their handlers."""
    serve = commands.add_parser("serve", help=SERVER_COMMANDS["serve"])
    add_arguments(serve, ServeOptions)

    up = commands.add_parser("up", help=SERVER_COMMANDS["up"])
    add_arguments(up, StackConfig, defaults={"base_port": UP_BASE_PORT})

    demo = commands.add_parser("demo", help=SERVER_COMMANDS["demo"])
    add_arguments(demo, StackConfig, skip=("data_dir", "hud", "hud_port"))
    demo.add_argument("--data-dir", type=pathlib.Path, help="data directory (default: a new temporary one)")
    add_attach(demo)
    demo.add_argument("--steps", type=int, default=30, help="optimizer steps at most (default 30)")
    demo.add_argument("--target", type=float, default=0.8, help="stop once held-out reward reaches this (default 0.8)")
    demo.add_argument("--group-size", type=int, default=8, help="episodes per task: a GRPO group (default 8)")
    demo.add_argument("--learning-rate", type=float, help="AdamW learning rate (default: the loop's, 1e-3)")

    plan = commands.add_parser("plan", help=SERVER_COMMANDS["plan"])
    plan.add_argument("model", help="a folder or config.json, a hub id in the local HF cache, or a model in the store")
    plan.add_argument("--gpu", default="h200", help="h100, h200 or the GiB of one GPU (default h200)")
    plan.add_argument(
        "--lora-rank", type=int, default=0, help="train a LoRA adapter of this rank (default: all weights)"
    )
    plan.add_argument("--seq-len", type=int, default=8192, help="tokens of an episode (default 8192)")
    plan.add_argument("--micro-batch-tokens", type=int, default=0, help="tokens per micro-batch (default: --seq-len)")
    plan.add_argument("--group", type=int, default=8, help="episodes per task (default 8)")
    plan.add_argument("--envs", type=int, default=2048, help="parallel environments (default 2048)")
    plan.add_argument("--concurrency", type=int, default=256, help="sequences per rollout server (default 256)")
    plan.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="vLLM's share of a GPU (0.85)")
    plan.add_argument("--store", default="", help="the object store to find MODEL in (default: DATA_DIR/store)")
    plan.add_argument(
        "--data-dir",
        type=pathlib.Path,
        default=pathlib.Path(".yieldloop"),
        help="the stack whose store to find MODEL in (default .yieldloop)",
    )
    plan.add_argument("--json", action="store_true", help="print the whole plan as JSON")
    return {"serve": cmd_serve, "up": cmd_up, "demo": cmd_demo, "plan": cmd_plan}


def cmd_plan(args: argparse.Namespace) -> int:
    import json
    import sys

    from yieldloop.errors import YieldloopError
    from yieldloop_server.plan import Inputs, gpu_gib, load_config, make_plan, render

    try:
        inputs = Inputs(
            gpu_gib=gpu_gib(args.gpu),
            gpu=args.gpu,
            seq_len=args.seq_len,
            micro_batch_tokens=args.micro_batch_tokens,
            group=args.group,
            envs=args.envs,
            lora_rank=args.lora_rank,
            concurrency=args.concurrency,
            gpu_memory_utilization=args.gpu_memory_utilization,
        ).validate()
        store = args.store or str(args.data_dir / "store")
        config, source = load_config(args.model, store if pathlib.Path(store).exists() or "://" in store else "")
        plan = make_plan(config, inputs, source)
    except YieldloopError as err:
        print(f"yieldloop: {err}", file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=1) if args.json else render(plan))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from yieldloop_server.serve import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_async(serve(from_arguments(args, ServeOptions)))
    return 0


async def _up(config: StackConfig) -> None:
    import asyncio
    import signal

    from rich.console import Console

    from yieldloop.stackdir import card, render_card
    from yieldloop_server.stack import ProcessStack

    console = Console()
    stack = ProcessStack(config, progress=lambda line: console.print(line, markup=False, soft_wrap=True))
    with console.status("starting checkpoint, env, trainer and rollout services (and the HUD front)..."):
        addresses = await stack.start()
    console.print(render_card(card(stack.config.data_dir)), markup=False, soft_wrap=True)
    if not stack.api_key:
        console.print(
            "[bold red]AUTH IS OFF (--no-auth):[/] anyone who reaches these ports may train and move the "
            "head of any model and read every run"
        )
    console.print(f"`yieldloop status` prints this again; {len(addresses)} services up; Ctrl-C stops", markup=False)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    with console.status("stopping..."):
        await stack.stop()


def cmd_up(args: argparse.Namespace) -> int:
    from yieldloop.cli import with_errors

    return with_errors(_up(from_arguments(args, StackConfig)))


async def _demo(args: argparse.Namespace) -> None:
    import tempfile

    from rich.console import Console

    from yieldloop.client import Client
    from yieldloop.envs.letters import TASKS
    from yieldloop.loop import LoopConfig
    from yieldloop.training import stack_addresses, stack_api_key, stack_tls_ca
    from yieldloop.transport import TransportConfig

    console = Console()
    stack = None
    if args.attach:  # main() sets it, given or not
        addresses = stack_addresses(args.attach)
        data_dir = args.attach
        api_key, ca = stack_api_key(args.attach), stack_tls_ca(args.attach)
    else:
        from yieldloop_server.stack import ProcessStack

        data_dir = args.data_dir or pathlib.Path(tempfile.mkdtemp(prefix="yieldloop-demo-"))
        stack = ProcessStack(
            from_arguments(args, StackConfig, data_dir=pathlib.Path(data_dir).resolve(), hud=False),
            progress=lambda line: console.print(line, markup=False, soft_wrap=True),
        )
        with console.status("starting the four services..."):
            addresses = await stack.start()
        api_key, ca = stack.api_key, stack.config.transport.tls_ca
        console.print(f"services up: {addresses}")
    overrides = {"learning_rate": args.learning_rate} if args.learning_rate else {}
    config = LoopConfig(
        **TASKS,
        model=args.model,
        steps=args.steps,
        target_heldout_reward=args.target,
        group_size=args.group_size,
        name="demo",
        **overrides,
    ).validate("demo")
    console.print(
        f"GRPO on {config.train_tasks} (group {config.group_size}), promotion gate on {config.heldout_tasks} "
        f"(disjoint), until held-out reward >= {config.target_heldout_reward:g} or {config.steps} steps"
    )
    try:
        async with Client(**addresses, timeout=300, api_key=api_key, transport=TransportConfig(tls_ca=ca)) as client:
            summary = await run_loop(client, config, pathlib.Path(data_dir) / "runs", console)
        print_summary(console, summary, config.target_heldout_reward)
        if stack is not None:
            console.print(f"data kept in {stack.config.data_dir}")
    finally:
        if stack is not None:
            await stack.stop()


def cmd_demo(args: argparse.Namespace) -> int:
    from yieldloop.cli import with_errors

    return with_errors(_demo(args))
