"""Custom losses through the service: Forward -> client autograd -> Backward gives the built-in loss's update."""

from __future__ import annotations

import math
import random

import pytest
import pytest_asyncio
import torch
from safetensors.torch import load_file

from yieldloop.client import Client
from yieldloop.proto.common.v1 import common_pb2 as common_pb
from yieldloop.training import forward_backward_custom
from yieldloop.types import Datum
from yieldloop_server.checkpoint import server as checkpoint_server
from yieldloop_server.stack import ensure_base_model
from yieldloop_server.store import open_store
from yieldloop_server.trainer import server as trainer_server

RATIOS = [0.5, 0.79, 0.81, 1.0, 1.19, 1.21, 2.0, 0.3, 1.5]


@pytest_asyncio.fixture(scope="module")
async def two_trainers(tmp_path_factory):
    """CheckpointService and two TrainerServices starting from the same base checkpoint."""
    root = tmp_path_factory.mktemp("custom")
    store = open_store(str(root / "store"))
    ensure_base_model(store, "tiny")
    checkpoints = checkpoint_server.make_server(store)
    address = await checkpoints.start()
    trainers, clients = [], []
    for name in ("builtin", "custom"):
        server, servicer = await trainer_server.make_server("tiny", store, address, root / name)
        clients.append(Client(trainer=await server.start(), checkpoint=address, timeout=120))
        trainers.append((server, servicer))
    yield store, clients
    for client in clients:
        await client.close()
    for server, servicer in trainers:
        await server.stop(1.0)
        await servicer.close()
    await checkpoints.stop(1.0)


async def ppo_datums(client: Client) -> list[common_pb.Datum]:
    """Datums whose sampler logprobs put the current ratios on both sides of PPO's clip bounds."""
    rng = random.Random(0)
    datums = []
    for length in (12, 9):
        tokens = [rng.randrange(1, 300) for _ in range(length + 1)]
        datums.append(common_pb.Datum(input_tokens=tokens[:-1], target_tokens=tokens[1:]))
    current = await client.forward(datums=datums)
    for datum, lps in zip(datums, current, strict=True):
        ratios = [RATIOS[i % len(RATIOS)] for i in range(len(lps))]
        datum.sampling_logprobs.extend(lp - math.log(r) for lp, r in zip(lps, ratios, strict=True))
        datum.advantages.extend(
            0.0 if i < 2 else rng.choice([-1.0, 1.0]) * rng.uniform(0.5, 1.5) for i in range(len(lps))
        )
    return datums


def ppo_as_custom_loss(datums: list[Datum], logprobs: list[torch.Tensor]):
    total = torch.zeros((), dtype=torch.float64)
    clipped = 0
    for datum, lp in zip(datums, logprobs, strict=True):
        q = torch.tensor(list(datum.sampling_logprobs), dtype=torch.float64)
        A = torch.tensor(list(datum.advantages), dtype=torch.float64)
        r = torch.exp(lp - q)
        total = total - torch.minimum(r * A, r.clamp(0.8, 1.2) * A).sum()
        clipped += int(((r < 0.8) | (r > 1.2)).sum())
    return total, {"clipped_tokens": clipped}


async def test_ppo_as_a_custom_loss_gives_the_builtin_update(two_trainers) -> None:
    store, (builtin, custom) = two_trainers
    datums = await ppo_datums(builtin)
    expected = await builtin.forward_backward(datums=datums, loss_fn="ppo")
    value, metrics = await forward_backward_custom(custom, datums=datums, loss_fn=ppo_as_custom_loss)
    assert value == pytest.approx(expected.loss_sum, rel=1e-5)
    assert metrics["clipped_tokens"] >= 4, "the batch exercises the clip bounds"
    # eps=1 keeps AdamW's first step linear in the gradient, so equal gradients mean equal weights.
    steps = [await c.optim_step(1e-2, set_head=False, eps=1.0, wait_durable=True) for c in (builtin, custom)]
    weights = [
        load_file(
            str(store.root / "models" / "tiny" / "checkpoints" / s.checkpoint.checkpoint_id / "model.safetensors")
        )
        for s in steps
    ]
    base = load_file(str(store.root / "models" / "tiny" / "checkpoints" / "base" / "model.safetensors"))
    moved = 0
    for name, tensor in weights[0].items():
        torch.testing.assert_close(weights[1][name], tensor, rtol=0, atol=1e-6)
        moved += int(not torch.equal(tensor, base[name]))
    assert moved > 5, "the update changed the weights"


async def test_backward_validates(two_trainers) -> None:
    from yieldloop import errors

    _, (client, _) = two_trainers
    with pytest.raises(errors.InvalidArgumentError) as err:
        await client.backward([common_pb.Datum(input_tokens=[1, 2], target_tokens=[2, 3], weights=[1.0])])
    assert err.value.reason == "DATUM_INVALID" and err.value.field == "datums[0].weights"
    with pytest.raises(errors.InvalidArgumentError):
        await client.backward([])
