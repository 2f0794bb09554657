"""One config: the command line is derived from the option dataclasses and reads back what it wrote."""

from __future__ import annotations

import argparse
import dataclasses
import pathlib

from yieldloop.transport import TransportConfig
from yieldloop_server.cli import register
from yieldloop_server.config import (
    STACK_PORTS,
    UP_BASE_PORT,
    CheckpointOptions,
    EnvOptions,
    RolloutOptions,
    ServeOptions,
    StackConfig,
    TrainerOptions,
    from_arguments,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser


def test_serve_flags_round_trip_every_option() -> None:
    options = ServeOptions(
        service="trainer",
        data_dir=pathlib.Path("/tmp/yl"),
        store="s3://b/p",
        model="m",
        device="cuda:1",
        checkpoint=CheckpointOptions(keep_last=3),
        env=EnvOptions(specs=("a:b", "c.py:env"), workers=0, processes=3, share_port=True),
        trainer=TrainerOptions(dtype="bfloat16", nproc=2, state_every=5),
        rollout=RolloutOptions(engine="vllm", http_port=-1, max_batch=64, weights_from="group"),
        transport=TransportConfig(max_message_bytes=1 << 20, env_connections=4),
        port=7000,
        checkpoint_address="h:1",
        env_address="h:2",
        ready_file=pathlib.Path("/tmp/ready.json"),
        grace_s=2.5,
        torch_threads=2,
        auth=False,
        tls=True,
        metrics_port=9464,
    )
    assert from_arguments(_parser().parse_args(options.to_args()), ServeOptions) == options


def test_defaults_and_help_come_from_the_dataclasses(capsys) -> None:
    config = from_arguments(_parser().parse_args(["up"]), StackConfig)
    # `up` alone binds stable ports from 7740 on (as vLLM's 8000 or Postgres's 5432); every other default is the
    # dataclass's.
    assert config.base_port == UP_BASE_PORT == 7740
    assert dataclasses.replace(config, data_dir=StackConfig.data_dir, base_port=0) == StackConfig()
    assert config.data_dir.is_absolute()
    assert [config.port_of(s) for s in STACK_PORTS] == list(range(7740, 7746))
    assert dataclasses.replace(config, hud_port=9000).port_of("hud") == 9000
    assert StackConfig().port_of("rollout") == 0  # in-process stacks and the demo: free ports
    try:
        _parser().parse_args(["serve", "--help"])
    except SystemExit:
        pass
    help_text = " ".join(capsys.readouterr().out.split())
    for group in ("checkpoint options:", "env options:", "trainer options:", "rollout options:", "transport options:"):
        assert group in help_text  # 45+ flags, grouped by the service they configure
    for doc in (
        "EnvService worker processes running environment code",
        "Checkpoint retention",
        "Largest gRPC message sent or accepted",
        "Which service to run",
    ):
        assert doc in help_text
    assert TrainerOptions(dtype="auto").resolved_dtype("cuda:0") == "bfloat16"
    assert TrainerOptions(dtype="auto").resolved_dtype("cpu") == "float32"


def test_the_stack_splits_the_cores_between_trainer_and_rollout(monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for service, cores, expected in (
        ("trainer", 8, 4),
        ("rollout", 2, 1),
        ("rollout", 1, 1),
        ("env", 8, 0),
        ("checkpoint", 8, 0),
    ):
        options = ServeOptions(service=service).sharing_cores(cores)
        assert options.torch_threads == expected, (service, cores)
    # The rollout's engine decodes in a process of its own unless its share is one core (the trainer's other).
    assert ServeOptions(service="rollout").rollout.engine_process is None  # serve: in a process
    assert ServeOptions(service="rollout").sharing_cores(2).rollout.engine_process is False
    assert "--no-rollout-engine-process" in ServeOptions(service="rollout").sharing_cores(2).to_args()
    assert ServeOptions(service="rollout").sharing_cores(8).rollout.engine_process is None
    chosen = ServeOptions(service="rollout", rollout=RolloutOptions(engine_process=True)).sharing_cores(2)
    assert chosen.rollout.engine_process and "--rollout-engine-process" in chosen.to_args()
    options = ServeOptions(service="trainer").sharing_cores(8)
    args = options.to_args()
    assert args[args.index("--torch-threads") + 1] == "4"
    assert ServeOptions(service="trainer", device="cuda").sharing_cores(8).torch_threads == 0
    assert ServeOptions(service="trainer", torch_threads=3).sharing_cores(8).torch_threads == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice wins
    assert ServeOptions(service="trainer").sharing_cores(8).torch_threads == 0
