"""FSDP2 for the trainer: every weight, gradient and AdamW moment sharded over the ranks.

:func:`shard_model` wraps each decoder layer and then the whole model with ``fully_shard`` over a 1-D
DeviceMesh of the process group's ranks (parameters become DTensors, each rank holding 1/N of every tensor;
a layer's full weights exist only while it computes). Gradients are reduce-scattered as sums, not means (the
losses are sums over tokens and datums, so the sharded step equals the single-process step on the whole
batch). With a ``compute_dtype`` (bf16 on GPUs) the master weights stay fp32 and the layers compute in bf16,
gradients reduced in fp32 (``MixedPrecisionPolicy``).

:func:`write_safetensors` writes the sampler weights in Hugging Face's format from sharded weights: one file of
at most ``max_shard_bytes`` at a time (each tensor gathered in turn, on rank 0 only that file's tensors), an index
when there are several, the same bytes ``save_pretrained`` writes for the same weights.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable
from typing import Any

MAX_SHARD_BYTES = 5 * 1024**3
"""Sampler weights per safetensors file (an index names the files when there are several)."""


def decoder_layers(model: Any) -> list[Any]:
    """The model's repeated blocks: modules of the classes its ``_no_split_modules`` names (transformers' own
    list of what must stay whole on one device)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def shard_model(model: Any, device: str, compute_dtype: str = "", group: int = 0) -> Any:
    """``model`` sharded in place over every rank of the default process group (see the module's doc); with
    ``group`` ranks per shard group (HSDP: ``world / group`` replicas, each a full copy sharded over its group,
    gradients reduce-scattered within a group and summed across the replicas: fast links within a node, one
    all-reduce between nodes)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    world, kind = dist.get_world_size(), "cuda" if device.startswith("cuda") else "cpu"
    if group and group < world:
        if world % group:
            raise ValueError(f"{world} ranks do not split into shard groups of {group}")
        mesh = init_device_mesh(kind, (world // group, group), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(kind, (world,))
    policy = MixedPrecisionPolicy()
    if compute_dtype:
        policy = MixedPrecisionPolicy(param_dtype=getattr(torch, compute_dtype), reduce_dtype=torch.float32)
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules) to shard by")
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        # untied, the embedding and the output layer each gather alone (together they would double the largest
        # group's full weights: for Qwen2.5 each is bigger than a decoder layer)
        for module in (model.get_input_embeddings(), model.get_output_embeddings()):
            if module is not None:
                fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sums: the default divides by the world size
            module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no pre-multiplied sum)
    return model


def is_sharded(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local(tensor: Any) -> Any:
    """This rank's part of a sharded tensor (the tensor itself otherwise)."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def like(param: Any, values: Any) -> Any:
    """``values`` (a host copy of this rank's part) as a tensor laid out like ``param``, on its device."""
    if not is_sharded(param):
        return values.to(param.device)
    from torch.distributed.tensor import DTensor

    device = param.to_local().device
    return DTensor.from_local(
        values.to(device), param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
    )


def writes_files() -> bool:
    """Whether this rank writes the files every rank computes (rank 0)."""
    import torch.distributed as dist

    return dist.get_rank() == 0


def full(tensor: Any) -> Any:
    """The whole tensor on this rank's host (a collective for a sharded one: every rank calls it in turn)."""
    whole = tensor.full_tensor() if is_sharded(tensor) else tensor
    return whole.detach().to("cpu").contiguous()


def unique_weights(model: Any) -> list[tuple[str, Any]]:
    """The state dict's tensors, a tied weight (the output layer sharing the embedding) under the embedding's
    name only, as ``save_pretrained`` writes it."""
    tied = _tied_names(model)
    return [(name, tensor) for name, tensor in model.state_dict().items() if name not in tied]


def _tied_names(model: Any) -> set[str]:
    """State-dict names of weights tied to another (transformers drops them on save)."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return set()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {n for n, m in model.named_modules() if m is head}
    return {f"{n}.weight" for n in names}


def write_safetensors(
    named: Iterable[tuple[str, Any]],
    folder: pathlib.Path | None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> list[str]:
    """Writes ``named`` tensors as Hugging Face safetensors under ``folder`` (rank 0; other ranks pass None and
    only join the gathers): ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` files of at most
    ``max_shard_bytes`` each plus ``model.safetensors.index.json``. Returns the file names."""
    from safetensors.torch import save_file

    named = list(named)
    groups: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, tensor))
        size += nbytes
    count = len(groups)
    files = (
        ["model.safetensors"] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    )
    for file, group in zip(files, groups, strict=True):
        tensors = {name: full(tensor) for name, tensor in group}  # this file's tensors only
        if folder is not None:
            save_file(tensors, str(folder / file), metadata={"format": "pt"})
        del tensors
    if folder is not None and count > 1:
        total = sum(t.numel() * t.element_size() for _, t in named)
        index = {
            "metadata": {"total_size": total},
            "weight_map": {name: file for file, group in zip(files, groups, strict=True) for name, _ in group},
        }
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return files


DCP_PREFIX = "optimizer-dcp-"
"""The sharded optimizer state's files in a checkpoint folder: torch.distributed.checkpoint's own files (one per
rank and its metadata), named with this prefix so that the folder stays flat."""


def has_optimizer(folder: pathlib.Path) -> bool:
    return (folder / (DCP_PREFIX + ".metadata")).is_file()


def save_optimizer(model: Any, optimizer: Any, folder: pathlib.Path) -> None:
    """Every rank writes its shards of the AdamW state at once (``torch.distributed.checkpoint``), into
    ``folder`` as :data:`DCP_PREFIX` files; a resume on any number of ranks reads them back (resharded)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    staging = folder / DCP_PREFIX.rstrip("-")
    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(staging))
    dist.barrier()
    if writes_files():
        for path in staging.iterdir():
            path.replace(folder / (DCP_PREFIX + path.name))
        staging.rmdir()
    dist.barrier()


def load_optimizer(model: Any, optimizer: Any, folder: pathlib.Path) -> None:
    """The AdamW state :func:`save_optimizer` wrote, at any world size, into this process's optimizer: sharded
    over this process group's ranks, or whole in a process without one."""
    import tempfile

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    with tempfile.TemporaryDirectory(prefix="yl-dcp-") as view:  # DCP reads a folder of its own file names
        for path in folder.iterdir():
            if path.name.startswith(DCP_PREFIX):
                (pathlib.Path(view) / path.name[len(DCP_PREFIX) :]).symlink_to(path.resolve())
        state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.load(
            state, checkpoint_id=view, no_dist=not dist.is_initialized() or not any(map(is_sharded, model.parameters()))
        )
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def load_whole_optimizer(model: Any, optimizer: Any, state: dict) -> None:
    """An unsharded optimizer's ``state_dict()`` (moments of the whole trainable tensors, keyed by their order
    among the model's trainable parameters) into this sharded optimizer: every rank keeps its shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = [name for name, param in model.named_parameters() if param.requires_grad]
    by_name = {
        "state": {names[int(i)]: values for i, values in state["state"].items()},
        "param_groups": [
            {**group, "params": [names[int(i)] for i in group["params"]]} for group in state["param_groups"]
        ],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))
