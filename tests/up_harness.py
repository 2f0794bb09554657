"""`yieldloop up` in a subprocess for the tests that drive a stack as its users do (the CLI, the HUD SDK)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable

BIN_DIR = pathlib.Path(sys.executable).parent
YIELDLOOP = str(BIN_DIR / "yieldloop") if (BIN_DIR / "yieldloop").exists() else "yieldloop"


def start_up(
    data_dir: pathlib.Path, *args: str, ready: Callable[[pathlib.Path], bool], timeout_s: float = 300
) -> subprocess.Popen:
    """Starts `yieldloop up --data-dir DATA_DIR ARGS...` and waits until ``ready(data_dir)``; on free ports unless
    ARGS name ``--base-port`` (several stacks may run at once, and none may take the default ports)."""
    ports = () if "--base-port" in args else ("--base-port", "0")
    process = subprocess.Popen(
        [YIELDLOOP, "up", "--data-dir", str(data_dir), *ports, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "250"},
    )
    deadline = time.monotonic() + timeout_s
    while not ready(data_dir):
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline, "the stack did not start in time"
        time.sleep(0.2)
    return process


def stop_up(process: subprocess.Popen) -> str:
    """Stops it as Ctrl-C does; returns what it printed (it must exit 0)."""
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output
    return output
