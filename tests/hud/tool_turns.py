"""A HUD SDK script whose agent calls the environment's MCP tool over several turns (the model it samples was
taught to call it), written with the HUD SDK only. ``python tool_turns.py MODEL OUT.json``."""

from __future__ import annotations

import asyncio
import json
import pathlib
import sys

from hud import Job, LocalRuntime, Taskset
from hud.agents import create_agent
from hud.agents.types import AgentStep

HERE = pathlib.Path(__file__).parent


async def main(model: str) -> dict:
    sys.path.insert(0, str(HERE))
    import letters_env

    agent = create_agent(
        model,
        max_steps=3,
        completion_kwargs={"max_tokens": 48, "temperature": 0, "extra_body": {"return_token_ids": True}},
    )
    job = await Job.start("hud-tool-turns", group=2)
    await Taskset("tools", [letters_env.tool_calls(letter="a")]).run(
        agent, runtime=LocalRuntime(letters_env.env), group=2, job=job
    )
    runs = []
    for run in job.runs:
        samples = run.trace.collect(lambda step: step.sample if isinstance(step, AgentStep) else None)
        runs.append(
            {
                "trace_id": run.trace_id,
                "reward": run.reward,
                "samples": [
                    {
                        "prompt_token_ids": s.prompt_token_ids,
                        "output_token_ids": s.output_token_ids,
                        "output_logprobs": s.output_logprobs,
                    }
                    for s in samples
                ],
            }
        )
    return {"job_id": job.id, "runs": runs}


if __name__ == "__main__":
    pathlib.Path(sys.argv[2]).write_text(json.dumps(asyncio.run(main(sys.argv[1]))))
