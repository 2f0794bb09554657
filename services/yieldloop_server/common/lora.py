"""LoRA adapters in peft's on-disk format, shared by the registry (a fork's first checkpoint), the trainer
(peft trains and saves them) and the rollout engines (which apply them per request).

A LoRA checkpoint folder holds ``adapter_config.json`` and, after the first optimizer step,
``adapter_model.safetensors`` (tensors ``base_model.model.<module>.lora_A.weight`` of shape (r, in) and
``...lora_B.weight`` of shape (out, r)). A fork's first checkpoint has the config only: a fresh adapter, whose
B is zero, so it samples exactly like its base; the trainer initialises A from a seed derived from the slug,
the same on every load.
"""

from __future__ import annotations

import functools
import hashlib
import json
import pathlib
from typing import Any

from yieldloop.types import LoraConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ALL_LINEAR = "all-linear"


def adapter_config(lora: LoraConfig, base: str = "") -> dict[str, Any]:
    """peft's ``adapter_config.json`` for ``lora`` (no dropout, no bias: the sampler and trainer agree)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha or 2 * lora.rank,
        "target_modules": list(lora.target_modules) or ALL_LINEAR,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": False,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
    }


@functools.cache
def linear_modules(config_json: str) -> frozenset[str]:
    """The names (last component, as peft's ``target_modules`` match them) of the linear layers of a model with
    this ``config.json``, built on the meta device (nothing allocated, nothing loaded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**json.loads(config_json))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return frozenset(
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name != "lm_head"
    )


def check_targets(targets: tuple[str, ...], config_json: str, model: str) -> None:
    """Every target names a linear layer of the model (peft would fail at the first training step otherwise).

    Raises:
        InvalidArgumentError: INVALID_FIELD ``lora.target_modules`` naming the model's linear layers and the
            closest one to each unknown target.
    """
    import difflib

    from yieldloop.errors import invalid_field

    if not targets or list(targets) == [ALL_LINEAR]:
        return
    try:
        names = linear_modules(config_json)
    except Exception:  # an architecture transformers cannot build here: the trainer decides at its first step
        return
    for target in targets:
        if target.rsplit(".", 1)[-1] not in names:
            close = difflib.get_close_matches(target, sorted(names), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise invalid_field(
                "lora.target_modules",
                f"{model} has no linear layer {target!r}{hint}; its linear layers: {', '.join(sorted(names))}",
            )


def init_seed(slug: str) -> int:
    """The seed a fresh adapter of ``slug`` is initialised from (stable across processes)."""
    return int.from_bytes(hashlib.sha256(slug.encode()).digest()[:4], "little")


def is_adapter(folder: pathlib.Path) -> bool:
    return (folder / CONFIG_FILE).is_file()


def read_scaling(folder: pathlib.Path) -> float:
    """alpha / r (alpha / sqrt(r) with rsLoRA) from an adapter folder's config."""
    config = json.loads((folder / CONFIG_FILE).read_text())
    rank = config["r"]
    return config["lora_alpha"] / (rank**0.5 if config.get("use_rslora") else rank)


def read_adapter(folder: pathlib.Path, device: str, dtype: str) -> dict[str, tuple[Any, Any, float]]:
    """Module name -> (A (r, in), B (out, r), scaling) of an adapter folder; empty for a fresh adapter."""
    import torch
    from safetensors.torch import load_file

    if not (folder / WEIGHTS_FILE).is_file():
        return {}
    scaling = read_scaling(folder)
    tensors = load_file(folder / WEIGHTS_FILE)
    layers: dict[str, tuple[Any, Any, float]] = {}
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        module = key.split(".lora_A.")[0].removeprefix("base_model.model.")
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        layers[module] = (a.to(device, getattr(torch, dtype)), b.to(device, getattr(torch, dtype)), scaling)
    return layers
