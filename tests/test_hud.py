"""The unmodified HUD SDK (``hud==0.6.21``) trains on a running ``yieldloop up``, offline.

HUD's SDK pins ``mcp<2`` and vLLM's CPU build ``mcp>=2``, so they cannot share an environment: the SDK lives in
its own virtual environment (``.venv-hud``, made here on first use with ``pip install -e './clients/python[hud]'``,
or ``$YIELDLOOP_HUD_PYTHON``), as a user's HUD project would. Its scripts (``tests/hud/``) use HUD's public API
only and run with nothing but the ``HUD_*`` variables the stack wrote to ``DATA_DIR/run/hud.env``; what they
print is checked against what the stack recorded, through yieldloop's own client.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest
from up_harness import YIELDLOOP, start_up, stop_up

from yieldloop.training import connect
from yieldloop.types import Datum

REPO = pathlib.Path(__file__).resolve().parents[1]
HUD_DIR = REPO / "tests" / "hud"
HUD_VERSION = "0.6.21"
TOOL_CALL = '<tool_call>\n{"name": "count", "arguments": {"letter": "a"}}\n</tool_call><|im_end|>'


def _has_hud(python: pathlib.Path) -> bool:
    if not python.exists():
        return False
    probe = subprocess.run(
        [str(python), "-c", f"import hud, yieldloop; assert hud.__version__ == {HUD_VERSION!r}"], capture_output=True
    )
    return probe.returncode == 0


@pytest.fixture(scope="session")
def hud_python() -> str:
    """An interpreter with the HUD SDK: $YIELDLOOP_HUD_PYTHON, or .venv-hud (made now when missing)."""
    configured = os.environ.get("YIELDLOOP_HUD_PYTHON")
    if configured:
        return configured
    venv = REPO / ".venv-hud"
    python = venv / "bin" / "python"
    if not _has_hud(python):
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        installed = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "-e", f"{REPO / 'clients' / 'python'}[hud]"],
            capture_output=True,
            text=True,
            timeout=1200,
        )
        assert installed.returncode == 0, installed.stdout + installed.stderr
    return str(python)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, hud_python: str):
    """`yieldloop up` serving the letters environment and the HUD environment (through EnvService), with auth."""
    data_dir = tmp_path_factory.mktemp("hud-stack")
    spec = f"hud:{HUD_DIR / 'letters_env.py'}?python={hud_python}"
    process = start_up(
        data_dir,
        "--env-spec",
        "yieldloop.envs.letters:env",
        "--env-spec",
        spec,
        ready=lambda d: (d / "run" / "hud.env").exists(),
    )
    yield data_dir
    output = stop_up(process)
    assert "hud.env" in output and "HUD SDK scripts: source" in output


def hud_settings(data_dir: pathlib.Path) -> dict[str, str]:
    text = (data_dir / "run" / "hud.env").read_text()
    return dict(re.findall(r"^export (\w+)=(.*)$", text, re.M))


def run_hud(data_dir: pathlib.Path, python: str, script: str, *args: str, tmp_path: pathlib.Path) -> dict:
    """Runs a HUD SDK script with only the HUD_* variables set (a home and a working folder of its own, so no
    ~/.hud/.env or ./.env is read); returns the JSON it wrote."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    out = tmp_path / f"{pathlib.Path(script).stem}-{time.monotonic_ns()}.json"
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8", **hud_settings(data_dir)}
    done = subprocess.run(
        [python, str(HUD_DIR / script), *args, str(out)], env=env, cwd=home, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads(out.read_text())


def test_hud_env_file_names_the_front(stack: pathlib.Path) -> None:
    settings = hud_settings(stack)
    urls = {"HUD_API_URL", "HUD_RL_URL", "HUD_GATEWAY_URL", "HUD_TELEMETRY_URL", "HUD_WEB_URL", "HUD_RUNTIME_URL"}
    assert set(settings) == urls | {"HUD_API_KEY", "HUD_CLI_ANALYTICS_ENABLED", "HUD_SKIP_VERSION_CHECK"}
    assert all(settings[name].startswith(settings["HUD_API_URL"]) for name in urls)  # nothing points outside
    assert settings["HUD_CLI_ANALYTICS_ENABLED"] == "false" and settings["HUD_SKIP_VERSION_CHECK"] == "1"
    assert settings["HUD_GATEWAY_URL"] == settings["HUD_API_URL"] + "/v1"
    assert settings["HUD_API_KEY"] == (stack / "api_key").read_text().strip()
    assert (stack / "run" / "hud.env").stat().st_mode & 0o077 == 0  # it holds a key


def test_hud_sdk_samples_and_trains(stack: pathlib.Path, hud_python: str, tmp_path: pathlib.Path) -> None:
    """Taskset.run + create_agent + Job through the gateway record token samples; TrainingClient.step trains them
    and moves the head, which the next rollout samples; forward + backward (a custom loss), trace ids (mixed with
    an inline trajectory), checkpoints, head and set_head work."""
    out = run_hud(stack, hud_python, "train_with_hud.py", "tiny", "hud-model", tmp_path=tmp_path)
    assert out["forked"]["model_name"] == "hud-model" and out["forked"]["sdk_agent_type"] == "openai_compatible"
    assert {"importance_sampling", "ppo", "cispo", "dro", "cross_entropy"} <= set(out["losses"])
    assert out["head_before"] == "base"

    runs = out["runs"]
    assert len(runs) == 16  # 4 tasks x group 4
    for run in runs:
        assert run["samples"], run
        for sample in run["samples"]:
            assert sample["prompt_token_ids"] and sample["output_token_ids"]
            assert len(sample["output_logprobs"]) == len(sample["output_token_ids"])
            assert all(math.isfinite(lp) and lp <= 0 for lp in sample["output_logprobs"])

    step = out["step"]
    assert step["model"] == "hud-model" and step["step"] == 1 and step["checkpoint_id"].startswith("step-000001-")
    assert out["head_after_step"] == step["checkpoint_id"]
    assert out["backward"]["num_datums"] == 16 and out["backward"]["metrics"]["custom"] == 1.0
    assert all(a == b == c for a, b, c in out["forward_lengths"])
    assert out["custom_step"]["step"] == 2
    assert out["by_trace_id"]["num_datums"] == 16 and out["mixed"]["num_datums"] == 4
    assert out["last_step"]["step"] == 3

    checkpoints = {c["id"]: c for c in out["checkpoints"]}
    assert set(checkpoints) == {
        "base",
        step["checkpoint_id"],
        out["custom_step"]["checkpoint_id"],
        out["last_step"]["checkpoint_id"],
    }
    first = checkpoints[step["checkpoint_id"]]
    assert first["prev_model_checkpoint_id"] == "base" and first["num_traces"] == 16
    assert first["loss_fn"] == "importance_sampling" and first["learning_rate"] == pytest.approx(1e-3)
    assert first["mean_reward"] == pytest.approx(sum(r["reward"] for r in runs) / 16)
    assert sum(c["is_active"] for c in out["checkpoints"]) == 1  # listed before the final set_head
    assert out["head_after_set"] == step["checkpoint_id"]

    async def check() -> None:
        async with connect(stack) as client:
            # The gateway recorded each run under its trace id, token for token, in the job the SDK opened.
            recorded = {r.trace_id: r for r in await client.get_runs([r["trace_id"] for r in runs])}
            for run in runs:
                turns = recorded[run["trace_id"]].turns
                assert [t.prompt_token_ids for t in turns] == [s["prompt_token_ids"] for s in run["samples"]]
                assert [t.completion_token_ids for t in turns] == [s["output_token_ids"] for s in run["samples"]]
                for turn, sample in zip(turns, run["samples"], strict=True):
                    assert turn.completion_logprobs == pytest.approx(sample["output_logprobs"], abs=1e-5)
                assert recorded[run["trace_id"]].reward == pytest.approx(run["reward"])
                assert all(t.weight_version == "base" for t in turns)
            jobs = {job.job_id: job for job in await client.list_jobs()}
            assert jobs[out["job_id"]].name == "hud-train-1" and jobs[out["job_id"]].num_runs == 16
            # The rollout after the step sampled the new head.
            after = await client.get_runs(out["runs_after_step"])
            assert {t.weight_version for r in after for t in r.turns} == {step["checkpoint_id"]}
            assert (await client.get_head("hud-model")).checkpoint_id == step["checkpoint_id"]

    asyncio.run(check())

    # yieldloop's own commands show the HUD-driven work; the SDK's span uploads are kept beside the runs.
    env = {**os.environ, "COLUMNS": "250", "YIELDLOOP_DATA_DIR": str(stack)}
    jobs = subprocess.run([YIELDLOOP, "jobs"], capture_output=True, text=True, env=env, timeout=120)
    assert jobs.returncode == 0 and out["job_id"] in jobs.stdout, jobs.stdout + jobs.stderr
    shown = subprocess.run(
        [YIELDLOOP, "trace", runs[0]["trace_id"], "--json"], capture_output=True, text=True, env=env, timeout=120
    )
    assert shown.returncode == 0 and runs[0]["trace_id"] in shown.stdout, shown.stderr
    exported = tmp_path / "hud.tokens.jsonl"
    made = subprocess.run(
        [YIELDLOOP, "export", out["job_id"], "--kind", "tokens", "--out", str(exported)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert made.returncode == 0 and len(exported.read_text().splitlines()) == 16, made.stderr
    uploads = stack / "store" / "hud" / "telemetry"
    assert {path.name for path in uploads.iterdir()} & {run["trace_id"] for run in runs}


def test_hud_agent_tool_turns_are_the_tokens_the_engine_saw(
    stack: pathlib.Path, hud_python: str, tmp_path: pathlib.Path
) -> None:
    """A HUD agent calls the environment's MCP tool and answers on a later turn (the model was first taught to
    call it, on the exact prompt the agent sends): each turn's prompt is the previous prompt and answer plus the
    tool result's tokens (the gateway honours prompt_token_ids + continuation_from), and the samples the agent
    kept are the turns the engine sampled."""

    async def teach(prompt: list[int], target: list[int]) -> None:
        async with connect(stack) as client:
            datum = Datum(
                input_tokens=(prompt + target)[:-1],
                target_tokens=(prompt + target)[1:],
                weights=[0.0] * (len(prompt) - 1) + [1.0] * len(target),
            )
            for _ in range(100):  # cross_entropy on one sequence: ~75 steps learn it
                await client.forward_backward(datums=[datum], loss_fn="cross_entropy", model="hud-tools")
                step = await client.optim_step(1e-2, model="hud-tools")
            await client.get_serving_info(wait_for_checkpoint_id=step.checkpoint.checkpoint_id, model="hud-tools")

    async def fork_and_tokens(probe: dict) -> tuple[list[int], list[int]]:
        from yieldloop.environment import Task
        from yieldloop.training import Agent, Job, run_tasks

        async with connect(stack) as client:
            recorded = await client.get_runs([r["trace_id"] for r in probe["runs"]])
            prompt = recorded[0].turns[0].prompt_token_ids  # what the agent's first turn rendered to
            # The same task played through EnvService (the HUD environment's tools over MCP, rendered by
            # RolloutService's agent loop): the model sees the very same tokens, so what it learns on one path
            # holds on the other.
            job = await Job.start("hud-tools", 1, client=client)
            task = Task("hud-letters", "tool_calls", {"letter": "a"})
            [hosted] = await run_tasks([task], Agent(model="hud-tools", max_tokens=4, max_steps=1), job=job)
            assert hosted.turns[0].prompt_token_ids == prompt, (len(hosted.turns[0].prompt_token_ids), len(prompt))
            return prompt, await tokens_of(client, TOOL_CALL)

    asyncio.run(_fork(stack, "hud-tools"))
    probe = run_hud(stack, hud_python, "tool_turns.py", "hud-tools", tmp_path=tmp_path)
    prompt, target = asyncio.run(fork_and_tokens(probe))
    asyncio.run(teach(prompt, target))
    out = run_hud(stack, hud_python, "tool_turns.py", "hud-tools", tmp_path=tmp_path)

    runs = out["runs"]
    assert len(runs) == 2
    assert sum(run["reward"] for run in runs) >= 1  # the tool ran (the grade counts its calls)
    for run in runs:
        samples = run["samples"]
        assert len(samples) >= 2, run  # a tool call, then a turn after its result
        for before, after in zip(samples, samples[1:]):
            context = before["prompt_token_ids"] + before["output_token_ids"]
            assert after["prompt_token_ids"][: len(context)] == context
            assert len(after["prompt_token_ids"]) > len(context)  # the tool result's tokens

    async def check() -> None:
        async with connect(stack) as client:
            recorded = await client.get_runs([r["trace_id"] for r in runs])
            for record, run in zip(recorded, runs, strict=True):
                assert [t.prompt_token_ids for t in record.turns] == [s["prompt_token_ids"] for s in run["samples"]]
                assert [t.completion_token_ids for t in record.turns] == [s["output_token_ids"] for s in run["samples"]]
            # The trainer takes them as one sequence each (it refuses turns that do not extend each other).
            scored = await client.forward(runs=recorded, model="hud-tools")
            for logprobs, run in zip(scored, runs, strict=True):
                last = run["samples"][-1]
                assert len(logprobs) == len(last["prompt_token_ids"]) + len(last["output_token_ids"]) - 1

    asyncio.run(check())


def test_yieldloop_train_trains_the_hud_environment(stack: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """The same HUD environment, hosted by EnvService (its own server process, tools over MCP), trained by
    `yieldloop train`."""
    asyncio.run(_fork(stack, "hud-env-model"))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"env": "hud-letters", "scenario": "repeat", "args": {"letter": letter}}) + "\n"
            for letter in "abcd"
        )
    )
    config = tmp_path / "train.toml"
    config.write_text(
        f'model = "hud-env-model"\ntrain_tasks = "{tasks}"\nheldout_tasks = ""\nsteps = 2\n'
        'group_size = 4\nmax_tokens = 8\nname = "hud-env-train"\n'
    )
    env = {**os.environ, "COLUMNS": "250", "YIELDLOOP_DATA_DIR": str(stack)}
    trained = subprocess.run([YIELDLOOP, "train", str(config)], capture_output=True, text=True, env=env, timeout=600)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    job_id = re.search(r"job (job-\S+); report", trained.stdout).group(1)

    async def check() -> None:
        async with connect(stack) as client:
            runs = [run async for run in client.job_runs(job_id)]
            assert len(runs) == 2 * 4 * 4
            assert {run.task.env for run in runs} == {"hud-letters"} and all(run.turns for run in runs)
            assert all(run.status == 1 for run in runs), [run.error for run in runs if run.status != 1]
            head = await client.get_head("hud-env-model")
            assert head.checkpoint_id.startswith("step-000002-")

    asyncio.run(check())


async def _fork(data_dir: pathlib.Path, name: str) -> None:
    async with connect(data_dir) as client:
        await client.fork_model("tiny", name)


async def tokens_of(client, text: str) -> list[int]:
    """The model's tokens of ``text`` (special-token text included), through the OpenAI-compatible endpoint."""
    import openai

    info = await client.get_serving_info()
    async with openai.AsyncOpenAI(base_url=info.openai_base_url, api_key=client.transport.api_key) as oai:
        answer = await oai.completions.create(model="tiny", prompt=text, max_tokens=1)
    return answer.choices[0].model_extra["prompt_token_ids"]


PLAY_EPISODES = """
import asyncio, json, sys
from yieldloop.episode import Episode
from yieldloop.hud import HudEnvironment

async def main():
    env = HudEnvironment(sys.argv[1], per_episode=True)
    await env.start()
    out = {"name": env.name, "scenarios": sorted(env.scenarios), "tools": sorted(env.tools)}
    for n in range(2):
        episode = Episode.of(env, "tool_calls", {"letter": "a"})
        out[f"prompt{n}"] = await episode.start()
        out[f"tool{n}"] = await episode.call_tool("count", {"letter": "a"})
        out[f"reward{n}"] = (await episode.submit("3")).reward
        await episode.close()
    cancelled = Episode.of(env, "repeat", {"letter": "b"})
    await cancelled.start()
    await cancelled.close()  # before its grade: the task is cancelled, the process stopped
    try:
        Episode.of(env, "repeat", {"letter": 5})
    except Exception as err:
        out["bad_args"] = err.reason
    await env.stop()
    print(json.dumps(out))

asyncio.run(main())
"""


def test_hud_environment_beside_the_hud_sdk(hud_python: str) -> None:
    """`pip install 'yieldloop[hud]'`: yieldloop's client and the HUD SDK in one environment (its mcp 1.x): the
    HUD environment played as a yieldloop environment, each episode in a process of its own (the module state of
    one episode does not leak into the next), its tool called through MCP over the control port's tunnel."""
    done = subprocess.run(
        [hud_python, "-c", PLAY_EPISODES, str(HUD_DIR / "letters_env.py")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["name"] == "hud-letters" and out["scenarios"] == ["repeat", "tool_calls"] and out["tools"] == ["count"]
    assert "Use the count tool" in out["prompt0"]
    assert out["tool0"] == ["3", False] and out["tool1"] == ["3", False]
    assert out["reward0"] == out["reward1"] == 1.0  # one call each: separate processes
    assert out["bad_args"] == "SCENARIO_ARGS_INVALID"
