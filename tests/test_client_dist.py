"""The client distribution alone (``pip install ./clients/python``) in a fresh venv: the client, the environment SDK,
tasksets and the training API import, with grpcio/protobuf-level dependencies only (no torch installed or imported);
the server subcommands say how to get the server distribution."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import venv

REPO = pathlib.Path(__file__).resolve().parents[1]

CHECK = """
import importlib.util, sys
import yieldloop
from yieldloop import Client, Environment, Job, Task, Taskset, TrainingClient, YieldloopError, connect
from yieldloop.environment import EpisodeContext, Grade
from yieldloop.proto.env.v1 import env_service_pb2_grpc
from yieldloop.transport import TransportConfig, open_channel
import yieldloop.cli, yieldloop.export, yieldloop.loop, yieldloop.training, yieldloop.envs.letters
heavy = sorted(m for m in ("torch", "transformers", "boto3", "vllm", "matplotlib", "pyarrow", "yieldloop_server")
               if m in sys.modules or importlib.util.find_spec(m) is not None)
print("heavy:", heavy)
"""


def test_client_distribution_installs_and_imports_without_the_ml_stack(tmp_path: pathlib.Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(env_dir)
    python = env_dir / "bin" / "python"
    # A copy: a non-editable install builds in the source folder (build/, egg-info).
    source = shutil.copytree(
        REPO / "clients" / "python",
        tmp_path / "src",
        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"),
    )
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", str(source)], capture_output=True, text=True, timeout=600
    )
    assert install.returncode == 0, install.stdout + install.stderr

    checked = subprocess.run([python, "-c", CHECK], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.strip() == "heavy: []", checked.stdout

    yieldloop = env_dir / "bin" / "yieldloop"
    assert "eval" in subprocess.run([yieldloop, "--help"], capture_output=True, text=True, cwd=tmp_path).stdout
    up = subprocess.run([yieldloop, "up", "--data-dir", "x"], capture_output=True, text=True, cwd=tmp_path)
    assert up.returncode == 1 and "server distribution" in up.stderr and "pip install" in up.stderr, up.stderr
    assert sys.executable != str(python)
