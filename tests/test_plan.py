"""`yieldloop plan`: the memory arithmetic of each plane, against the seeds' sizing table and the trainer's own
tensors."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

from yieldloop_server.plan import Inputs, Shape, gpu_gib, make_plan, trainer_layout

CONFIGS = pathlib.Path(__file__).parent / "data" / "configs"

# The sizing guide our users plan with: trainer GPUs, rollout GPUs (servers x tensor parallel) for 2048
# environments on H200s, and 8-16 CPU instances for those environments.
SEEDS_TABLE = {
    "qwen2.5-7b.json": (1, 2, 1),
    "qwen2.5-32b.json": (4, 8, 4),
    "llama-3.1-70b.json": (8, 16, None),
}


@pytest.mark.parametrize("name", sorted(SEEDS_TABLE))
def test_plan_agrees_with_the_sizing_table(name: str) -> None:
    trainer_gpus, rollout_gpus, tensor_parallel = SEEDS_TABLE[name]
    plan = make_plan(json.loads((CONFIGS / name).read_text()), Inputs(gpu_gib=gpu_gib("h200"), gpu="h200"), name)
    assert plan["trainer"]["choice"]["gpus"] == trainer_gpus
    assert plan["rollout"]["choice"]["gpus"] == rollout_gpus
    if tensor_parallel is not None:  # the guide names 4-way for 32B and one GPU per server for 7B
        assert plan["rollout"]["choice"]["tensor_parallel"] == tensor_parallel
    assert plan["environments"]["instances"] == 8 and plan["environments"]["instances_at_most"] == 16
    choice = plan["trainer"]["choice"]
    assert choice["per_gpu_gib"]["total"] <= gpu_gib("h200")
    # the layouts with fewer GPUs do not fit, whatever their sharding and offload
    assert not any(layout["fits"] for layout in plan["trainer"]["layouts"] if layout["gpus"] < trainer_gpus)
    deploy = plan["commands"]["deploy"]
    assert deploy["yieldloop-trainer.nvidia.com/gpu"] == trainer_gpus
    assert deploy["yieldloop-rollout.replicas"] * deploy["yieldloop-rollout.nvidia.com/gpu"] == rollout_gpus


def test_parameter_counts_are_the_models_own() -> None:
    """The count from config.json equals transformers' model built from it (on the meta device), for Qwen2 (q/k/v
    biases, untied) and Llama (no biases); peft's all-linear LoRA adapter has the counted parameters."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    for name in ("qwen2.5-7b.json", "llama-3.1-70b.json"):
        config = json.loads((CONFIGS / name).read_text())
        small = {
            **config,
            "hidden_size": 256,
            "intermediate_size": 704,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 1000,
        }
        hf_config = AutoConfig.for_model(small.pop("model_type"), **small)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
        shape = Shape.from_config({**small, "model_type": config["model_type"]})
        assert shape.parameters == sum(p.numel() for p in model.parameters()), name
        with torch.device("meta"):
            peft_model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
        trained = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        assert shape.lora_parameters(8) == trained, name


def test_trainer_states_are_what_a_trainer_holds(tiny_model_dir: pathlib.Path) -> None:
    """The one-process layout's weights, gradients and optimizer figures are the bytes of a trainer's tensors
    after a step (float32 on CPU)."""
    from test_packing import LENGTHS, ragged_datums

    from yieldloop_server.trainer.trainer import AdamConfig, Trainer

    trainer = Trainer(tiny_model_dir)
    trainer.forward_backward(ragged_datums(trainer.vocab_size, LENGTHS), "importance_sampling", {})
    trainer.apply_step(AdamConfig(learning_rate=1e-3), keep=False)  # the moments exist, the gradients still too
    params = list(trainer.model.parameters())
    held = {
        "weights": sum(p.numel() * p.element_size() for p in params),
        "gradients": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
        "optimizer": sum(
            t.numel() * t.element_size()
            for state in trainer.optimizer.state.values()
            for t in state.values()
            if torch.is_tensor(t) and t.dim() > 0
        ),
    }
    config = json.loads((tiny_model_dir / "config.json").read_text())
    layout = trainer_layout(
        Shape.from_config(config), Inputs(gpu_gib=1000, gpu="test", trainer_dtype_bytes=4), 1, "none"
    )
    for part, nbytes in held.items():
        assert layout["per_gpu_bytes"][part] == nbytes, part
    assert Shape.from_config(config).parameters == sum(p.numel() for p in params)


def test_plan_command(tmp_path: pathlib.Path, tiny_model_dir: pathlib.Path) -> None:
    """The command, on a folder and on a model in a store; a typed error for a model it cannot find."""
    from yieldloop_server.checkpoint.registry import CheckpointRegistry, Manifest, ModelInfo
    from yieldloop_server.store import open_store
    from yieldloop_server.weights.files import upload_folder

    def plan(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "yieldloop.cli", "plan", *args], capture_output=True, text=True, timeout=120
        )

    out = plan(str(CONFIGS / "qwen2.5-32b.json"), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["trainer"]["choice"]["gpus"] == 4
    text = plan(str(CONFIGS / "qwen2.5-7b.json"), "--gpu", "h100", "--lora-rank", "16").stdout
    assert "LoRA rank 16" in text and "<- chosen" in text and "yieldloop serve rollout" in text

    store = open_store(str(tmp_path / "store"))
    registry = CheckpointRegistry(store)
    registry.create_model(ModelInfo(slug="tiny", base="tiny"))
    registry.commit(Manifest("tiny", "base", upload_folder(store, "tiny", "base", tiny_model_dir)), set_head=True)
    out = plan("tiny", "--store", str(tmp_path / "store"), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["model"]["source"] == "tiny@base"

    missing = plan("no-such-model", "--data-dir", str(tmp_path))
    assert missing.returncode == 2 and "MODEL_NOT_FOUND" in missing.stderr
    bad = plan(str(CONFIGS / "qwen2.5-7b.json"), "--seq-len", "0")
    assert bad.returncode == 2 and "seq_len" in bad.stderr


def test_sharded_trainer_states_are_a_share_of_the_model(tiny_model_dir: pathlib.Path) -> None:
    """FSDP over 2 ranks: rank 0 holds what the plan says of the weights, gradients and moments (1/2 of each,
    within the rows FSDP pads each tensor's shards to), against the whole model one process holds."""
    from test_packing import LENGTHS, ragged_datums

    from yieldloop_server.trainer.distributed import DistributedTrainer
    from yieldloop_server.trainer.sharding import local
    from yieldloop_server.trainer.trainer import AdamConfig, TrainerConfig

    trainer = DistributedTrainer(tiny_model_dir, TrainerConfig(shard="fsdp"), 2)
    try:
        trainer.forward_backward(ragged_datums(trainer.vocab_size, LENGTHS), "importance_sampling", {})
        trainer.optim_step(AdamConfig(learning_rate=1e-3), revocable=True)  # the gradients kept until finish_step
        params = list(trainer.model.parameters())
        held = {
            "weights": sum(local(p).numel() * 4 for p in params),
            "gradients": sum(local(p.grad).numel() * 4 for p in params if p.grad is not None),
            "optimizer": sum(
                local(t).numel() * 4
                for state in trainer.optimizer.state.values()
                for t in state.values()
                if torch.is_tensor(t) and t.dim() > 0
            ),
        }
        trainer.finish_step(True)
    finally:
        trainer.close()
    shape = Shape.from_config(json.loads((tiny_model_dir / "config.json").read_text()))
    inputs = Inputs(gpu_gib=1000, gpu="test", trainer_dtype_bytes=4)
    planned = trainer_layout(shape, inputs, 2, "fsdp")["per_gpu_bytes"]
    whole = trainer_layout(shape, inputs, 1, "none")["per_gpu_bytes"]
    for part, nbytes in held.items():
        assert nbytes == pytest.approx(planned[part], rel=0.02), part
        assert nbytes == pytest.approx(whole[part] / 2, rel=0.02), part
