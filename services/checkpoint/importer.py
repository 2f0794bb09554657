"""Importing a Hugging Face model as a base slug: resolve the source offline, check it loads, commit it.

A source is a local folder in Hugging Face format, or a hub id ("org/name") whose snapshot is already in the
local Hugging Face cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``): nothing
is downloaded. The check is what transformers needs to use the model: ``AutoConfig`` and ``AutoTokenizer``
load, and the weights cover the parameters of ``AutoModelForCausalLM.from_config`` with the right shapes
(read from the safetensors headers against a model built on the meta device, so no weights are loaded).
Safetensors files are stored as they are; PyTorch ``.bin`` weights are converted once. Nothing is written
to the store before every check passed.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pathlib
import re
import tempfile

from yieldloop.errors import AlreadyExistsError, InvalidArgumentError, NotFoundError
from yieldloop.types import Head, Manifest, ModelInfo
from yieldloop_server.checkpoint.files import upload_folder
from yieldloop_server.checkpoint.registry import CheckpointRegistry, check_owner
from yieldloop_server.store.base import check_name

BASE_CHECKPOINT = "base"
# What a model folder's checkpoint keeps: weights, configs, tokenizer files, chat templates (top level only).
_KEPT = re.compile(r".*\.(safetensors|json|txt|model|jinja|tiktoken)$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def _invalid(source: str, message: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"cannot import {source!r}: {message}", reason="MODEL_SOURCE_INVALID",
                                field="source")


def hub_cache_dir() -> pathlib.Path:
    """The local Hugging Face hub cache, as the environment names it now."""
    if os.environ.get("HF_HUB_CACHE"):
        return pathlib.Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return pathlib.Path(home).expanduser() / "hub"


def resolve_source(source: str) -> pathlib.Path | None:
    """The folder ``source`` names (a directory, or a hub id's snapshot in the local cache), or None."""
    if not source or len(source) > 4096 or "\0" in source:
        return None
    path = pathlib.Path(source).expanduser()
    try:
        if path.is_dir():
            return path.resolve()
    except OSError:  # a name too long for the filesystem, a permission problem: not a readable folder
        return None
    if not _HUB_ID.fullmatch(source):
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return pathlib.Path(snapshot_download(source, cache_dir=hub_cache_dir(), local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None


def slug_for(source: str) -> str:
    """A slug derived from a source: the folder's or the repository's name, with other characters as "-"."""
    name = pathlib.Path(source.rstrip("/")).name or "model"
    return re.sub(r"[^A-Za-z0-9._-]", "-", name).lstrip("._-")[:128] or "model"


@dataclasses.dataclass
class ModelFacts:
    """What an import found in a model folder."""

    architecture: str
    num_parameters: int
    dtype: str
    has_chat_template: bool
    weights: list[pathlib.Path]
    """The safetensors files (empty when the weights are PyTorch .bin files, converted on upload)."""

    def base_info(self, slug: str, source: str, owner: str, size_bytes: int, public: bool = False) -> ModelInfo:
        """The record of a base slug holding these weights."""
        return ModelInfo(
            slug=slug, base=slug, owner=owner, trainable=True, architecture=self.architecture,
            num_parameters=self.num_parameters, dtype=self.dtype, has_chat_template=self.has_chat_template,
            source=source, size_bytes=size_bytes, public=public,
        )


def inspect_folder(folder: pathlib.Path, source: str) -> ModelFacts:
    """Checks that transformers can load the folder's config, tokenizer and weights; returns what it is.

    Raises:
        InvalidArgumentError: MODEL_SOURCE_INVALID naming what is missing or does not load.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not (folder / "config.json").is_file():
        raise _invalid(source, f"no config.json in {folder}")
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as err:  # transformers raises many kinds; the user's folder is to blame
        raise _invalid(source, f"config.json does not load: {err}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as err:
        raise _invalid(source, f"no tokenizer loads from {folder}: {err}") from None
    if isinstance(tokenizer, bool) or not hasattr(tokenizer, "encode"):
        raise _invalid(source, f"no tokenizer loads from {folder}")
    safetensors = sorted(folder.glob("*.safetensors"))
    pytorch = sorted(folder.glob("pytorch_model*.bin"))
    if not safetensors and not pytorch:
        raise _invalid(source, f"no weights (*.safetensors or pytorch_model*.bin) in {folder}")
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as err:
        raise _invalid(source, f"transformers has no causal LM for this config: {err}") from None
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    stored = _tensor_shapes(safetensors, source) if safetensors else _bin_shapes(pytorch, source)
    prefix = f"{model.base_model_prefix}."
    found = {name if name in expected or prefix + name not in expected else prefix + name: shape
             for name, (shape, _) in stored.items()}
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = sorted(set(expected) - set(found) - tied)
    if missing:
        raise _invalid(source, f"the weights lack {len(missing)} parameter(s), e.g. {missing[:3]}")
    wrong = sorted(name for name, shape in found.items() if name in expected and expected[name] != shape)
    if wrong:
        name = wrong[0]
        raise _invalid(source, f"{name} has shape {list(found[name])}, the config says {list(expected[name])}")
    dtypes = collections.Counter(dtype for _, dtype in stored.values())
    return ModelFacts(
        architecture=type(model).__name__,
        num_parameters=sum(_numel(shape) for shape, _ in stored.values()),
        dtype=dtypes.most_common(1)[0][0],
        has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
        weights=safetensors,
    )


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
                       "I64": "int64", "I32": "int32", "U8": "uint8", "I8": "int8", "BOOL": "bool"}


def _tensor_shapes(files: list[pathlib.Path], source: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, dtype) of every tensor, from the safetensors headers alone."""
    import json
    import struct

    tensors = {}
    for path in files:
        try:
            with open(path, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error) as err:
            raise _invalid(source, f"{path.name} is not a safetensors file: {err}") from None
        for name, spec in header.items():
            if name != "__metadata__":
                tensors[name] = (tuple(spec["shape"]), _SAFETENSORS_DTYPES.get(spec["dtype"], spec["dtype"].lower()))
    return tensors


def _bin_shapes(files: list[pathlib.Path], source: str) -> dict[str, tuple[tuple[int, ...], str]]:
    import torch

    tensors = {}
    for path in files:
        try:
            state = torch.load(path, map_location="meta", weights_only=True)
        except Exception as err:
            raise _invalid(source, f"{path.name} does not load: {err}") from None
        tensors.update({name: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in state.items()})
    return tensors


def _stage_converted(folder: pathlib.Path, staging: pathlib.Path) -> pathlib.Path:
    """The folder with its PyTorch weights saved as safetensors (transformers loads and saves the model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, torch_dtype="auto")
    model.save_pretrained(staging, safe_serialization=True)
    for path in folder.iterdir():
        if path.is_file() and _KEPT.match(path.name) and not (staging / path.name).exists():
            (staging / path.name).symlink_to(path)
    return staging


def import_model(
    registry: CheckpointRegistry, source: str, name: str, owner: str = "", public: bool = False
) -> tuple[ModelInfo, Head]:
    """Imports ``source`` as the base slug ``name``: checks first, then uploads, creates and commits.

    Raises:
        InvalidArgumentError: INVALID_FIELD (slug), MODEL_SOURCE_INVALID.
        NotFoundError: MODEL_SOURCE_NOT_FOUND.
        AlreadyExistsError: MODEL_ALREADY_EXISTS.
    """
    check_name(name, "name")
    check_owner(owner)
    try:
        registry.get_model(name)
        raise AlreadyExistsError(f"model {name!r} already exists", reason="MODEL_ALREADY_EXISTS")
    except NotFoundError:
        pass
    folder = resolve_source(source)
    if folder is None:
        raise NotFoundError(
            f"no model {source!r}: not a folder, and not in the local Hugging Face cache {hub_cache_dir()} "
            "(nothing is downloaded: put the model there or pass its folder)",
            reason="MODEL_SOURCE_NOT_FOUND", field="source",
        )
    facts = inspect_folder(folder, source)
    with tempfile.TemporaryDirectory() as tmp:
        staging = pathlib.Path(tmp)
        if facts.weights:  # safetensors: the files themselves, as they are
            for path in folder.iterdir():
                if path.is_file() and _KEPT.match(path.name):
                    (staging / path.name).symlink_to(path.resolve())
        else:
            _stage_converted(folder, staging)
        objects = upload_folder(registry.store, name, BASE_CHECKPOINT, staging)
    info = registry.create_model(facts.base_info(name, source, owner, sum(o.size for o in objects), public))
    _, head = registry.commit(Manifest(model=name, checkpoint_id=BASE_CHECKPOINT, objects=objects), set_head=True)
    assert head is not None
    return info, head

