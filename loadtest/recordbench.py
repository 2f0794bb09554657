"""Recording runs: one write per run (before issue 15) against one segment per batch (group commit).

128 runs of a GRPO batch (real-sized: ~300 prompt and 64 completion tokens each, logprobs included) finish
together, as at the end of a rollout. Measured in the same run, on the same store: the time to make all of
them durable one run at a time (two conditional puts each, what the rollout did before), and as the rollout
does now (one segment object plus one job marker per batch), plus reading them back by trace id.

Usage: ``python loadtest/recordbench.py [--store fs|s3] [--runs 128] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import sys
import time
import uuid

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from reloadbench import start_moto
from scratch import scratch_dir


def make_runs(n: int):
    from yieldloop.types import Run, Turn

    rng = random.Random(0)
    return [
        Run(
            group_id=f"g{i // 8}",
            reward=rng.random(),
            answer="abc",
            turns=[
                Turn(
                    prompt_token_ids=[rng.randrange(300) for _ in range(300)],
                    completion_token_ids=[rng.randrange(300) for _ in range(64)],
                    completion_logprobs=[-rng.random() for _ in range(64)],
                    weight_version="step-000001-abcdef12",
                )
            ],
        )
        for i in range(n)
    ]


def one_per_run(traces, runs, job: str) -> None:
    for run in runs:  # what TraceStore.put did per run before segments
        run.trace_id = uuid.uuid4().hex
        traces.store.put_bytes(f"traces/{run.trace_id}.pb", traces.encode(run), if_none_match=True)
        traces.store.put_bytes(f"jobs/{job}/runs/{time.time_ns():020d}-{run.trace_id}", b"")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", choices=("fs", "s3"), default="fs")
    parser.add_argument("--runs", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from yieldloop.convert import run_from_bytes, run_to_bytes
    from yieldloop_server.store import open_store
    from yieldloop_server.store.traces import TraceStore

    moto = None
    if args.store == "s3":
        import boto3

        moto, endpoint = start_moto()
        import os

        os.environ["AWS_ENDPOINT_URL"] = endpoint
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        url = "s3://bench/traces"
    else:
        url = str(scratch_dir("yl-recordbench-"))
    try:
        traces = TraceStore(open_store(url), run_to_bytes, run_from_bytes)
        times: dict[str, list[float]] = {"one write per run": [], "one segment per batch": [], "read back": []}
        for r in range(args.rounds):  # interleaved
            runs = make_runs(args.runs)
            start = time.perf_counter()
            one_per_run(traces, runs, f"old{r}")
            times["one write per run"].append(time.perf_counter() - start)
            runs = make_runs(args.runs)
            start = time.perf_counter()
            ids = traces.put_many(runs, f"new{r}")
            times["one segment per batch"].append(time.perf_counter() - start)
            fresh = TraceStore(traces.store, run_to_bytes, run_from_bytes)
            start = time.perf_counter()
            assert [fresh.get(i).trace_id for i in ids] == ids
            times["read back"].append(time.perf_counter() - start)
        size = len(run_to_bytes(make_runs(1)[0]))
        print(f"{args.runs} runs of {size} bytes each, store {args.store}, median of {args.rounds} rounds")
        for name, values in times.items():
            print(f"  {name:<24} {statistics.median(values) * 1000:8.1f} ms")
        old, new = (statistics.median(times[k]) for k in ("one write per run", "one segment per batch"))
        print(f"  speed-up of recording: {old / new:.1f}x")
    finally:
        if moto is not None:
            moto.terminate()


if __name__ == "__main__":
    main()
