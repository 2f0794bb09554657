"""A HUD SDK training script, as a HUD user writes one against HUD's cloud: nothing in it knows about yieldloop.
The test runs it with only the HUD_* variables of ``DATA_DIR/run/hud.env`` set, and reads what it writes (one
JSON object) to check it against the stack.

``python train_with_hud.py BASE MODEL OUT.json``: forks BASE as MODEL, samples and trains it.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import sys

from hud import Job, LocalRuntime, Taskset, TrainingClient
from hud.agents import create_agent
from hud.agents.types import AgentStep
from hud.train import TrajectoryPayload
from hud.utils.platform import PlatformClient

HERE = pathlib.Path(__file__).parent
GROUP = 4


def samples_of(run) -> list[dict]:
    """The token samples the agent recorded for each model turn of a run."""
    samples = run.trace.collect(lambda step: step.sample if isinstance(step, AgentStep) else None)
    return [
        {
            "prompt_token_ids": s.prompt_token_ids,
            "output_token_ids": s.output_token_ids,
            "output_logprobs": s.output_logprobs,
        }
        for s in samples
    ]


async def rollout(model: str, taskset: Taskset, runtime: LocalRuntime, name: str, **completion) -> Job:
    agent = create_agent(
        model, completion_kwargs={"max_tokens": 8, **completion, "extra_body": {"return_token_ids": True}}
    )
    job = await Job.start(name, group=GROUP)
    await taskset.run(agent, runtime=runtime, group=GROUP, job=job)
    return job


async def main(base: str, model: str) -> dict:
    out: dict = {}
    # Fork a model of our own, as `hud models fork` does.
    forked = PlatformClient.from_settings().post("/models/fork", json={"source_model_id": base, "name": model})
    out["forked"] = forked
    sys.path.insert(0, str(HERE))
    import letters_env

    taskset = Taskset("letters", letters_env.tasks)
    runtime = LocalRuntime(letters_env.env)
    trainer = TrainingClient(model)
    out["losses"] = await trainer.available_losses()
    out["head_before"] = (await trainer.head()).id

    job = await rollout(model, taskset, runtime, "hud-train-1")
    out["job_id"] = job.id
    out["runs"] = [{"trace_id": run.trace_id, "reward": run.reward, "samples": samples_of(run)} for run in job.runs]

    result = await trainer.step(job.runs, learning_rate=1e-3, group_size=GROUP)
    out["step"] = result.model_dump()
    out["head_after_step"] = (await trainer.head()).id

    # The next rollout samples the new head (the test checks the weight versions the stack recorded).
    job2 = await rollout(model, taskset, runtime, "hud-train-2")
    out["runs_after_step"] = [run.trace_id for run in job2.runs]

    # A custom loss: forward, then the gradient of -(advantage * logprob) on the sampled tokens, sent as weights.
    forward = await trainer.forward(job2.runs, group_size=GROUP)
    weights = []
    for datum in forward.data:
        group = [d.reward for d in forward.data if d.group_idx == datum.group_idx]
        advantage = datum.reward - sum(group) / len(group)
        weights.append([advantage * m for m in datum.mask])
    backward = await trainer.backward(forward.forward_id, weights, metrics={"custom": 1.0})
    out["backward"] = backward.model_dump()
    out["forward_lengths"] = [[len(d.logprobs), len(d.sampling_logprobs), len(d.mask)] for d in forward.data]
    custom = await trainer.optim_step(learning_rate=1e-3)
    out["custom_step"] = custom.model_dump()

    # Trace ids (resolved by the service from what it recorded), mixed with an inline trajectory.
    ids = [run.trace_id for run in job2.runs]
    by_id = await trainer.forward_backward(ids, group_size=GROUP)
    out["by_trace_id"] = by_id.model_dump()
    payload = TrajectoryPayload(samples=samples_of(job2.runs[0]), reward=2.0)
    mixed = await trainer.forward_backward([*ids[: GROUP - 1], payload], group_size=GROUP)
    out["mixed"] = mixed.model_dump()
    last = await trainer.optim_step(learning_rate=1e-3)
    out["last_step"] = last.model_dump()

    out["checkpoints"] = [c.model_dump() for c in await trainer.checkpoints()]
    await trainer.set_head(result.checkpoint_id)
    out["head_after_set"] = (await trainer.head()).id
    return out


if __name__ == "__main__":
    pathlib.Path(sys.argv[3]).write_text(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
