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
