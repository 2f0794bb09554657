"""One bad request fails only itself: sampling values are checked before a request reaches an engine, and an
engine-side failure of one request leaves the others of its batch running (issue 14)."""

from __future__ import annotations

import asyncio
import contextlib
import math

import pytest

from yieldloop import errors
from yieldloop.client import Client, sampling_params

PROMPT = [1, 40, 41, 42]


async def good(client: Client, seed: int):
    return await client.generate(PROMPT, sampling=sampling_params(max_tokens=12, seed=seed, ignore_eos=True))


@pytest.mark.parametrize(
    "poison",
    [
        {"temperature": math.nan},
        {"temperature": 1e-45},
        {"temperature": math.inf},
        {"temperature": -1.0},
        {"top_p": math.nan},
        {"top_p": -0.5},
        {"top_p": 1.5},
        {"stop": [""]},
        {"max_tokens": 0},
        {"max_tokens": 2**21},
        {"stop": ["x"] * 17},
        {"seed": -1},
    ],
)
async def test_a_poisoned_generate_beside_eight_good_ones(client: Client, poison) -> None:
    async def bad():
        return await client.generate(PROMPT, sampling=sampling_params(**{"max_tokens": 8, **poison}))

    results = await asyncio.gather(bad(), *(good(client, seed) for seed in range(1, 9)), return_exceptions=True)
    assert isinstance(results[0], errors.InvalidArgumentError), results[0]
    assert results[0].field.startswith("sampling."), results[0].field
    for done in results[1:]:
        assert not isinstance(done, BaseException), done
        assert len(done.token_ids) == 12 and all(math.isfinite(x) for x in done.logprobs)


@pytest.mark.parametrize(
    "body, field",
    [
        ('{"model": "tiny", "prompt": [1, 40], "stop": [1]}', "stop"),
        ('{"model": "tiny", "prompt": [1, 40], "stop": 5}', "stop"),
        ('{"model": "tiny", "prompt": [1, 40], "temperature": NaN}', None),
        ('{"model": "tiny", "prompt": [1, 40], "seed": 1e300}', "seed"),
        ('{"model": "tiny", "prompt": [1, 40], "seed": "abc"}', "seed"),
        ('{"model": "tiny", "prompt": [1, 40], "seed": 18446744073709551616}', "seed"),
        ('{"model": "tiny", "prompt": [1, 40], "max_tokens": true}', "max_tokens"),
        ('{"model": "tiny", "prompt": [1, 40], "n": 0}', "n"),
        ('{"model": "tiny", "prompt": [1, 40], "top_k": -5}', "top_k"),
        ('{"model": "tiny", "prompt": [1, 40], "stop": {"a": 1}}', "stop"),
        ('{"model": "tiny", "prompt": [1, 40], "temperature": 1e-45}', "temperature"),
    ],
)
async def test_a_poisoned_http_request_beside_eight_good_ones(client: Client, body: str, field) -> None:
    import aiohttp

    base_url = (await client.get_serving_info()).openai_base_url
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {client.transport.api_key}"}) as http:

        async def post(data: str):
            async with http.post(
                f"{base_url}/completions", data=data, headers={"content-type": "application/json"}
            ) as response:
                return response.status, await response.json()

        good_body = '{"model": "tiny", "prompt": [1, 40, 41], "max_tokens": 6, "ignore_eos": true, "seed": %d}'
        results = await asyncio.gather(post(body), *(post(good_body % seed) for seed in range(1, 9)))
    status, answer = results[0]
    assert status == 400, answer
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["code"]
    if field:
        assert answer["error"]["param"] == field, answer
    for status, answer in results[1:]:
        assert status == 200 and len(answer["choices"][0]["token_ids"]) == 6, answer


@contextlib.asynccontextmanager
async def torch_engine_serving(model_dir):
    """A torch engine on the tiny model; yields ``run(seed, max_tokens)`` -> how many tokens it generated."""
    from yieldloop_server.rollout.engines import SamplingConfig, create_engine

    engine = create_engine("torch", batch_wait_s=0.05)
    try:
        await engine.load_weights(model_dir, "v1")

        async def run(seed: int, max_tokens: int) -> int:
            config = SamplingConfig(max_tokens=max_tokens, seed=seed, ignore_eos=True)
            return sum([len(d.token_ids) async for d in engine.generate(PROMPT, config)])

        yield run
    finally:
        await engine.close()


async def test_an_engine_failure_of_one_request_fails_that_request_only(tiny_model_dir, monkeypatch) -> None:
    """Inside the torch engine: sampling one request's token raises; its 8 batch mates finish."""
    from yieldloop_server.rollout.engines import torch_engine

    real = torch_engine.sample_batch

    def flaky(logits, samplings, uniforms):
        if any(sampling.seed == 666 for sampling in samplings):
            raise RuntimeError("injected sampling failure")
        return real(logits, samplings, uniforms)

    monkeypatch.setattr(torch_engine, "sample_batch", flaky)
    async with torch_engine_serving(tiny_model_dir) as run:
        results = await asyncio.gather(run(666, 10), *(run(seed, 10) for seed in range(1, 9)), return_exceptions=True)
    assert isinstance(results[0], errors.UnavailableError) and "injected" in str(results[0])
    assert results[1:] == [10] * 8


async def test_a_failed_prefill_fails_its_requests_and_the_engine_goes_on(tiny_model_dir, monkeypatch) -> None:
    """The torch engine's prefill of joining requests raises once: those requests fail (retryably), none hangs,
    and the next request is served."""
    from yieldloop_server.rollout.engines import torch_engine

    real = torch_engine._Batch._forward
    failures = [RuntimeError("injected prefill failure")]

    def flaky(self, rows, **inputs):
        if inputs["input_ids"].shape[1] > 1 and failures:
            raise failures.pop()
        return real(self, rows, **inputs)

    monkeypatch.setattr(torch_engine._Batch, "_forward", flaky)
    async with torch_engine_serving(tiny_model_dir) as run:
        first = await asyncio.wait_for(asyncio.gather(run(1, 5), run(2, 5), return_exceptions=True), 30)
        assert all(isinstance(r, errors.UnavailableError) and "injected" in str(r) for r in first), first
        assert await asyncio.wait_for(run(3, 5), 30) == 5
