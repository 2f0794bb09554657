"""Data parallel on CPU (gloo, world_size=2): the update equals the single-process update on the same batch."""

from __future__ import annotations

import pathlib

import pytest
import torch
from test_trainer import batch

from yieldloop_server.trainer.distributed import DistributedTrainer
from yieldloop_server.trainer.trainer import AdamConfig, Trainer, TrainerConfig


def test_world_size_2_equals_single_process(tiny_model_dir: pathlib.Path) -> None:
    """In float64: in float32 the two shards' sum differs from one pass by round-off, and AdamW's first steps
    turn round-off in near-zero (cancelling) gradient entries into differences of order the learning rate."""
    adam = AdamConfig(learning_rate=1e-2, weight_decay=0.01, max_grad_norm=1.0)
    config = TrainerConfig(dtype="float64")
    single = Trainer(tiny_model_dir, config)
    parallel = DistributedTrainer(tiny_model_dir, config, world_size=2)
    try:
        for seed in (1, 2):
            datums = batch(seed, single.vocab_size) + batch(seed + 10, single.vocab_size)
            expected = single.forward_backward(datums, "ppo", {})
            got = parallel.forward_backward(datums, "ppo", {})
            for key in ("loss_sum", "num_action_tokens", "mean_ratio", "clip_fraction", "entropy"):
                assert abs(got[key] - expected[key]) <= 1e-5 * max(1.0, abs(expected[key])), key
            norms = single.optim_step(adam), parallel.optim_step(adam)
            assert abs(norms[0] - norms[1]) <= 1e-5 * norms[0]
        for (name, a), (_, b) in zip(single.model.named_parameters(), parallel.model.named_parameters(), strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)
        assert parallel.step == single.step == 2
    finally:
        parallel.close()


@pytest.mark.parametrize("shard", ["none", "fsdp"])
async def test_trainer_service_with_two_ranks(tmp_path: pathlib.Path, shard: str) -> None:
    """`yieldloop serve trainer --nproc 2 [--trainer-shard fsdp]`: the service trains data-parallel or sharded
    and commits checkpoints (sharded, the training state as every rank's shards)."""
    from yieldloop.client import Client
    from yieldloop.proto.common.v1 import common_pb2 as common_pb
    from yieldloop_server.config import ServeOptions, TrainerOptions
    from yieldloop_server.serve import build_service
    from yieldloop_server.stack import ensure_base_model, ensure_stack_keys
    from yieldloop_server.store import open_store

    ensure_base_model(open_store(str(tmp_path / "store")), "tiny")
    admin_key, _ = ensure_stack_keys(open_store(str(tmp_path / "store")), tmp_path)
    built = await build_service(ServeOptions(service="checkpoint", data_dir=tmp_path))
    start_checkpoint, stop_checkpoint = built.start, built.stop
    checkpoint = await start_checkpoint()
    built = await build_service(
        ServeOptions(
            service="trainer",
            data_dir=tmp_path,
            checkpoint_address=checkpoint,
            trainer=TrainerOptions(nproc=2, shard=shard, state_every=1),  # type: ignore[arg-type]
        )
    )
    start_trainer, stop_trainer = built.start, built.stop
    trainer = await start_trainer()
    try:
        async with Client(trainer=trainer, checkpoint=checkpoint, timeout=120, api_key=admin_key) as client:
            datums = [
                common_pb.Datum(
                    input_tokens=d.input_tokens,
                    target_tokens=d.target_tokens,
                    sampling_logprobs=d.sampling_logprobs,
                    advantages=d.advantages,
                )
                for d in batch(3, 384)
            ]
            result = await client.forward_backward(datums=datums, loss_fn="importance_sampling")
            assert result.num_datums == 3 and result.num_action_tokens > 0
            step = await client.optim_step(1e-3)
            assert step.step == 1 and (await client.get_head("tiny")).checkpoint_id == step.checkpoint.checkpoint_id
            manifest = await client.get_checkpoint("tiny", step.checkpoint.checkpoint_id)
            state = sorted(obj.name for obj in manifest.objects if obj.state)
            if shard == "fsdp":  # each rank's shards of the AdamW moments and their metadata
                assert "optimizer-dcp-.metadata" in state and "optimizer-dcp-__1_0.distcp" in state, state
            else:
                assert "optimizer.pt" in state, state
            assert len(await client.forward(datums=batch(3, 384))) == 3  # logprobs: every rank scores its share
    finally:
        await stop_trainer(1.0)
        await stop_checkpoint(1.0)


async def test_torchrun_ranks_on_two_nodes_train_like_one_process(tmp_path: pathlib.Path) -> None:
    """`torchrun --nnodes 2 ... -m yieldloop.cli serve trainer`, each "node" with its own data directory: rank 0
    serves TrainerService and sends each session's weights to rank 1 over the process group; a step through the
    service computes what one process computes on the whole batch, and the ranks stay in step."""
    import asyncio
    import json
    import os
    import signal
    import socket
    import subprocess
    import sys

    from yieldloop.client import Client
    from yieldloop_server.config import ServeOptions
    from yieldloop_server.serve import build_service
    from yieldloop_server.stack import ensure_base_model, ensure_stack_keys
    from yieldloop_server.store import open_store

    store_dir = tmp_path / "store"
    ensure_base_model(open_store(str(store_dir)), "tiny")
    admin_key, service_key = ensure_stack_keys(open_store(str(store_dir)), tmp_path)
    built = await build_service(ServeOptions(service="checkpoint", data_dir=tmp_path))
    start_checkpoint, stop_checkpoint = built.start, built.stop
    checkpoint = await start_checkpoint()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        master_port = sock.getsockname()[1]
    ready = tmp_path / "node0" / "ready.json"
    health_ports = []
    for _ in (0, 1):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            health_ports.append(sock.getsockname()[1])
    nodes = []
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir()
        nodes.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    str(node),
                    "--nproc-per-node",
                    "1",
                    "--master-addr",
                    "127.0.0.1",
                    "--master-port",
                    str(master_port),
                    "-m",
                    "yieldloop.cli",
                    "serve",
                    "trainer",
                    "--data-dir",
                    str(tmp_path / f"node{node}"),
                    "--store",
                    str(store_dir),
                    "--checkpoint-address",
                    checkpoint,
                    "--ready-file",
                    str(ready),
                    "--torch-threads",
                    "1",
                    "--health-port",
                    str(health_ports[node]),
                ],
                env={**os.environ, "YIELDLOOP_SERVICE_KEY": service_key, "OMP_NUM_THREADS": "1"},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        for _ in range(600):
            if ready.exists() or any(n.poll() is not None for n in nodes):
                break
            await asyncio.sleep(0.2)
        assert ready.exists(), [n.poll() for n in nodes]
        trainer = json.loads(ready.read_text())["address"]
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        async with grpc.aio.insecure_channel(f"127.0.0.1:{health_ports[1]}") as channel:  # the follower's probes
            answer = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        reference = Trainer(store_dir / "models" / "tiny" / "checkpoints" / "base", TrainerConfig())
        datums = batch(3, reference.vocab_size) + batch(4, reference.vocab_size)
        adam = AdamConfig(learning_rate=1e-3)
        async with Client(trainer=trainer, checkpoint=checkpoint, timeout=120, api_key=admin_key) as client:
            for _ in range(2):
                got = await client.forward_backward(datums=datums, loss_fn="importance_sampling")
                expected = reference.forward_backward(datums, "importance_sampling", {})
                assert got.num_datums == len(datums)
                assert abs(got.loss_sum - expected["loss_sum"]) <= 1e-4 * max(1.0, abs(expected["loss_sum"]))
                step = await client.optim_step(1e-3)
                norm = reference.optim_step(adam)
                assert abs(step.grad_norm - norm) <= 1e-3 * norm
            assert (await client.get_head("tiny")).checkpoint_id == step.checkpoint.checkpoint_id
    finally:
        # Stop rank 0 as a pod's stop would (SIGTERM; torchrun itself exits non-zero on a signal, so the
        # service gets it): it closes its session, tells rank 1 to stop, and both launchers end cleanly.
        import psutil

        for child in psutil.Process(nodes[0].pid).children():
            child.send_signal(signal.SIGTERM)
        outputs = [(await asyncio.to_thread(n.communicate, timeout=120))[0] for n in nodes]  # the loop keeps
        await stop_checkpoint(1.0)  # serving commits
    assert [n.returncode for n in nodes] == [0, 0], outputs
    assert "rank 1 of 2 following rank 0" in outputs[1]
