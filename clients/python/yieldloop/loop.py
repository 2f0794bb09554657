"""The closed loop over the four services: eval a group per task -> train -> checkpoint -> head -> reload.

This is the walking skeleton ``yieldloop demo`` runs; each iteration is
reported with the weight version that sampled its runs and the one the
rollout server serves afterwards.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import AsyncIterator, Sequence

from yieldloop.client import Client, sampling_params
from yieldloop.common.v1 import common_pb2 as common_pb
from yieldloop.environment import Task


@dataclasses.dataclass
class IterationReport:
    iteration: int
    num_runs: int
    mean_reward: float
    loss_sum: float
    num_groups_without_signal: int
    sampled_weight_versions: list[str]
    """Weight versions the runs of this iteration were sampled with."""
    checkpoint_id: str
    """Checkpoint the optimizer step committed (and moved HEAD to)."""
    served_weight_version: str
    """What the rollout server serves after the reload."""
    rollout_s: float
    train_s: float
    reload_s: float


async def closed_loop(
    client: Client,
    tasks: Sequence[Task | common_pb.Task],
    *,
    iterations: int,
    group_size: int = 8,
    learning_rate: float = 1e-3,
    max_tokens: int = 12,
    temperature: float = 1.0,
    loss_fn: str = "importance_sampling",
    reload_timeout_s: float = 120.0,
) -> AsyncIterator[IterationReport]:
    """Runs ``iterations`` loop iterations and yields a report after each."""
    sampling = sampling_params(temperature=temperature, max_tokens=max_tokens)
    for iteration in range(1, iterations + 1):
        started = time.perf_counter()
        runs = [run async for run in client.stream_rollouts(tasks, group_size=group_size, sampling=sampling)]
        rolled = time.perf_counter()
        graded = [run.reward for run in runs if run.status == common_pb.RUN_STATUS_GRADED]
        result = await client.forward_backward(runs=runs, loss_fn=loss_fn)
        step = await client.optim_step(learning_rate, set_head=True)
        trained = time.perf_counter()
        info = await client.get_serving_info(
            wait_for_checkpoint_id=step.checkpoint.checkpoint_id, timeout=reload_timeout_s
        )
        reloaded = time.perf_counter()
        yield IterationReport(
            iteration=iteration,
            num_runs=len(runs),
            mean_reward=statistics.fmean(graded) if graded else float("nan"),
            loss_sum=result.loss_sum,
            num_groups_without_signal=result.num_groups_without_signal,
            sampled_weight_versions=sorted({t.weight_version for run in runs for t in run.turns}),
            checkpoint_id=step.checkpoint.checkpoint_id,
            served_weight_version=info.weight_version,
            rollout_s=rolled - started,
            train_s=trained - rolled,
            reload_s=reloaded - trained,
        )
