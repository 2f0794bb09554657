"""LoRA forks: adapter-only checkpoints, served per request by their base's engine (never reloading it), and
the sampler's logprobs equal the trainer's on the same tokens (fp32, torch engine)."""

from __future__ import annotations

import asyncio
import hashlib
import pathlib

import pytest

from yieldloop import errors
from yieldloop.client import Client, sampling_params
from yieldloop.envs.letters import tasks
from yieldloop.proto.common.v1 import common_pb2 as common_pb
from yieldloop.types import LoraConfig

TOLERANCE = 1e-4
PROMPT = [1, 40, 41, 42, 43, 44]


async def sample(client: Client, model: str, seeds=(1, 2, 3), max_tokens: int = 16):
    return [
        await client.generate(
            PROMPT,
            model=model,
            sampling=sampling_params(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True),
        )
        for seed in seeds
    ]


def as_datums(completions) -> list[common_pb.Datum]:
    return [
        common_pb.Datum(input_tokens=(PROMPT + c.token_ids)[:-1], target_tokens=(PROMPT + c.token_ids)[1:])
        for c in completions
    ]


async def worst_gap(client: Client, model: str, completions) -> float:
    learner = await client.forward(datums=as_datums(completions), model=model)
    worst = 0.0
    for completion, logprobs in zip(completions, learner, strict=True):
        part = logprobs[len(PROMPT) - 1 :]
        assert len(part) == len(completion.logprobs)
        worst = max(worst, max(abs(a - b) for a, b in zip(part, completion.logprobs, strict=True)))
    return worst


async def test_lora_fork_trains_its_adapter_and_is_served_by_its_base_engine(stack, client: Client) -> None:
    base_head = (await client.get_head("tiny")).checkpoint_id
    forked = await client.fork_model("tiny", "lora-a", lora=LoraConfig(8))
    assert forked.head.checkpoint_id == "adapter-init"
    info = await client.get_model("lora-a")
    assert (info.kind, info.lora.alpha, info.adapter_base_model, info.adapter_base_checkpoint_id) == (
        "lora r=8",
        16.0,
        "tiny",
        base_head,
    )

    # A fresh adapter (B = 0) samples exactly like its base.
    base = await sample(client, "tiny", seeds=(1,))
    fresh = await sample(client, "lora-a", seeds=(1,))
    assert fresh[0].token_ids == base[0].token_ids and fresh[0].weight_version == "adapter-init"
    assert max(abs(a - b) for a, b in zip(fresh[0].logprobs, base[0].logprobs, strict=True)) < 1e-5

    # Two steps at a high learning rate move the adapter well away from zero.
    runs = [run async for run in client.stream_rollouts(tasks("ab"), group_size=4, model="lora-a")]
    assert {turn.weight_version for run in runs for turn in run.turns} == {"adapter-init"}
    for i in range(2):
        await client.forward_backward(runs=runs, model="lora-a")
        step = await client.optim_step(0.05, model="lora-a", save_state=i == 1)
    head = step.checkpoint.checkpoint_id
    assert (await client.get_head("tiny")).checkpoint_id == base_head  # the base never moves

    # The checkpoint holds the adapter and its optimizer state, not the base weights.
    objects = {o.name: o.size for o in (await client.get_checkpoint("lora-a", head)).objects}
    assert set(objects) == {"adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "trainer_state.json"}
    weights = {o.name: o.size for o in (await client.get_checkpoint("tiny", base_head)).objects}["model.safetensors"]
    print(
        f"LoRA r=8 checkpoint {sum(objects.values()):,} bytes (adapter {objects['adapter_model.safetensors']:,}) "
        f"vs the full model's weights {weights:,}"
    )
    assert objects["adapter_model.safetensors"] < weights / 4
    assert (await client.get_model("lora-a")).size_bytes == objects["adapter_model.safetensors"]

    # Served by the base's engine, loaded once: the adapter's reloads never reloaded the base.
    serving = await client.get_serving_info(wait_for_checkpoint_id=head, model="lora-a")
    assert (serving.weight_version, serving.adapter_base, serving.engine_weight_loads) == (head, f"tiny@{base_head}", 1)

    # The sampler's logprobs of the trained adapter equal the trainer's on the same tokens.
    trained = await sample(client, "lora-a")
    assert {c.weight_version for c in trained} == {head}
    worst = await worst_gap(client, "lora-a", trained)
    print(
        f"LoRA fork: max |rollout - trainer| logprob {worst:.2e} over {sum(len(c.token_ids) for c in trained)} tokens"
    )
    assert worst < TOLERANCE
    # ... and the adapter matters: the base scores those tokens differently.
    base_scores = await client.forward(datums=as_datums(trained), model="tiny")
    lora_scores = await client.forward(datums=as_datums(trained), model="lora-a")
    assert max(abs(a - b) for x, y in zip(base_scores, lora_scores) for a, b in zip(x, y)) > 1e-2

    # A candidate checkpoint of the fork is sampled on the same base engine, beside its head.
    candidates = [
        run async for run in client.stream_rollouts(tasks("ab"), model="lora-a", checkpoint_id="adapter-init")
    ]
    assert {turn.weight_version for run in candidates for turn in run.turns} == {"adapter-init"}
    assert (await client.get_serving_info(model="lora-a")).engine_weight_loads == 1


async def test_two_forks_trained_concurrently_from_two_clients(stack, client: Client) -> None:
    """A full fork and a LoRA fork, each trained by its own client at once: each head advances with its own steps
    only, and the files each rollout engine loaded are byte for byte what that fork's trainer saved."""
    await client.fork_model("tiny", "duo-full")
    await client.fork_model("tiny", "duo-lora", lora=LoraConfig(4, 8.0, ("q_proj", "v_proj")))
    runs = [run async for run in client.stream_rollouts(tasks("ab"), group_size=2)]

    async def train(slug: str) -> list[str]:
        async with Client(**stack.addresses, api_key=stack.api_key, timeout=120) as own:
            steps = []
            for _ in range(2):
                await own.forward_backward(runs=runs, model=slug)
                steps.append((await own.optim_step(1e-2, model=slug)).checkpoint.checkpoint_id)
            return steps

    full_steps, lora_steps = await asyncio.gather(train("duo-full"), train("duo-lora"))
    rollout_cache = pathlib.Path(stack.config.data_dir) / "work" / "rollout"
    for slug, steps in (("duo-full", full_steps), ("duo-lora", lora_steps)):
        tree = await client.list_checkpoints(slug)
        assert [c.checkpoint_id for c in tree][-2:] == steps and tree[-1].is_head
        assert (await client.get_checkpoint(slug, steps[1])).parent_checkpoint_id == steps[0]
        served = await client.get_serving_info(wait_for_checkpoint_id=steps[1], model=slug)
        assert served.weight_version == steps[1]
        for obj in (await client.get_checkpoint(slug, steps[1])).objects:
            loaded = rollout_cache / slug / steps[1] / obj.name
            assert hashlib.sha256(loaded.read_bytes()).hexdigest() == obj.sha256, (slug, obj.name)
    names = {o.name for o in (await client.get_checkpoint("duo-lora", lora_steps[1])).objects}
    assert "model.safetensors" not in names and "adapter_model.safetensors" in names


@pytest.mark.parametrize(
    "source, name, lora, reason",
    [
        ("tiny", "bad-rank", LoraConfig(0), "INVALID_FIELD"),
        ("tiny", "bad-alpha", LoraConfig(8, float("nan")), "INVALID_FIELD"),
        ("tiny", "bad-target", LoraConfig(8, 16.0, ("q_proj; rm",)), "INVALID_FIELD"),
        ("tiny@no-such-checkpoint", "bad-ckpt", LoraConfig(8), "CHECKPOINT_NOT_FOUND"),
        ("no-such-model", "bad-src", LoraConfig(8), "MODEL_NOT_FOUND"),
        ("tiny", "bad/slug", LoraConfig(8), "INVALID_FIELD"),
    ],
)
async def test_bad_lora_forks_are_refused_and_write_nothing(client: Client, source, name, lora, reason) -> None:
    before = {m.slug for m in (await client.list_models())}
    with pytest.raises(errors.YieldloopError) as err:
        await client.fork_model(source, name, lora=lora)
    assert err.value.reason == reason, err.value
    assert {m.slug for m in (await client.list_models())} == before


async def test_forks_of_a_lora_fork_keep_its_adapter(client: Client) -> None:
    await client.fork_model("tiny", "lora-parent", lora=LoraConfig(8))
    child = await client.fork_model("lora-parent", "lora-child")
    assert child.model.lora.rank == 8 and child.model.adapter_base_model == "tiny"
    with pytest.raises(errors.InvalidArgumentError) as err:
        await client.fork_model("lora-parent", "lora-rerank", lora=LoraConfig(4))
    assert "keep its adapter" in str(err.value)
    with pytest.raises(errors.AlreadyExistsError):
        await client.fork_model("tiny", "lora-parent", lora=LoraConfig(8))


def make_adapter(base: pathlib.Path, out: pathlib.Path, seed: int, targets="all-linear", rank: int = 8) -> pathlib.Path:
    """A trained-looking peft adapter of the tiny model (B drawn at random, not zero)."""
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        PeftLoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0),
    )
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    model.save_pretrained(out)
    return out


def reference_logprobs(base: pathlib.Path, adapter: pathlib.Path | None, prompt: list[int], tokens: list[int]):
    """The completion's logprobs under transformers (+ peft), fp32: what the trainer computes."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        logprobs = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float().log_softmax(-1)
    return [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


@pytest.mark.parametrize("kind", ["torch", "vllm"])
async def test_engines_apply_adapters_per_request(kind: str, tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path):
    """One engine, one copy of the base weights, requests for the base and two adapters in flight together; each
    request's logprobs equal transformers + peft on its own adapter (the trainer's computation)."""
    from yieldloop_server.rollout.engines import SamplingConfig, create_engine

    if kind == "vllm":
        from yieldloop_server.rollout.engines.vllm_engine import vllm_available

        if not vllm_available():
            pytest.skip("vLLM is not installed")
    folders = {
        "a": make_adapter(tiny_model_dir, tmp_path / "a", seed=1),
        "b": make_adapter(tiny_model_dir, tmp_path / "b", seed=2, targets=["q_proj", "v_proj"], rank=4),
        "a2": make_adapter(tiny_model_dir, tmp_path / "a2", seed=3),
    }
    engine = create_engine(kind, lora=True)
    try:
        await engine.load_weights(tiny_model_dir, "base")
        await engine.load_adapter("a", folders["a"], "a-1")
        await engine.load_adapter("b", folders["b"], "b-1")

        async def run(adapter: str, seed: int):
            deltas = [
                d
                async for d in engine.generate(
                    PROMPT, SamplingConfig(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True), adapter=adapter
                )
            ]
            return (
                [t for d in deltas for t in d.token_ids],
                [x for d in deltas for x in d.logprobs],
                {d.weight_version for d in deltas},
            )

        jobs = [("", 1), ("a", 2), ("b", 3), ("a", 4), ("", 5)]
        results = await asyncio.gather(*(run(adapter, seed) for adapter, seed in jobs))
        worst = 0.0
        for (adapter, _), (tokens, logprobs, versions) in zip(jobs, results, strict=True):
            assert versions == {f"{adapter}-1" if adapter else "base"}
            reference = reference_logprobs(tiny_model_dir, folders[adapter] if adapter else None, PROMPT, tokens)
            worst = max(worst, max(abs(x - y) for x, y in zip(logprobs, reference, strict=True)))
        print(f"{kind}: adapters per request, max |engine - peft| logprob {worst:.2e}")
        bound = TOLERANCE if kind == "torch" else 1e-3  # vLLM's CPU kernels differ in the last bits (test_engines)
        assert worst < bound

        # Replacing an adapter serves the new version; unloading one refuses its next request.
        await engine.load_adapter("a", folders["a2"], "a-2")
        tokens, logprobs, versions = await run("a", 6)
        assert versions == {"a-2"}
        reference = reference_logprobs(tiny_model_dir, folders["a2"], PROMPT, tokens)
        assert max(abs(x - y) for x, y in zip(logprobs, reference, strict=True)) < bound
        await engine.unload_adapter("b")
        with pytest.raises(errors.UnavailableError):
            await run("b", 7)
        assert engine.weight_loads == 1
    finally:
        await engine.close()


def test_a_lora_fork_in_the_registry(any_store) -> None:
    """A LoRA fork records its adapter config and frozen base; its first checkpoint is a fresh adapter's config;
    retention never deletes a checkpoint a LoRA fork's adapter applies to, even one that was never head."""
    import json

    from test_checkpoints import _commit

    from yieldloop.types import Manifest, ModelInfo, ObjectInfo
    from yieldloop_server.checkpoint.registry import CheckpointRegistry

    registry = CheckpointRegistry(any_store)
    registry.create_model(ModelInfo(slug="src", base="src"))
    _commit(registry, "src", "c1", b"one")
    key = "models/src/checkpoints/c2/model.safetensors"
    any_store.put_bytes(key, b"two")
    obj = ObjectInfo("model.safetensors", 3, hashlib.sha256(b"two").hexdigest(), key)
    registry.commit(Manifest(model="src", checkpoint_id="c2", objects=[obj], parent_checkpoint_id="c1"))  # not head
    _commit(registry, "src", "c3", b"three", parent_checkpoint_id="c1")

    info, head = registry.fork_model("src@c2", "ad", owner="team", lora=LoraConfig(8, 0.0, ("q_proj", "v_proj")))
    assert head.checkpoint_id == "adapter-init"
    assert registry.get_model("ad") == info
    assert (info.lora, info.adapter_base_model, info.adapter_base_checkpoint_id, info.kind) == (
        LoraConfig(8, 16.0, ("q_proj", "v_proj")),
        "src",
        "c2",
        "lora r=8",
    )
    [config] = registry.get_manifest("ad", "adapter-init").objects
    written = json.loads(any_store.get_bytes(config.key)[0])
    assert (written["peft_type"], written["r"], written["lora_alpha"], written["target_modules"]) == (
        "LORA",
        8,
        16.0,
        ["q_proj", "v_proj"],
    )
    assert registry.apply_retention("src", keep_last=1) == []  # c1 was head, c3 is last, c2 holds "ad"'s base
    assert registry.get_manifest("src", "c2").objects == [obj]
