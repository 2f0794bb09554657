"""Measures sampler/trainer logprob agreement through the real services.

Starts the four services in-process on a fresh data directory, rolls out every
``letters`` task ``--group-size`` times, asks TrainerService.Forward for the
learner's logprobs of the same tokens, and prints the largest absolute
difference against the logprobs RolloutService streamed.

Usage: ``python loadtest/consistency.py [--group-size 8] [--max-tokens 32] [--device cpu]``
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from scratch import scratch_dir


async def measure(group_size: int, max_tokens: int, device: str) -> None:
    from yieldloop.client import Client, sampling_params
    from yieldloop.envs.letters import tasks
    from yieldloop_server.stack import InProcessStack, StackConfig

    stack = InProcessStack(StackConfig(data_dir=scratch_dir("yl-consistency-"), device=device))
    await stack.start()
    try:
        async with Client(**stack.addresses, api_key=stack.api_key) as client:
            # ignore_eos: every completion runs its whole budget (the warmed-up base model ends early).
            sampling = sampling_params(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
            runs = [run async for run in client.stream_rollouts(tasks(), group_size=group_size, sampling=sampling)]
            learner = await client.forward(runs=runs)
        worst, num_tokens = 0.0, 0
        for run, logprobs in zip(runs, learner, strict=True):
            turn = run.turns[0]
            ours = logprobs[len(turn.prompt_token_ids) - 1 :]
            worst = max(worst, max(abs(a - b) for a, b in zip(ours, turn.completion_logprobs, strict=True)))
            num_tokens += len(ours)
        print(f"device={device} runs={len(runs)} completion_tokens={num_tokens} max_abs_logprob_diff={worst:.2e}")
    finally:
        await stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    from yieldloop.cli import quiet_libraries

    quiet_libraries()
    asyncio.run(measure(args.group_size, args.max_tokens, args.device))


if __name__ == "__main__":
    main()
