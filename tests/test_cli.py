"""The command line against real services: `yieldloop demo` (the README's main job) and every client
command against a live `yieldloop up`, including their error messages."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import ssl
import subprocess
import sys
import time

import pytest
from up_harness import YIELDLOOP, start_up, stop_up

from yieldloop.envs.letters import TASKS


def test_demo_learns_and_writes_a_report(tmp_path: pathlib.Path) -> None:
    """The demo lifts held-out reward from <= 0.3 to >= 0.8 through the four services, one process each."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "250"}
    result = subprocess.run(
        [sys.executable, "-m", "yieldloop.cli", "demo", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    before, after, steps = re.search(r"held-out reward ([\d.]+) -> ([\d.]+) in (\d+) steps", out).groups()
    assert float(before) <= 0.3 and float(after) >= 0.8, out
    assert "time split: rollout" in out and "reload" in out
    lines = re.findall(r"step +(\d+): train ([\d.]+) +held-out ([\d.]+) .* (step-\d+-\w+) (promoted|NOT promoted)", out)
    assert len(lines) == int(steps), out
    report = pathlib.Path(re.search(r"report: (\S+report\.html)", out.replace("\n", "")).group(1))
    assert report.exists() and (report.parent / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = report.read_text()
    assert "Checkpoint tree" in page and lines[-1][3] in page and "HEAD" in page
    # Each service ran in its own process and stopped gracefully on SIGTERM.
    logs = sorted((tmp_path / "logs").iterdir())
    assert [p.name for p in logs] == ["checkpoint.log", "env.log", "rollout.log", "trainer.log"]
    for log in logs:
        assert "stopping" in log.read_text(), log.name


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory):
    """`yieldloop up --tls` in a subprocess, serving until SIGINT: every command below runs with TLS and the
    admin key the stack made (auth is on by default)."""
    data_dir = tmp_path_factory.mktemp("up")
    process = start_up(data_dir, "--tls", ready=lambda d: len(list((d / "run").glob("*.json"))) >= 4)
    yield data_dir
    output = stop_up(process)
    for service in ("checkpoint", "env", "trainer", "rollout", "hud"):
        assert service in output
    assert f"source {data_dir / 'run' / 'hud.env'}" in output and "openai      https://127.0.0.1:" in output


def test_up_serves_the_hud_front_over_tls(up: pathlib.Path) -> None:
    """The HUD front speaks TLS with the stack's certificate; hud.env points the SDK (httpx) at the stack's CA."""
    import urllib.request

    deadline = time.monotonic() + 120
    while not (up / "run" / "hud.env").exists():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    settings = dict(re.findall(r"^export (\w+)=(.*)$", (up / "run" / "hud.env").read_text(), re.M))
    assert settings["HUD_API_URL"].startswith("https://") and settings["SSL_CERT_FILE"] == str(up / "tls" / "ca.pem")
    context = ssl.create_default_context(cafile=settings["SSL_CERT_FILE"])
    request = urllib.request.Request(
        settings["HUD_API_URL"] + "/v2/models", headers={"Authorization": f"Bearer {settings['HUD_API_KEY']}"}
    )
    with urllib.request.urlopen(request, context=context, timeout=30) as response:
        assert "tiny" in {item["id"] for item in json.loads(response.read())["items"]}


def run(data_dir: pathlib.Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "250", "YIELDLOOP_DATA_DIR": str(data_dir), **env}
    return subprocess.run([YIELDLOOP, *args], capture_output=True, text=True, timeout=300, env=env)


def test_up_serves_tls_and_auth(up: pathlib.Path) -> None:
    """The stack's admin key is private to its owner; team keys come from `yieldloop keys`; a client without
    the stack's CA, or without a key, is refused."""
    import asyncio

    from yieldloop import errors
    from yieldloop.client import Client
    from yieldloop.training import connect, stack_addresses

    assert (up / "api_key").stat().st_mode & 0o777 == 0o600
    assert (up / "tls" / "server.key").stat().st_mode & 0o777 == 0o600
    made = run(up, "keys", "create", "--team", "cli-team", "--role", "sample", "--name", "from the cli")
    assert made.returncode == 0, made.stderr
    team_key = made.stdout.strip().splitlines()[-1]
    key_id = team_key.split("_")[1]
    listed = run(up, "keys", "list")
    assert key_id in listed.stdout and "cli-team" in listed.stdout and team_key not in listed.stdout
    # The team key sees the public base; it may not train (a sample key) nor manage keys.
    assert "tiny" in run(up, "models", "list", YIELDLOOP_API_KEY=team_key).stdout
    refused = run(up, "keys", "list", YIELDLOOP_API_KEY=team_key)
    assert refused.returncode == 1 and "ROLE_NOT_ALLOWED" in refused.stderr
    assert run(up, "keys", "revoke", key_id).returncode == 0
    time.sleep(5.5)  # the key cache
    gone = run(up, "models", "list", YIELDLOOP_API_KEY=team_key)
    assert gone.returncode == 1 and "API_KEY_INVALID" in gone.stderr

    async def refused_without_ca_or_key() -> None:
        addresses = stack_addresses(up)
        async with Client(
            **addresses, api_key=(up / "api_key").read_text().strip(), timeout=5, retry_within_s=0
        ) as plaintext:  # no CA: a plaintext client to TLS servers
            with pytest.raises(errors.UnavailableError):
                await plaintext.list_models()
        async with connect(up, timeout=30) as client:
            assert client.transport.tls_ca and (await client.list_models())
        keyless_transport = dataclasses.replace(client.transport, api_key="")
        async with Client(**addresses, transport=keyless_transport, timeout=30) as keyless:
            with pytest.raises(errors.UnauthenticatedError):
                await keyless.list_models()

    asyncio.run(refused_without_ca_or_key())


def test_eval_jobs_export_and_trace(up: pathlib.Path, tmp_path: pathlib.Path) -> None:
    evaluated = run(
        up,
        "eval",
        "yieldloop.envs.letters:heldout_tasks",
        "tiny",
        "--group",
        "3",
        "--max-concurrent",
        "8",
        "--max-tokens",
        "8",
    )
    assert evaluated.returncode == 0, evaluated.stderr
    job_id = re.search(r"job (job-\S+): 30 runs, mean reward ([\d.]+)", evaluated.stdout).group(1)
    assert 'letters/repeat {"letter": "z"}' in evaluated.stdout
    listed = run(up, "jobs")
    assert listed.returncode == 0 and job_id in listed.stdout and " 30 " in listed.stdout

    rft = run(up, "export", job_id, "--format", "jsonl", "--out", str(tmp_path / "rft.jsonl"))
    assert rft.returncode == 0, rft.stderr
    rows = [json.loads(line) for line in (tmp_path / "rft.jsonl").read_text().splitlines()]
    assert len(rows) == 30 and set(rows[0]) >= {"prompt", "completion", "reward"}
    assert rows[0]["prompt"].startswith("Write the letter")
    parquet = run(up, "export", job_id, "--format", "parquet", "--out", str(tmp_path / "tokens.parquet"))
    assert parquet.returncode == 0 and "wrote 30 graded run(s)" in parquet.stdout, parquet.stderr

    shown = run(up, "trace", rows[0]["trace_id"], "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["traceId"] == rows[0]["trace_id"]
    assert "reward" in run(up, "trace", rows[0]["trace_id"]).stdout

    # Errors are one clear line and exit status 1.
    missing_model = run(up, "eval", "yieldloop.envs.letters:heldout_tasks", "no-such-model", "--group", "1")
    assert missing_model.returncode == 1 and "MODEL_NOT_FOUND" in missing_model.stderr
    assert "no-such-model" in missing_model.stderr
    bad_tasks = run(up, "eval", "nowhere.py", "tiny")
    assert bad_tasks.returncode == 1 and "nowhere.py does not exist" in bad_tasks.stderr
    missing_job = run(up, "export", "job-missing")
    assert missing_job.returncode == 1 and "JOB_NOT_FOUND" in missing_job.stderr
    missing_trace = run(up, "trace", "0" * 32)
    assert missing_trace.returncode == 1 and "TRACE_NOT_FOUND" in missing_trace.stderr
    no_stack = run(tmp_path / "nothing", "jobs")
    assert no_stack.returncode == 1 and "STACK_NOT_RUNNING" in no_stack.stderr and "yieldloop up" in no_stack.stderr


def test_train_models_and_report(up: pathlib.Path, tmp_path: pathlib.Path) -> None:
    config = tmp_path / "train.toml"
    tasks = (
        'train_tasks = "yieldloop.envs.letters:train_tasks"\nheldout_tasks = "yieldloop.envs.letters:heldout_tasks"\n'
    )
    config.write_text(f'model = "tiny"\n{tasks}steps = 2\ngroup_size = 4\ntasks_per_step = 6\nname = "cli-train"\n')
    trained = run(up, "train", str(config))
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert re.search(r"held-out reward [\d.]+ -> [\d.]+ in 2 steps", trained.stdout), trained.stdout
    job_id = re.search(r"job (job-\S+); report", trained.stdout).group(1)
    candidates = re.findall(r"(step-00000\d-\w+) (?:promoted|NOT promoted)", trained.stdout)
    assert len(candidates) == 2

    # The tree lists every candidate with its promotion decision; `head` agrees with the marked head.
    tree = run(up, "models", "checkpoints", "tiny")
    assert tree.returncode == 0 and "base" in tree.stdout
    assert re.search(r"base .*│ (weights|weights \+ state|pending) │", tree.stdout), tree.stdout  # what is stored
    for candidate in candidates:
        assert re.search(rf"{candidate} .*(promoted|not promoted): held-out", tree.stdout), tree.stdout
    head = re.search(r"^\W*>\W+(\S+)", tree.stdout, re.M).group(1)
    assert f"tiny head: {head}" in run(up, "models", "head", "tiny").stdout

    # Rollback with compare-and-swap; errors name the problem.
    lost = run(up, "models", "head", "tiny", "--set", "base", "--expect", "not-the-head")
    assert lost.returncode == 1 and "HEAD_CONFLICT" in lost.stderr
    moved = run(up, "models", "head", "tiny", "--set", "base", "--expect", head)
    assert moved.returncode == 0 and "tiny head -> base" in moved.stdout
    unknown = run(up, "models", "head", "tiny", "--set", "step-999999-nothere")
    assert unknown.returncode == 1 and "CHECKPOINT_NOT_FOUND" in unknown.stderr
    missing = run(up, "models", "checkpoints", "no-such-model")
    assert missing.returncode == 1 and "MODEL_NOT_FOUND" in missing.stderr
    forked = run(up, "models", "fork", "tiny", "--name", "tiny-copy")
    assert forked.returncode == 0 and "tiny-copy at base" in forked.stdout
    assert "tiny-copy" in run(up, "models", "list").stdout

    # The report of that run, by job id.
    reported = run(up, "report", job_id)
    assert reported.returncode == 0, reported.stderr
    assert (up / "runs" / job_id / "report.html").exists() and (up / "runs" / job_id / "report.png").exists()
    assert run(up, "report", "job-missing").returncode == 1

    # Bad config files: clear messages, nothing started.
    for text, message in [
        ("steps = ", "not valid toml"),
        ("steps = 3\n", "train_tasks is required"),
        ("stepz = 3\n", "unknown key(s) stepz"),
        (f'{tasks}steps = "many"\n', "steps must be int"),
        (f"{tasks}steps = 0\n", "steps = 0 is out of range"),
        ('train_tasks = "no_such_module:tasks"\n', "no module 'no_such_module'"),
    ]:
        config.write_text(text)
        bad = run(up, "train", str(config))
        assert bad.returncode == 1 and message in bad.stderr and "BAD_CONFIG" in bad.stderr, (text, bad.stderr)
    # A malformed tasks file: one line on stderr with the reason, exit 1 (no traceback).
    for name, text, message in [
        (
            "tasks.jsonl",
            '{"scenario": "repeat", "args": {"letter": "a"}}\n{not json\n',
            "tasks.jsonl:2: not valid JSON",
        ),
        ("tasks.json", '{"scenario": "letters"}', "a .json taskset is a list"),
        ("tasks.py", "tasks = [1 +\n", "SyntaxError"),
        ("tasks.py", "raise RuntimeError('boom')\n", "RuntimeError: boom"),
    ]:
        (tmp_path / name).write_text(text)
        config.write_text(f'train_tasks = "{tmp_path / name}"\n')
        bad = run(up, "train", str(config))
        lines = bad.stderr.strip().splitlines()
        assert bad.returncode == 1 and len(lines) == 1, (name, bad.stderr)
        assert message in lines[0] and "BAD_CONFIG" in lines[0], (name, bad.stderr)
    assert run(up, "train", str(tmp_path / "absent.toml")).returncode == 1
    config.write_text(f'model = "no-such-model"\n{tasks}')
    bad_model = run(up, "train", str(config))
    assert bad_model.returncode == 1 and "MODEL_NOT_FOUND" in bad_model.stderr


def test_models_import_and_list(up: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """`yieldloop models import` brings a Hugging Face folder in as a base slug; bad sources fail in one line."""
    from test_import import build_llama

    folder = build_llama(tmp_path / "my-llama")
    imported = run(up, "models", "import", str(folder), "--name", "cli-llama")
    assert imported.returncode == 0 and "LlamaForCausalLM" in imported.stdout, imported.stdout + imported.stderr
    listed = run(up, "models", "list", "--wide")
    assert listed.returncode == 0 and "cli-llama" in listed.stdout and "Qwen2ForCausalLM" in listed.stdout
    narrow = run(up, "models", "list")  # people: the columns that fit a terminal; scripts: --json
    assert "cli-llama" in narrow.stdout and "Qwen2ForCausalLM" not in narrow.stdout
    assert max(len(line) for line in narrow.stdout.splitlines()) <= 100
    as_json = {m["slug"]: m for m in json.loads(run(up, "models", "list", "--json").stdout)}
    assert as_json["cli-llama"]["architecture"] == "LlamaForCausalLM" and as_json["tiny"]["num_parameters"] > 0
    again = run(up, "models", "import", str(folder), "--name", "cli-llama")
    assert again.returncode == 1 and "MODEL_ALREADY_EXISTS" in again.stderr and len(again.stderr.splitlines()) == 1
    missing = run(up, "models", "import", str(tmp_path / "nowhere"), "--name", "x")
    assert missing.returncode == 1 and "MODEL_SOURCE_NOT_FOUND" in missing.stderr and "this machine" in missing.stderr
    on_server = run(up, "models", "import", str(folder), "--name", "y", "--on-server")  # no import roots
    assert on_server.returncode == 1 and "IMPORT_PATH_REFUSED" in on_server.stderr


def test_up_refuses_a_model_that_does_not_exist(tmp_path: pathlib.Path) -> None:
    refused = subprocess.run(
        [YIELDLOOP, "up", "--data-dir", str(tmp_path), "--base-port", "0", "--model", "no-such-model"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 1 and "MODEL_NOT_FOUND" in refused.stderr and "it has: none" in refused.stderr
    assert not any((tmp_path / "store").rglob("model.json"))


def test_up_then_demo_attach(up: pathlib.Path) -> None:
    """`yieldloop demo --attach` drives the services of a running `yieldloop up`."""
    demo = run(up, "demo", "--attach", str(up), "--steps", "1", "--group-size", "2")
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert re.search(r"step +\d+: train .* (promoted|NOT promoted)", demo.stdout), demo.stdout


def test_your_own_model_end_to_end(up: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """Import a Llama folder, fork it twice (full, and LoRA r=8), eval and train each fork by slug through the
    CLI, sample each by slug (Generate and the OpenAI endpoint), roll each back; the imported source's head
    never moves."""
    import asyncio

    import aiohttp
    from test_import import build_llama

    from yieldloop.client import sampling_params
    from yieldloop.training import connect

    folder = build_llama(tmp_path / "wf-llama")
    assert run(up, "models", "import", str(folder), "--name", "wf-base").returncode == 0
    forks = {"wf-a": ([], "base"), "wf-l": (["--lora-rank", "8"], "adapter-init")}
    for fork, (options, first) in forks.items():
        forked = run(up, "models", "fork", "wf-base", "--name", fork, *options)
        assert forked.returncode == 0 and f"at {first}" in forked.stdout, forked.stdout + forked.stderr
        evaluated = run(up, "eval", "yieldloop.envs.letters:heldout_tasks", fork, "--group", "2")
        assert evaluated.returncode == 0 and "mean reward" in evaluated.stdout, evaluated.stdout + evaluated.stderr
        config = tmp_path / f"{fork}.toml"
        config.write_text(
            f'model = "{fork}"\ntrain_tasks = "{TASKS["train_tasks"]}"\nsteps = 3\ngroup_size = 2\n'
            f'tasks_per_step = 4\nname = "train {fork}"\n'
        )
        trained = run(up, "train", str(config))
        assert trained.returncode == 0, trained.stdout + trained.stderr
        tree = run(up, "models", "checkpoints", fork)
        assert tree.returncode == 0 and len(set(re.findall(r"step-00000[123]-\w+", tree.stdout))) == 3, tree.stdout
        assert first in tree.stdout
    refused = run(up, "models", "fork", "wf-base", "--name", "wf-z", "--lora-rank", "0")
    assert refused.returncode != 0 and "LoRA rank" in refused.stderr + refused.stdout, refused.stderr
    listed = run(up, "models", "list")
    assert "wf-z" not in listed.stdout
    assert re.search(r"wf-l .*lora r=8", listed.stdout) and re.search(r"wf-a .*full", listed.stdout), listed.stdout

    async def sample() -> None:
        async with connect(up, timeout=120) as client:
            for fork in forks:
                head = (await client.get_head(fork)).checkpoint_id
                assert head.startswith("step-000003")
                await client.get_serving_info(wait_for_checkpoint_id=head, model=fork)
                done = await client.generate([1, 40, 41], model=fork, sampling=sampling_params(max_tokens=3))
                assert done.weight_version == head
                base_url = (await client.get_serving_info(model=fork)).openai_base_url
                assert base_url.startswith("https://")
                tls = ssl.create_default_context(cafile=client.transport.tls_ca)
                async with aiohttp.ClientSession(
                    headers={"Authorization": f"Bearer {client.transport.api_key}"},
                    connector=aiohttp.TCPConnector(ssl=tls),
                ) as http:
                    body = {"model": fork, "prompt": [1, 40, 41], "max_tokens": 3}
                    async with http.post(f"{base_url}/completions", json=body) as response:
                        assert (await response.json())["choices"][0]["weight_version"] == head
            # The LoRA fork's checkpoints hold its adapter (and, every few steps, optimizer state) only.
            names = {o.name for o in (await client.get_checkpoint("wf-l", head)).sampler_objects}
            assert names == {"adapter_config.json", "adapter_model.safetensors"}
            # Roll each fork back to its first checkpoint: the next sample uses the rolled-back weights.
            for fork, (_, first) in forks.items():
                rolled = run(up, "models", "head", fork, "--set", first)
                assert rolled.returncode == 0, rolled.stderr
                await client.get_serving_info(wait_for_checkpoint_id=first, model=fork)
                done = await client.generate([1, 40, 41], model=fork, sampling=sampling_params(max_tokens=3))
                assert done.weight_version == first
            assert (await client.get_head("wf-base")).checkpoint_id == "base"  # the source never moved

    asyncio.run(sample())
    assert "wf-base head: base" in run(up, "models", "head", "wf-base").stdout


def test_delete_model_through_the_cli(up: pathlib.Path) -> None:
    assert run(up, "models", "fork", "tiny", "--name", "doomed").returncode == 0
    assert run(up, "models", "fork", "doomed", "--name", "doomed-child").returncode == 0
    refused = run(up, "models", "delete", "doomed")
    assert refused.returncode == 1 and "MODEL_IN_USE" in refused.stderr
    assert run(up, "models", "delete", "doomed-child").returncode == 0
    deleted = run(up, "models", "delete", "doomed")
    assert deleted.returncode == 0 and "deleted doomed" in deleted.stdout
    assert "doomed" not in run(up, "models", "list").stdout
