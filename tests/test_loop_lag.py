"""No event-loop stall: while a huge prompt is refused and a 300-checkpoint tree is listed over S3, every
service's event loop (all four share one in the in-process stack) keeps answering within 100 ms (issue 14)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time

import pytest
import pytest_asyncio

from yieldloop import errors
from yieldloop.client import sampling_params

MAX_LAG_S = 0.1
ATTEMPTS = 3
"""A stall the code causes shows in every attempt; one caused by another process on a 2-core machine (a
previous test's engine shutting down) does not: the best of a few attempts is what is asserted."""


class LagProbe:
    """Sleeps 5 ms at a time and records how much later than asked the loop woke it."""

    def __init__(self) -> None:
        self.worst = 0.0

    async def run(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(0.005)
            self.worst = max(self.worst, time.perf_counter() - start - 0.005)

    @contextlib.asynccontextmanager
    async def measuring(self):
        self.worst = 0.0
        task = asyncio.create_task(self.run())
        await asyncio.sleep(0.05)
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def lag_stack(moto_endpoint, tmp_path_factory):
    from conftest import s3_stack

    async with s3_stack(moto_endpoint, tmp_path_factory.mktemp("lag"), timeout=300) as (stack, client, _):
        yield stack, client


async def test_no_stall_on_a_huge_prompt(lag_stack) -> None:
    _, client = lag_stack
    lags = []
    for _ in range(ATTEMPTS):
        probe = LagProbe()
        async with probe.measuring():
            # 4 MB: refused by its length alone; 120 KB: tokenized (in a worker thread), then refused.
            for text in ["letters " * 500_000, "letters " * 15_000] * 2:
                with pytest.raises(errors.InvalidArgumentError) as err:
                    await client.generate(
                        messages=[{"role": "user", "content": text}], sampling=sampling_params(max_tokens=2)
                    )
                assert err.value.reason == "PROMPT_TOO_LONG"
        lags.append(probe.worst)
        if probe.worst < MAX_LAG_S:
            break
    print(f"4 MB prompt: worst loop lag per attempt {[round(lag * 1000, 1) for lag in lags]} ms")
    assert min(lags) < MAX_LAG_S


async def test_no_stall_listing_300_checkpoints_over_s3(lag_stack) -> None:
    from yieldloop.types import Manifest, ObjectInfo
    from yieldloop_server.store import open_store

    stack, client = lag_stack
    await client.fork_model("tiny", "deep")
    store = open_store(stack.config.store_url)

    def commit_many() -> list[Manifest]:
        manifests = []
        for i in range(300):
            key = f"models/deep/checkpoints/c{i:03d}/model.safetensors"
            data = str(i).encode()
            store.put_bytes(key, data)
            manifests.append(
                Manifest(
                    "deep",
                    f"c{i:03d}",
                    [ObjectInfo("model.safetensors", len(data), hashlib.sha256(data).hexdigest(), key)],
                    parent_checkpoint_id=f"c{i - 1:03d}" if i else "base",
                    step=i + 1,
                )
            )
        return manifests

    for manifest in await asyncio.to_thread(commit_many):
        await client.commit_checkpoint(manifest)
    lags = []
    for _ in range(ATTEMPTS):
        probe = LagProbe()
        async with probe.measuring():
            start = time.perf_counter()
            listed = await asyncio.gather(
                *(client.list_checkpoints("deep") for _ in range(3)), client.get_head("tiny"), client.list_models()
            )
            took = time.perf_counter() - start
        assert len(listed[0]) == 301
        lags.append(probe.worst)
        if probe.worst < MAX_LAG_S:
            break
    print(
        f"3 x ListCheckpoints of 301 over S3 in {took:.2f} s: worst loop lag per attempt "
        f"{[round(lag * 1000, 1) for lag in lags]} ms"
    )
    assert min(lags) < MAX_LAG_S
