"""A newcomer's first hour, scripted: from an empty folder, their own model folder and environment file, through
the README's "Bring your own environment and model" walkthrough, making the mistakes newcomers make. Every
step asserts what the command printed, not only its exit status: each mistake is one line that says what to do.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
from up_harness import YIELDLOOP

REPO = pathlib.Path(__file__).resolve().parents[1]

BROKEN_GRADERS = """

@env.scenario()
async def too_generous(item: str):
    yield f"Name a {item}."
    yield Grade(2.0)  # outside [0, 1]


@env.scenario()
async def crashes(item: str):
    yield f"Name a {item}."
    raise RuntimeError("the grader fell over")


@env.scenario()
async def forgets(item: str):
    yield f"Name a {item}."  # no second yield


broken = [too_generous.task(item="apple"), crashes.task(item="pear"), forgets.task(item="plum")]
"""


def walkthrough_env() -> str:
    """The README walkthrough's `my_env.py`, as a newcomer copies it (plus three graders that go wrong)."""
    section = (REPO / "README.md").read_text().split("## Your own environment and model, from an empty folder")[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1) + BROKEN_GRADERS


def yl(folder: pathlib.Path, *args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """`yieldloop ARGS` in ``folder`` as a newcomer runs it: an 120-column terminal, no YIELDLOOP_* variables."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("YIELDLOOP_")}
    return subprocess.run(
        [YIELDLOOP, *args],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**clean, "COLUMNS": "120", **env},
    )


def one_line(result: subprocess.CompletedProcess, *expected: str) -> str:
    """The command failed with exit status 1 and said why in one line on stderr holding each of ``expected``."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stdout + result.stderr
    for text in expected:
        assert text in lines[0], (text, lines[0])
    return lines[0]


def wait_for(predicate, timeout_s: float = 300, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory):
    """An empty folder with the newcomer's model folder and environment file, and `yieldloop up` started there
    on the default data directory and ports, serving their environment and importing their model."""
    from test_import import build_llama

    folder = tmp_path_factory.mktemp("newcomer")
    build_llama(folder / "my-model")
    (folder / "my_env.py").write_text(walkthrough_env())
    (folder / "broken_env.py").write_text("from yieldloop import Environment\nenv = Environment('x'\n")

    # Mistake: a syntax error in the environment file. One line naming file:line, exit 1, nothing left running.
    broken = yl(folder, "up", "--env-spec", "broken_env.py:env", "--model", "./my-model", timeout=600)
    line = one_line(broken, "env failed to start", "broken_env.py:2: SyntaxError", "SERVICE_FAILED")
    assert "logs/env.log" in line and "broken_env.py:2: SyntaxError" in (folder / ".yieldloop/logs/env.log").read_text()
    assert not list((folder / ".yieldloop" / "run").glob("*.json"))
    missing = yl(folder, "up", "--env-spec", "nowhere.py:env", "--model", "./my-model", timeout=600)
    one_line(missing, "nowhere.py: no such file")

    clean = {k: v for k, v in os.environ.items() if not k.startswith("YIELDLOOP_")}
    process = subprocess.Popen(
        [YIELDLOOP, "up", "--env-spec", "my_env.py:env", "--model", "./my-model"],
        cwd=folder,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**clean, "COLUMNS": "120"},
    )
    run_dir = folder / ".yieldloop" / "run"
    wait_for(lambda: process.poll() is not None or (run_dir / "hud.env").exists(), what="yieldloop up")
    assert process.poll() is None, process.stdout.read()
    yield folder, process
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=60)


def test_the_first_hour(project) -> None:
    folder, process = project
    data_dir = (folder / ".yieldloop").resolve()

    # The card `up` ends with, and `yieldloop status` prints again: where everything is, on stable ports.
    status = yl(folder, "status")
    assert status.returncode == 0, status.stderr
    card = status.stdout
    assert f"export YIELDLOOP_DATA_DIR={data_dir}" in card
    assert re.search(r"checkpoint +127\.0\.0\.1:7740", card) and re.search(r"rollout +127\.0\.0\.1:7743", card)
    assert "openai      http://127.0.0.1:7745/v1" in card and f"source {data_dir}/run/hud.env" in card
    assert f"api key     {data_dir}/api_key" in card
    facts = json.loads(yl(folder, "status", "--json").stdout)
    assert facts["openai_base_url"] == "http://127.0.0.1:7745/v1" and facts["pid"] == process.pid
    ready = json.loads((data_dir / "run" / "rollout.json").read_text())
    assert ready["http_port"] == 7745 and ready["pid"] > 0 and "started" in ready
    assert ready["openai_base_url"] == facts["openai_base_url"]

    # Mistake: a second `up` on the same data directory. Refused, naming who holds it; the first one is unharmed.
    second = yl(folder, "up", "--base-port", "0", timeout=120)
    one_line(second, "STACK_LOCKED", f"pid {process.pid}", "yieldloop status")
    assert yl(folder, "status").returncode == 0

    # Help for people, JSON for scripts.
    bare = yl(folder)
    assert bare.returncode == 0 and "status" in bare.stdout and "models" in bare.stdout and "COMMAND" in bare.stdout
    assert "list" in yl(folder, "models").stdout and "fork" in yl(folder, "models").stdout
    assert re.match(r"yieldloop \S+, yieldloop-server \S+", yl(folder, "--version").stdout)
    listed = yl(folder, "models", "list", "--attach", str(data_dir))  # --attach after the subcommand too
    assert listed.returncode == 0 and "my-model" in listed.stdout, listed.stderr
    assert max(map(len, listed.stdout.splitlines())) <= 120
    models = {
        m["slug"]: m for m in json.loads(yl(folder, "--attach", str(data_dir), "models", "list", "--json").stdout)
    }
    assert models["my-model"]["architecture"] == "LlamaForCausalLM"

    # Mistakes caught where they are made: a LoRA target the model does not have, a misspelt slug.
    typo = yl(
        folder, "models", "fork", "my-model", "--name", "shop-lora", "--lora-rank", "4", "--lora-targets", "q_prj"
    )
    one_line(typo, "INVALID_FIELD", "no linear layer 'q_prj'", "did you mean 'q_proj'", "lora.target_modules")
    assert "shop-lora" not in yl(folder, "models", "list").stdout
    forked = yl(folder, "models", "fork", "my-model", "--name", "shop-agent")
    assert forked.returncode == 0 and "shop-agent at base" in forked.stdout, forked.stderr
    # A relative folder is the client's (read here and uploaded), wherever the services run.
    (folder / "elsewhere").mkdir()
    copied = yl(
        folder / "elsewhere", "models", "import", "../my-model", "--name", "my-copy", "--attach", "../.yieldloop"
    )
    assert copied.returncode == 0 and "imported ../my-model as my-copy: LlamaForCausalLM" in copied.stdout
    misspelt = yl(folder, "eval", "my_env.py:heldout", "shop-agnet", "--group", "2")
    one_line(misspelt, "MODEL_NOT_FOUND", "did you mean 'shop-agent'")

    # Eval with the task spec form --env-spec takes (file.py:attr): rewards as a histogram, not 250 numbers.
    evaluated = yl(folder, "eval", "my_env.py:heldout", "shop-agent", "--group", "4")
    assert evaluated.returncode == 0, evaluated.stderr
    assert re.search(r"shop/quote .*\d\.\d\d x\d", evaluated.stdout), evaluated.stdout
    assert "0 not graded" in evaluated.stdout
    as_json = json.loads(yl(folder, "eval", "my_env.py:heldout", "shop-agent", "--group", "2", "--json").stdout)
    assert as_json["runs"] == 4 and {t["runs"] for t in as_json["tasks"]} == {2} and as_json["not_graded"] == 0

    # Mistake: graders that fail. eval counts them by reason and names the first error of each task.
    failing = yl(folder, "eval", "my_env.py:broken", "shop-agent", "--group", "2")
    out = failing.stdout
    assert failing.returncode == 0 and "6 not graded (6 ENVIRONMENT_ERROR)" in out, out + failing.stderr
    assert "shop/too_generous" in out and "reward 2.0" in out, out
    assert "the grader fell over" in out and "second yield" in out, out
    job_id = re.search(r"job (job-\S+):", out).group(1)
    # export says what it left out; trace shows a failed run's status and error, not "reward 0.000".
    exported = yl(folder, "export", job_id, "--out", str(folder / "broken.jsonl"))
    assert "wrote 0 graded run(s) of 6" in exported.stdout, exported.stdout + exported.stderr
    assert "left out 6 run(s) not graded" in exported.stdout and "6 ENVIRONMENT_ERROR" in exported.stdout
    failed = json.loads(yl(folder, "eval", "my_env.py:broken", "shop-agent", "--group", "1", "--json").stdout)
    assert failed["not_graded"] == 3 and failed["tasks"][0]["errors"] == {"ENVIRONMENT_ERROR": 1}
    trace_id = _trace_of(folder, job_id)
    traced = yl(folder, "trace", trace_id)
    assert "status ENV_ERROR (ENVIRONMENT_ERROR)" in traced.stdout and "reward 0.000" not in traced.stdout

    # Mistake: training on those. One line: how many runs were graded, by reason, the first error.
    (folder / "broken.toml").write_text('model = "shop-agent"\ntrain_tasks = "my_env.py:broken"\nsteps = 2\n')
    bad_train = yl(folder, "train", "broken.toml")
    one_line(bad_train, "NO_GRADED_RUNS", "0 of 24 runs graded: 24 ENVIRONMENT_ERROR; first:")
    (folder / "nothing.toml").write_text('model = "shop-agent"\nsteps = 2\n')
    one_line(yl(folder, "train", "nothing.toml"), "train_tasks is required")

    # The walkthrough's training run, with its own held-out tasks; Ctrl-C after the first step, then resume.
    config = folder / "train.toml"
    config.write_text(
        'model = "shop-agent"\ntrain_tasks = "my_env.py:train"\nheldout_tasks = "my_env.py:heldout"\n'
        "steps = 3\ngroup_size = 4\nmax_tokens = 8\npromotion_tolerance = 1.0\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("YIELDLOOP_")}
    training = subprocess.Popen(
        [YIELDLOOP, "train", "train.toml"],
        cwd=folder,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**clean, "COLUMNS": "120"},
    )
    first = ""
    while not first.startswith("step"):
        first = training.stdout.readline().strip()
        assert first or training.poll() is None, training.stderr.read()
    training.send_signal(signal.SIGINT)
    _, err = training.communicate(timeout=120)
    assert training.returncode == 130 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    said = err.strip()
    head = re.search(r"HEAD of shop-agent is (\S+);", said).group(1)
    job = re.search(r"--resume (job-\S+)`", said).group(1)
    assert "interrupted:" in said and "report: " in said and "yieldloop train train.toml --resume" in said, said
    resumed = yl(folder, "train", "train.toml", "--resume", job, timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"job {job}; report" in resumed.stdout
    # One line a step that fits the terminal; groups without reward spread are a count in it, not a warning each.
    step_lines = [line for line in resumed.stdout.splitlines() if line.startswith("step")]
    done = int(re.search(r"interrupted: (\d+) step\(s\) of this job committed", said).group(1))
    assert len(step_lines) == 3 - done and all(len(line) <= 120 for line in step_lines), (said, step_lines)
    assert "without reward spread" not in resumed.stderr and "flat group(s)" in resumed.stdout + first
    steps = [
        json.loads(line) for line in (folder / ".yieldloop" / "runs" / job / "steps.jsonl").read_text().splitlines()
    ]
    assert sum("checkpoint_id" in s for s in steps) == 3 and head  # one run folder, every step in it
    gone = yl(folder, "train", "train.toml", "--resume", "job-nope")
    one_line(gone, "JOB_NOT_FOUND", job)

    # Sample the trained slug with the official OpenAI client, at the base URL the card gave.
    import openai

    key = (data_dir / "api_key").read_text().strip()
    with openai.OpenAI(base_url=facts["openai_base_url"], api_key=key) as oai:
        answer = oai.chat.completions.create(
            model="shop-agent", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert answer.choices[0].message.content is not None

    # Roll back to the base checkpoint.
    rolled = yl(folder, "models", "head", "shop-agent", "--set", "base")
    assert rolled.returncode == 0 and "shop-agent head -> base" in rolled.stdout
    one_line(yl(folder, "report", "job-nope"), "JOB_NOT_FOUND", job)

    # Stopping `up` (Ctrl-C) leaves no address behind: the next command hears STACK_NOT_RUNNING, not a refused
    # connection.
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output
    assert not list((data_dir / "run").glob("*.json")) and not (data_dir / "run" / "lock").exists()
    one_line(yl(folder, "status"), "STACK_NOT_RUNNING", "yieldloop up --data-dir")
    one_line(yl(folder, "models", "list"), "STACK_NOT_RUNNING")


def _trace_of(folder: pathlib.Path, job_id: str) -> str:
    """A trace id of one of the job's runs (through the Python client, as a script would)."""
    script = (
        "import asyncio, sys\n"
        "from yieldloop import connect\n"
        "async def main():\n"
        "    async with connect() as client:\n"
        "        print([r async for r in client.job_runs(sys.argv[1])][0].trace_id)\n"
        "asyncio.run(main())\n"
    )
    done = subprocess.run([sys.executable, "-c", script, job_id], cwd=folder, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_killed_stack_is_not_running(tmp_path: pathlib.Path) -> None:
    """Address files whose process is gone (a stack killed with -9) mean "not running", in one line."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for service in ("checkpoint", "env", "trainer", "rollout"):
        (run_dir / f"{service}.json").write_text(json.dumps({"address": "127.0.0.1:1", "pid": dead.pid}))
    (run_dir / "lock").write_text(json.dumps({"pid": dead.pid, "started": 1.0, "since": 0, "command": "up"}))
    stale = yl(tmp_path, "jobs", "--attach", str(tmp_path))
    one_line(stale, "STACK_NOT_RUNNING", "checkpoint exited: its process is gone")
    from yieldloop.stackdir import take_lock

    assert take_lock(tmp_path).exists()  # a dead holder's lock is taken over


def test_every_argument_has_help() -> None:
    """Every flag and positional of every command says what it is (`--help` is the newcomer's manual), and `up`
    groups its flags by the service they configure."""
    import argparse

    from yieldloop.cli import _subparsers, build_parser

    parser, _ = build_parser()
    missing = []

    def walk(p: argparse.ArgumentParser, path: str) -> None:
        for action in p._actions:
            if not isinstance(action, argparse._SubParsersAction) and not action.help:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
        for name, sub in _subparsers(p).items():
            walk(sub, f"{path} {name}")

    walk(parser, "yieldloop")
    assert not missing, missing
    up_help = _subparsers(parser)["up"].format_help()
    for group in ("checkpoint options", "env options", "trainer options", "rollout options", "transport options"):
        assert group in up_help


def test_the_tiny_model_is_built_once_per_machine(tmp_path: pathlib.Path, monkeypatch) -> None:
    """The first start says what it builds; every later data directory reuses the machine's cached build."""
    from yieldloop_server.common.tiny_model import TinyModelConfig, cached_tiny_model
    from yieldloop_server.stack import ensure_base_model
    from yieldloop_server.store import open_store

    monkeypatch.setenv("YIELDLOOP_CACHE_DIR", str(tmp_path / "cache"))
    config = TinyModelConfig(warmup_steps=60)
    said: list[str] = []
    first = cached_tiny_model(config, said.append)
    assert "creating the built-in tiny model (once per machine" in said[0] and str(first) in said[0]
    assert any("warming it up: step 50 of 60" in line for line in said)
    said.clear()
    assert cached_tiny_model(config, said.append) == first and "from this machine's cache" in said[0]
    assert not list(first.parent.glob(".building-*"))  # nothing half-built left behind
    # A different recipe is a different build.
    assert cached_tiny_model(TinyModelConfig(warmup_steps=0)) != first
    # Two data directories, one build.
    for name in ("a", "b"):
        said.clear()
        assert ensure_base_model(open_store(str(tmp_path / name / "store")), progress=said.append)
        assert not any("creating" in line for line in said) or name == "a"
