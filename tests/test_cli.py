"""README's main job: `yieldloop demo` runs offline on the embedded default, one process per service."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys


def test_demo_runs_the_closed_loop(tmp_path: pathlib.Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "yieldloop.cli", "demo", "--iterations", "2", "--group-size", "4",
         "--letters", "abc", "--data-dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = re.findall(r"iteration (\d): mean reward ([\d.]+) .*sampled by (\S+) .*checkpoint (\S+)\s+now serving (\S+)", result.stdout)
    assert [line[0] for line in lines] == ["1", "2"], result.stdout
    first, second = lines
    assert first[2] == "base"
    assert first[3] == first[4], "the rollout serves the checkpoint the trainer committed"
    assert second[2] == first[3], "iteration 2 samples the weights iteration 1 trained"
    # Each service ran in its own process and stopped gracefully on SIGTERM.
    logs = sorted((tmp_path / "logs").iterdir())
    assert [p.name for p in logs] == ["checkpoint.log", "env.log", "rollout.log", "trainer.log"]
    for log in logs:
        assert "stopping" in log.read_text(), log.name


def test_up_then_demo_attach(tmp_path: pathlib.Path) -> None:
    """`yieldloop up` serves until interrupted; `yieldloop demo --attach` drives those services."""
    import signal
    import time

    bin_dir = pathlib.Path(sys.executable).parent
    yieldloop = str(bin_dir / "yieldloop") if (bin_dir / "yieldloop").exists() else "yieldloop"
    up = subprocess.Popen(
        [yieldloop, "up", "--data-dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while len(list((tmp_path / "run").glob("*.json"))) < 4:
            assert up.poll() is None, up.stdout.read()
            assert time.monotonic() < deadline, "services not up in time"
            time.sleep(0.2)
        demo = subprocess.run(
            [yieldloop, "demo", "--attach", str(tmp_path), "--iterations", "1", "--group-size", "2", "--letters", "ab"],
            capture_output=True, text=True, timeout=300,
        )
        assert demo.returncode == 0, demo.stdout + demo.stderr
        assert re.search(r"iteration 1: .*now serving step-000001-", demo.stdout), demo.stdout
        check_model_and_trace_commands(yieldloop, tmp_path)
    finally:
        up.send_signal(signal.SIGINT)
        output, _ = up.communicate(timeout=60)
    assert up.returncode == 0, output
    for service in ("checkpoint", "env", "trainer", "rollout"):
        assert service in output


def check_model_and_trace_commands(yieldloop: str, data_dir: pathlib.Path) -> None:
    """`yieldloop models ...` and `yieldloop trace` against the running stack."""
    import json

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([yieldloop, *args], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "COLUMNS": "200"})

    attach = ["--attach", str(data_dir)]
    listed = run("models", *attach, "list")
    assert listed.returncode == 0 and "tiny" in listed.stdout, listed.stderr
    tree = run("models", *attach, "checkpoints", "tiny")
    head = re.search(r"(step-000001-\w+)", tree.stdout).group(1)
    assert "base" in tree.stdout and "*" in tree.stdout
    assert f"tiny head: {head}" in run("models", *attach, "head", "tiny").stdout
    lost = run("models", *attach, "head", "tiny", "--set", "base", "--expect", "base")
    assert lost.returncode == 1 and "HEAD_CONFLICT" in lost.stderr, "a lost compare-and-swap is a clear error"
    moved = run("models", *attach, "head", "tiny", "--set", "base", "--expect", head)
    assert moved.returncode == 0 and "tiny head -> base" in moved.stdout
    forked = run("models", *attach, "fork", "tiny", "--name", "tiny-copy")
    assert forked.returncode == 0 and "tiny-copy at base" in forked.stdout
    trace_id = next((data_dir / "store" / "traces").glob("*.pb")).stem
    shown = run("trace", trace_id, *attach, "--json")
    assert shown.returncode == 0, shown.stderr
    run_json = json.loads(shown.stdout)
    assert run_json["traceId"] == trace_id and run_json["turns"][0]["completionTokenIds"]
    assert "reward" in run("trace", trace_id, *attach).stdout
    missing = run("trace", "0" * 32, *attach)
    assert missing.returncode == 1 and "TRACE_NOT_FOUND" in missing.stderr
