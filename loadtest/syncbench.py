"""Weight sync: from an optimizer step to the first token sampled by its weights on every rollout service, and
bytes stored per step.

Runs CheckpointService, TrainerService and, per way, a fleet of ``--fleet`` RolloutServices (torch engine) in this
process on a filesystem store, with a model built locally (``--hidden 0``: the embedded tiny model; ``--hidden 512
--layers 8``: ~100 MB of fp32 weights). Each way trains a fork of its own that only its fleet serves; each step is
a ForwardBackward on a small batch, then an OptimStep; the time measured runs from the OptimStep call until every
rollout service of the way's fleet returned a token sampled by the new checkpoint. The ways, step by step in turn
in the same run:

- ``through_store`` (the loop before weights were served directly): the step writes every file, training state
  included, to the store before it commits (``wait_durable`` + ``save_state``); the rollout services download
  the new checkpoint from the store and verify it.
- ``direct`` (the default): the step commits pending; each rollout service pulls the sampler weights from the
  trainer (same host: the files in place) and verifies them; the store write runs behind; unchanged files are
  shared with the parent; the training state goes every ``state_every`` steps.
- ``stream``: as ``direct``, the weights pulled as from another host: a chunked gRPC stream per rollout service.
- ``group``: as ``direct``, the rollout services in the trainer's weight group: the trainer broadcasts each
  checkpoint once to all of them over torch.distributed (gloo here; NCCL on GPUs).

Bytes written to the store per step are measured as the store's growth once the step is durable.

Usage: ``python loadtest/syncbench.py [--hidden 512 --layers 8] [--fleet 2] [--ways direct group] [--steps 6]
[--state-every 10] [--out r.json]``
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from scratch import scratch_dir
from trainerbench import build_model, make_batch, run_and_report

WAYS = ("through_store", "direct", "stream", "group")
WEIGHTS_FROM = {"through_store": "auto", "direct": "auto", "stream": "stream", "group": "group"}


def store_bytes(root: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


async def bench(args: argparse.Namespace) -> dict:
    from yieldloop.client import Client, sampling_params
    from yieldloop_server.checkpoint.registry import CheckpointRegistry, Manifest, ModelInfo
    from yieldloop_server.config import EnvOptions, RolloutOptions, ServeOptions, TrainerOptions
    from yieldloop_server.serve import build_service
    from yieldloop_server.stack import ensure_model, ensure_stack_keys
    from yieldloop_server.store import open_store
    from yieldloop_server.weights.files import upload_folder

    root = scratch_dir("yl-syncbench-")
    url = str(root / "store")
    store = open_store(url)
    if args.hidden:
        folder = build_model(root / "model", args.hidden, args.layers)
        registry = CheckpointRegistry(store)
        registry.create_model(ModelInfo(slug="bench", base="bench"))
        registry.commit(Manifest("bench", "base", upload_folder(store, "bench", "base", folder)), set_head=True)
        base = "bench"
    else:
        base = ensure_model(store, "tiny") and "tiny"
    weights_mb = (
        sum(p.stat().st_size for p in (root / "store" / "models" / base / "checkpoints" / "base").glob("*.safetensors"))
        / 2**20
    )
    admin_key, service_key = ensure_stack_keys(store, root)
    addresses: dict[str, str] = {}
    stoppers = []

    async def serve(service: str, **options) -> str:
        built = await build_service(
            ServeOptions(
                service=service,
                store=url,
                env=EnvOptions(workers=0),
                service_key=service_key,
                checkpoint_address=addresses.get("checkpoint", ""),
                env_address=addresses.get("env", ""),
                **{"data_dir": root, "model": base, **options},
            )
        )
        start, stop = built.start, built.stop
        stoppers.append(stop)
        return await start()

    for service in ("checkpoint", "env", "trainer"):
        addresses[service] = await serve(
            service, trainer=TrainerOptions(state_every=args.state_every, max_models=len(args.ways) + 1)
        )
    client = Client(**{k: v for k, v in addresses.items() if k != "env"}, timeout=600, api_key=admin_key)
    fleets: dict[str, list[Client]] = {}
    for way in args.ways:
        await client.fork_model(base, f"{base}-{way}")
        fleets[way] = []
        for index in range(args.fleet):
            address = await serve(
                "rollout",
                model=f"{base}-{way}",
                data_dir=root / f"{way}-{index}",
                rollout=RolloutOptions(http_port=-1, weights_from=WEIGHTS_FROM[way]),
            )
            fleets[way].append(Client(rollout=address, timeout=600, api_key=admin_key))
    batch = make_batch(4, 32, 300)  # ids inside the locally trained tokenizer's vocabulary

    async def first_token(rollout: Client, slug: str, checkpoint_id: str) -> None:
        await rollout.get_serving_info(wait_for_checkpoint_id=checkpoint_id, model=slug)
        completion = await rollout.generate([1, 2], sampling=sampling_params(max_tokens=1), model=slug)
        assert completion.weight_version == checkpoint_id, (completion.weight_version, checkpoint_id)

    figures = {way: {"sync_s": [], "answer_s": [], "bytes": []} for way in args.ways}
    for round_ in range(args.steps + 2):  # the first two of each way: warm-up (a group forms at the second)
        for way in args.ways:
            slug = f"{base}-{way}"
            await client.forward_backward(datums=batch, model=slug)
            before = store_bytes(root / "store")
            started = time.perf_counter()
            result = await client.optim_step(
                1e-5, model=slug, wait_durable=way == "through_store", save_state=way == "through_store"
            )
            answered = time.perf_counter()
            checkpoint_id = result.checkpoint.checkpoint_id
            await asyncio.gather(*(first_token(rollout, slug, checkpoint_id) for rollout in fleets[way]))
            served = time.perf_counter()
            while (await client.get_checkpoint(slug, checkpoint_id)).pending:  # durable before the next step
                await asyncio.sleep(0.01)
            if round_ >= 2:
                figures[way]["sync_s"].append(served - started)
                figures[way]["answer_s"].append(answered - started)
                figures[way]["bytes"].append(store_bytes(root / "store") - before)
    members = (await client.get_trainer_info(f"{base}-group")).weight_group_members if "group" in args.ways else 0
    for rollout in (r for fleet in fleets.values() for r in fleet):
        await rollout.close()
    await client.close()
    for stop in reversed(stoppers):
        await stop(1.0)
    result = {
        "model": base,
        "weights_mb": round(weights_mb, 1),
        "fleet": args.fleet,
        "steps_each": args.steps,
        "state_every": args.state_every,
    }
    if "group" in args.ways:
        result["group_members"] = members
    for way in args.ways:
        result[f"{way}_step_to_first_token_s"] = round(statistics.median(figures[way]["sync_s"]), 3)
    baseline = result.get("through_store_step_to_first_token_s")
    for way in args.ways:
        if baseline and way != "through_store":
            result[f"{way}_speedup"] = round(baseline / result[f"{way}_step_to_first_token_s"], 2)
    for way in args.ways:
        result[f"{way}_optim_step_answer_s"] = round(statistics.median(figures[way]["answer_s"]), 3)
        result[f"{way}_mb_written_per_step"] = round(statistics.mean(figures[way]["bytes"]) / 2**20, 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=0, help="0: the embedded tiny model")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6, help="steps measured per way")
    parser.add_argument("--fleet", type=int, default=1, help="rollout services per way")
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--state-every", type=int, default=10)
    parser.add_argument("--out", type=pathlib.Path)
    run_and_report(bench, parser.parse_args())


if __name__ == "__main__":
    main()
