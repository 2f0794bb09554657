"""What the HUD front's gateway hop costs: chat completions as the HUD SDK's agent sends them (return_token_ids,
logprobs), straight to RolloutService's OpenAI endpoint and through the HUD front (forwarded, the answer kept as
the trace's sample), alternating call by call against one in-process stack (auth on, as by default).

Reports the median and p90 latency per call of each way and their difference, sequential calls (one agent) and
at a concurrency of 16 (calls/s).

    python loadtest/hudbench.py [--calls 200] [--concurrency 16] [--max-tokens 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import sys
import time
import uuid

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from scratch import scratch_dir


async def bench(args: argparse.Namespace) -> dict:
    import aiohttp

    from yieldloop.client import Client
    from yieldloop_server.config import EnvOptions, StackConfig
    from yieldloop_server.stack import InProcessStack

    stack = InProcessStack(StackConfig(data_dir=scratch_dir("yl-hudbench-"), env=EnvOptions(workers=0)))
    await stack.start()
    try:
        async with Client(**stack.addresses, api_key=stack.api_key) as client:
            direct_url = (await client.get_serving_info()).openai_base_url + "/chat/completions"
        front_url = stack.hud_url + "/v1/chat/completions"
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Say a."}]}],
            "max_tokens": args.max_tokens,
            "temperature": 1.0,
            "logprobs": True,
            "return_token_ids": True,
            "ignore_eos": True,
        }
        headers = {"Authorization": f"Bearer {stack.api_key}"}
        async with aiohttp.ClientSession(headers=headers) as http:

            async def call(url: str) -> float:
                started = time.perf_counter()
                trace = {"Trace-Id": uuid.uuid4().hex} if url == front_url else {}
                async with http.post(url, json=body, headers=trace) as response:
                    answer = await response.json()
                    assert response.status == 200 and len(answer["choices"][0]["token_ids"]) == args.max_tokens
                return time.perf_counter() - started

            for url in (direct_url, front_url):  # warm-up
                await call(url)
            latency = {"direct": [], "front": []}
            for _ in range(args.calls):
                latency["direct"].append(await call(direct_url))
                latency["front"].append(await call(front_url))

            async def throughput(url: str) -> float:
                started = time.perf_counter()
                queue = iter(range(args.calls))

                async def worker() -> None:
                    for _ in queue:
                        await call(url)

                await asyncio.gather(*(worker() for _ in range(args.concurrency)))
                return args.calls / (time.perf_counter() - started)

            rates = {"direct": [], "front": []}
            for _ in range(3):
                rates["direct"].append(await throughput(direct_url))
                rates["front"].append(await throughput(front_url))
    finally:
        await stack.stop()

    def summary(values: list[float]) -> dict:
        ordered = sorted(values)
        return {"median_ms": 1000 * statistics.median(ordered), "p90_ms": 1000 * ordered[int(0.9 * (len(ordered) - 1))]}

    return {
        "calls": args.calls,
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "direct": summary(latency["direct"]),
        "front": summary(latency["front"]),
        "calls_per_s": {way: statistics.median(r) for way, r in rates.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    result = asyncio.run(bench(args))
    direct, front = result["direct"], result["front"]
    print(f"{args.calls} sequential chat completions of {args.max_tokens} tokens, alternating:")
    print(f"  direct to RolloutService  median {direct['median_ms']:.2f} ms  p90 {direct['p90_ms']:.2f} ms")
    print(
        f"  through the HUD front     median {front['median_ms']:.2f} ms  p90 {front['p90_ms']:.2f} ms  "
        f"(+{front['median_ms'] - direct['median_ms']:.2f} ms per call)"
    )
    rates = result["calls_per_s"]
    print(
        f"  at {args.concurrency} concurrent: {rates['direct']:.0f} calls/s direct, "
        f"{rates['front']:.0f} through the front "
        f"({rates['front'] / rates['direct']:.2f}x)"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
