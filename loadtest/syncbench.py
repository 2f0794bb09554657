"""Weight sync: from an optimizer step to the first token sampled by its weights, and bytes stored per step.

Runs CheckpointService, TrainerService and RolloutService (torch engine) in this process on a filesystem store,
with a model built locally (``--hidden 0``: the embedded tiny model; ``--hidden 512 --layers 8``: ~100 MB of
fp32 weights). Each step is a ForwardBackward on a small batch, then an OptimStep; the time measured runs from
the OptimStep call until a Generate returns a token sampled by the new checkpoint. Two ways, interleaved step
by step in the same run:

- ``through_store`` (the loop before weights were served directly): the step writes every file, training state
  included, to the store before it commits (``wait_durable`` + ``save_state``); the rollout service downloads
  the new checkpoint from the store and verifies it.
- ``direct`` (the default): the step commits pending; the rollout service pulls the sampler weights from the
  trainer (same host: the files in place) and verifies them; the store write runs behind; unchanged files are
  shared with the parent; the training state goes every ``state_every`` steps.

Bytes written to the store per step are measured as the store's growth once the step is durable.

Usage: ``python loadtest/syncbench.py [--hidden 512 --layers 8] [--steps 6] [--state-every 10] [--out r.json]``
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from trainerbench import build_model, make_batch, run_and_report  # noqa: E402


def store_bytes(root: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


async def bench(args: argparse.Namespace) -> dict:
    from yieldloop.client import Client, sampling_params
    from yieldloop_server.checkpoint.files import upload_folder
    from yieldloop_server.checkpoint.registry import CheckpointRegistry, Manifest, ModelInfo
    from yieldloop_server.config import EnvOptions, ServeOptions, TrainerOptions
    from yieldloop_server.serve import build_service
    from yieldloop_server.stack import ensure_model, ensure_stack_keys
    from yieldloop_server.store import open_store

    root = pathlib.Path(tempfile.mkdtemp(prefix="yl-syncbench-"))
    url = str(root / "store")
    store = open_store(url)
    if args.hidden:
        folder = build_model(root / "model", args.hidden, args.layers)
        registry = CheckpointRegistry(store)
        registry.create_model(ModelInfo(slug="bench", base="bench"))
        registry.commit(Manifest("bench", "base", upload_folder(store, "bench", "base", folder)), set_head=True)
        slug = "bench"
    else:
        slug = ensure_model(store, "tiny") and "tiny"
    weights_mb = sum(p.stat().st_size for p in (root / "store" / "models" / slug / "checkpoints" / "base").glob(
        "*.safetensors")) / 2**20
    admin_key, service_key = ensure_stack_keys(store, root)
    addresses: dict[str, str] = {}
    stoppers = []
    for service in ("checkpoint", "env", "trainer", "rollout"):
        options = ServeOptions(service=service, data_dir=root, store=url, model=slug, env=EnvOptions(workers=0),
                               trainer=TrainerOptions(state_every=args.state_every),
                               checkpoint_address=addresses.get("checkpoint", ""), env_address=addresses.get("env", ""),
                               service_key=service_key)
        start, stop = await build_service(options)
        addresses[service] = await start()
        stoppers.append(stop)
    client = Client(**{k: v for k, v in addresses.items() if k != "env"}, timeout=600, api_key=admin_key)
    batch = make_batch(4, 32, 300)  # ids inside the locally trained tokenizer's vocabulary
    figures: dict[str, dict[str, list[float]]] = {mode: {"sync_s": [], "answer_s": [], "bytes": []}
                                                  for mode in ("through_store", "direct")}
    await client.generate([1, 2], sampling=sampling_params(max_tokens=1), model=slug)  # the rollout follows
    for step in range(2 * args.steps + 2):
        mode = ("through_store", "direct")[step % 2]
        await client.forward_backward(datums=batch, model=slug)
        before = store_bytes(root / "store")
        started = time.perf_counter()
        result = await client.optim_step(1e-5, model=slug, wait_durable=mode == "through_store",
                                         save_state=mode == "through_store")
        answered = time.perf_counter()
        checkpoint_id = result.checkpoint.checkpoint_id
        await client.get_serving_info(wait_for_checkpoint_id=checkpoint_id, model=slug)
        completion = await client.generate([1, 2], sampling=sampling_params(max_tokens=1), model=slug)
        served = time.perf_counter()
        assert completion.weight_version == checkpoint_id, (completion.weight_version, checkpoint_id)
        while (await client.get_checkpoint(slug, checkpoint_id)).pending:  # durable before the next step
            await asyncio.sleep(0.01)
        if step >= 2:  # the first of each: warm-up
            figures[mode]["sync_s"].append(served - started)
            figures[mode]["answer_s"].append(answered - started)
            figures[mode]["bytes"].append(store_bytes(root / "store") - before)
    await client.close()
    for stop in reversed(stoppers):
        await stop(1.0)
    medians = {mode: {name: statistics.median(values) for name, values in f.items()} for mode, f in figures.items()}
    return {
        "model": slug,
        "weights_mb": round(weights_mb, 1),
        "steps_each": args.steps,
        "state_every": args.state_every,
        "through_store_step_to_first_token_s": round(medians["through_store"]["sync_s"], 3),
        "direct_step_to_first_token_s": round(medians["direct"]["sync_s"], 3),
        "speedup": round(medians["through_store"]["sync_s"] / medians["direct"]["sync_s"], 2),
        "through_store_optim_step_answer_s": round(medians["through_store"]["answer_s"], 3),
        "direct_optim_step_answer_s": round(medians["direct"]["answer_s"], 3),
        "through_store_mb_written_per_step": round(statistics.mean(figures["through_store"]["bytes"]) / 2**20, 2),
        "direct_mb_written_per_step": round(statistics.mean(figures["direct"]["bytes"]) / 2**20, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=0, help="0: the embedded tiny model")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6, help="steps measured per way")
    parser.add_argument("--state-every", type=int, default=10)
    parser.add_argument("--out", type=pathlib.Path)
    run_and_report(bench, parser.parse_args())


if __name__ == "__main__":
    main()
