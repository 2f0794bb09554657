"""Hot reload: time from CommitCheckpoint to the first token served with the new weights.

A ~100 MB checkpoint (Qwen2, fp32, built locally) is published under fresh checkpoint ids, one per reload, in a
filesystem store or in S3 (a moto_server this script starts on 127.0.0.1). For each reload it measures, in the
same run: the raw time to read the checkpoint's bytes from the same store, and the time from the commit (which
moves HEAD) until a Generate returns a token sampled by the new weights. Four clients generate continuously
meanwhile; every failed request is counted.

Usage: ``python loadtest/reloadbench.py [--store fs|s3] [--reloads 10] [--hidden 512 --layers 8] [--out r.json]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from scratch import scratch_dir
from trainerbench import build_model, run_and_report


def start_moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for name, value in (
        ("AWS_ACCESS_KEY_ID", "bench"),
        ("AWS_SECRET_ACCESS_KEY", "bench"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        os.environ.setdefault(name, value)
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    while True:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return server, f"http://127.0.0.1:{port}"
        time.sleep(0.1)


async def bench(args: argparse.Namespace) -> dict:
    from yieldloop.client import Client, sampling_params
    from yieldloop_server.checkpoint.registry import CheckpointRegistry, Manifest, ModelInfo
    from yieldloop_server.config import EnvOptions, ServeOptions
    from yieldloop_server.serve import build_service
    from yieldloop_server.stack import ensure_stack_keys
    from yieldloop_server.store import open_store
    from yieldloop_server.weights.files import upload_folder

    root = scratch_dir("yl-reloadbench-")
    folder = build_model(root / "model", args.hidden, args.layers)
    size = sum(p.stat().st_size for p in folder.iterdir())
    moto = None
    if args.store == "s3":
        moto, endpoint = start_moto()
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        import boto3

        boto3.client("s3").create_bucket(Bucket="reloadbench")
        url = "s3://reloadbench/yl"
    else:
        url = str(root / "store")
    store = open_store(url)
    registry = CheckpointRegistry(store)
    registry.create_model(ModelInfo(slug="bench", base="bench"))
    registry.commit(Manifest("bench", "base", upload_folder(store, "bench", "base", folder)), set_head=True)

    admin_key, service_key = ensure_stack_keys(store, root)
    addresses: dict[str, str] = {}
    stoppers = []
    for service in ("checkpoint", "env", "rollout"):
        options = ServeOptions(
            service=service,
            data_dir=root,
            store=url,
            model="bench",
            env=EnvOptions(workers=0),
            checkpoint_address=addresses.get("checkpoint", ""),
            env_address=addresses.get("env", ""),
            service_key=service_key,
        )
        built = await build_service(options)
        start, stop = built.start, built.stop
        addresses[service] = await start()
        stoppers.append(stop)
    client = Client(rollout=addresses["rollout"], checkpoint=addresses["checkpoint"], timeout=600, api_key=admin_key)

    stop_load = asyncio.Event()
    counts = {"completed": 0, "failed": 0}
    errors: list[str] = []

    async def load(seed: int) -> None:
        while not stop_load.is_set():
            try:
                await client.generate([1, 2, 3, seed], sampling=sampling_params(max_tokens=8, temperature=1.0))
                counts["completed"] += 1
            except Exception as exc:  # counted, reported
                counts["failed"] += 1
                errors.append(repr(exc)[:200])

    loaders = [asyncio.create_task(load(seed)) for seed in range(4)]
    raw, reload = [], []
    for i in range(args.reloads):
        checkpoint_id = f"r{i:03d}"
        objects = await asyncio.to_thread(upload_folder, store, "bench", checkpoint_id, folder)
        manifest = Manifest("bench", checkpoint_id, objects, parent_checkpoint_id="base")
        # The raw baseline: reading the same bytes from the same store.
        scratch = pathlib.Path(tempfile.mkdtemp(dir=root))
        started = time.perf_counter()
        for obj in objects:
            await asyncio.to_thread(store.get_file, obj.key, scratch / obj.name)
        raw.append(time.perf_counter() - started)
        started = time.perf_counter()
        await client.commit_checkpoint(manifest, set_head=True)
        while (await client.generate([1, 2], sampling=sampling_params(max_tokens=1))).weight_version != checkpoint_id:
            await asyncio.sleep(0.005)
        reload.append(time.perf_counter() - started)
    stop_load.set()
    await asyncio.gather(*loaders)
    await client.close()
    for stop in reversed(stoppers):
        await stop(1.0)
    if moto:
        moto.terminate()
    raw_s, reload_s = statistics.median(raw), statistics.median(reload)
    return {
        "store": args.store,
        "checkpoint_mb": round(size / 2**20, 1),
        "reloads": args.reloads,
        "median_raw_read_s": round(raw_s, 3),
        "median_commit_to_first_token_s": round(reload_s, 3),
        "ratio_to_raw": round(reload_s / raw_s, 2),
        "goal_2x_plus_1s_met": reload_s <= 2 * raw_s + 1.0,
        "requests_completed_during_reloads": counts["completed"],
        "requests_failed_during_reloads": counts["failed"],
        "error_samples": errors[:3],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", choices=("fs", "s3"), default="fs")
    parser.add_argument("--reloads", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--out", type=pathlib.Path)
    run_and_report(bench, parser.parse_args())


if __name__ == "__main__":
    main()
