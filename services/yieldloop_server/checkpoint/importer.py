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
from collections.abc import AsyncIterator, Sequence

from yieldloop.errors import (
    AlreadyExistsError,
    DataLossError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    invalid_field,
)
from yieldloop.types import Head, Manifest, ModelInfo
from yieldloop.uploads import CHECKPOINT_FILE, MODEL_FILE, UPLOADED_FILE
from yieldloop_server.checkpoint.registry import CheckpointRegistry, check_owner
from yieldloop_server.store.base import check_name
from yieldloop_server.weights.files import upload_folder

BASE_CHECKPOINT = "base"
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def _invalid(source: str, message: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"cannot import {source!r}: {message}", reason="MODEL_SOURCE_INVALID", field="source")


def hub_cache_dir() -> pathlib.Path:
    """The local Hugging Face hub cache, as the environment names it now."""
    if os.environ.get("HF_HUB_CACHE"):
        return pathlib.Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return pathlib.Path(home).expanduser() / "hub"


def is_hub_id(source: str) -> bool:
    """Whether ``source`` names a hub repository ("org/name"), not a path ("./x", "/x", "~/x" are paths)."""
    return bool(_HUB_ID.fullmatch(source)) and not source.startswith((".", "~"))


def resolve_source(source: str) -> pathlib.Path | None:
    """The folder ``source`` names (a directory, or a hub id's snapshot in the local cache), or None. For the
    stack's own start (``yieldloop up --model``); requests go through :meth:`ImportPolicy.folder`."""
    if not source or len(source) > 4096 or "\0" in source:
        return None
    path = pathlib.Path(source).expanduser()
    try:
        if path.is_dir():
            return path.resolve()
    except OSError:  # a name too long for the filesystem, a permission problem: not a readable folder
        return None
    return hub_snapshot(source)


def hub_snapshot(source: str) -> pathlib.Path | None:
    """A hub id's snapshot folder in the local Hugging Face cache, or None (nothing is downloaded)."""
    if not is_hub_id(source):
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return pathlib.Path(snapshot_download(source, cache_dir=hub_cache_dir(), local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None


def check_new_model(registry: CheckpointRegistry, name: str, owner: str) -> None:
    """INVALID_ARGUMENT for a malformed slug or owner, ALREADY_EXISTS (MODEL_ALREADY_EXISTS) for a taken one."""
    check_name(name, "name")
    check_owner(owner)
    try:
        registry.get_model(name)
        raise AlreadyExistsError(f"model {name!r} already exists", reason="MODEL_ALREADY_EXISTS")
    except NotFoundError:
        pass


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
            slug=slug,
            base=slug,
            owner=owner,
            trainable=True,
            architecture=self.architecture,
            num_parameters=self.num_parameters,
            dtype=self.dtype,
            has_chat_template=self.has_chat_template,
            source=source,
            size_bytes=size_bytes,
            public=public,
        )


def inspect_folder(folder: pathlib.Path, source: str) -> ModelFacts:
    """Checks that transformers can load the folder's config, tokenizer and weights; returns what it is.

    Raises:
        InvalidArgumentError: MODEL_SOURCE_INVALID naming what is missing or does not load.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not (folder / "config.json").is_file():
        raise _invalid(source, "no config.json")
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as err:  # transformers raises many kinds; the user's folder is to blame
        raise _invalid(source, f"config.json does not load: {err}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as err:
        raise _invalid(source, f"no tokenizer loads: {err}") from None
    if isinstance(tokenizer, bool) or not hasattr(tokenizer, "encode"):
        raise _invalid(source, "no tokenizer loads")
    safetensors = sorted(folder.glob("*.safetensors"))
    pytorch = sorted(folder.glob("pytorch_model*.bin"))
    if not safetensors and not pytorch:
        raise _invalid(source, "no weights (*.safetensors or pytorch_model*.bin)")
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as err:
        raise _invalid(source, f"transformers has no causal LM for this config: {err}") from None
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    stored = _tensor_shapes(safetensors, source) if safetensors else _bin_shapes(pytorch, source)
    prefix = f"{model.base_model_prefix}."
    found = {
        name if name in expected or prefix + name not in expected else prefix + name: shape
        for name, (shape, _) in stored.items()
    }
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


_SAFETENSORS_DTYPES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
    "U8": "uint8",
    "I8": "int8",
    "BOOL": "bool",
}


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
        if path.is_file() and CHECKPOINT_FILE.fullmatch(path.name) and not (staging / path.name).exists():
            (staging / path.name).symlink_to(path)
    return staging


@dataclasses.dataclass(frozen=True)
class ImportPolicy:
    """Which server-side folders a request may import: admin keys only, under ``roots``, never inside
    ``forbidden`` (the stack's data directory, the store). Both are resolved (symlinks, ``..``) before the check."""

    roots: tuple[pathlib.Path, ...] = ()
    forbidden: tuple[pathlib.Path, ...] = ()

    def folder(self, source: str, admin: bool) -> pathlib.Path:
        """The folder a request's ``source`` may import: a hub id's snapshot (anyone), or an allowed path.

        Raises:
            PermissionDeniedError: ROLE_NOT_ALLOWED (a path from a key that is not admin), IMPORT_PATH_REFUSED.
            NotFoundError: MODEL_SOURCE_NOT_FOUND.
        """
        if is_hub_id(source):
            folder = hub_snapshot(source)
            if folder is None:
                raise NotFoundError(
                    f"no model {source!r} in the checkpoint service's local Hugging Face cache (nothing is "
                    "downloaded: put it there, or upload the folder: `yieldloop models import ./folder`)",
                    reason="MODEL_SOURCE_NOT_FOUND",
                    field="source",
                )
            return folder
        if not admin:
            raise PermissionDeniedError(
                "only admin keys import from the checkpoint service's filesystem: upload the folder from your "
                "machine (`yieldloop models import ./folder`, Client.import_model of a local folder) or name a hub "
                "id in the service's Hugging Face cache",
                reason="ROLE_NOT_ALLOWED",
                field="source",
            )
        if not source or len(source) > 4096 or "\0" in source:
            raise invalid_field("source", "a source is a hub id or a folder path")
        try:
            path = pathlib.Path(source).expanduser().resolve(strict=True)
        except (OSError, RuntimeError):
            path = None
        roots = [root.resolve() for root in self.roots]
        if path is None or not any(path.is_relative_to(root) for root in roots):
            raise PermissionDeniedError(
                f"{source!r} is not a folder under an import root of this service (--import-roots: "
                f"{', '.join(map(str, roots)) or 'none'}); upload it instead",
                reason="IMPORT_PATH_REFUSED",
                field="source",
            )
        for inside in (place.resolve() for place in self.forbidden):
            if path.is_relative_to(inside) or inside.is_relative_to(path):
                raise PermissionDeniedError(
                    f"{source!r} is (or holds) the stack's own data ({inside}): never importable",
                    reason="IMPORT_PATH_REFUSED",
                    field="source",
                )
        if not path.is_dir():
            raise NotFoundError(f"{source!r} is not a folder", reason="MODEL_SOURCE_NOT_FOUND", field="source")
        return path


def import_model(
    registry: CheckpointRegistry,
    source: str,
    name: str,
    owner: str = "",
    public: bool = False,
    folder: pathlib.Path | None = None,
) -> tuple[ModelInfo, Head]:
    """Imports ``source`` (or ``folder``, recorded as coming from ``source``) as the base slug ``name``: checks
    first, then uploads, creates and commits.

    Raises:
        InvalidArgumentError: INVALID_FIELD (slug), MODEL_SOURCE_INVALID.
        NotFoundError: MODEL_SOURCE_NOT_FOUND.
        AlreadyExistsError: MODEL_ALREADY_EXISTS.
    """
    check_new_model(registry, name, owner)
    folder = folder or resolve_source(source)
    if folder is None:
        raise NotFoundError(
            f"no model {source!r}: not a folder, and not in the local Hugging Face cache {hub_cache_dir()} "
            "(nothing is downloaded: put the model there or pass its folder)",
            reason="MODEL_SOURCE_NOT_FOUND",
            field="source",
        )
    facts = inspect_folder(folder, source)
    with tempfile.TemporaryDirectory() as tmp:
        staging = pathlib.Path(tmp)
        if facts.weights:  # safetensors: the files themselves, as they are
            for path in folder.iterdir():
                if path.is_file() and CHECKPOINT_FILE.fullmatch(path.name):
                    (staging / path.name).symlink_to(path.resolve())
        else:
            _stage_converted(folder, staging)
        objects = upload_folder(registry.store, name, BASE_CHECKPOINT, staging)
    info = registry.create_model(facts.base_info(name, source, owner, sum(o.size for o in objects), public))
    _, head = registry.commit(Manifest(model=name, checkpoint_id=BASE_CHECKPOINT, objects=objects), set_head=True)
    assert head is not None
    return info, head


MAX_UPLOAD_FILES = 256


@dataclasses.dataclass(frozen=True)
class UploadedFile:
    """One file of an upload, as its header declares it."""

    name: str
    size: int
    sha256: str


def check_upload(files: Sequence[UploadedFile], max_bytes: int) -> None:
    """INVALID_ARGUMENT for a header whose files a model folder cannot hold; RESOURCE_EXHAUSTED
    (REQUEST_TOO_LARGE) past the service's limits."""
    if not files:
        raise invalid_field("header.files", "an upload names the folder's files (weights, config, tokenizer)")
    if len(files) > MAX_UPLOAD_FILES:
        raise ResourceExhaustedError(
            f"an upload holds at most {MAX_UPLOAD_FILES} files, not {len(files)}",
            reason="REQUEST_TOO_LARGE",
            field="header.files",
        )
    seen = set()
    for i, f in enumerate(files):
        field = f"header.files[{i}]"
        if not MODEL_FILE.fullmatch(f.name) or not UPLOADED_FILE.fullmatch(f.name) or f.name in seen:
            raise invalid_field(
                f"{field}.name",
                f"{f.name[:80]!r} is not a model file name (a top-level "
                "*.safetensors, *.json, tokenizer or chat template file), or repeated",
            )
        seen.add(f.name)
        if f.size < 0:
            raise invalid_field(f"{field}.size", "a size is >= 0")
        if len(f.sha256) != 64 or any(c not in "0123456789abcdef" for c in f.sha256):
            raise invalid_field(f"{field}.sha256", "a sha256 is 64 lowercase hex digits")
    total = sum(f.size for f in files)
    if total > max_bytes:
        raise ResourceExhaustedError(
            f"the upload declares {total:,} bytes; this service takes at most {max_bytes:,}",
            reason="REQUEST_TOO_LARGE",
            field="header.files",
        )


async def receive_upload(files: Sequence[UploadedFile], chunks: AsyncIterator[bytes], folder: pathlib.Path) -> None:
    """Writes the declared files from ``chunks`` into ``folder`` in order, hashing each as it arrives (off the
    event loop).

    Raises:
        InvalidArgumentError: INVALID_FIELD when more or fewer bytes arrive than declared.
        DataLossError: CHECKPOINT_CORRUPT naming the file whose bytes do not hash to its declared sha256.
    """
    import asyncio
    import hashlib

    index, written, digest, out = 0, 0, hashlib.sha256(), None

    def close_current() -> None:
        nonlocal index, written, digest, out
        declared = files[index]
        if out is None:
            (folder / declared.name).write_bytes(b"")
        else:
            out.close()
            out = None
        if digest.hexdigest() != declared.sha256:
            raise DataLossError(
                f"{declared.name}: the bytes received hash to {digest.hexdigest()}, not the declared {declared.sha256}",
                reason="CHECKPOINT_CORRUPT",
                field="chunk",
            )
        index, written, digest = index + 1, 0, hashlib.sha256()

    def take(view: memoryview) -> memoryview:
        """Writes what of ``view`` belongs to the current file; returns the rest."""
        nonlocal written, out
        declared = files[index]
        if out is None:
            out = open(folder / declared.name, "wb")
        part = view[: declared.size - written]
        out.write(part)
        digest.update(part)
        written += len(part)
        if written == declared.size:
            close_current()
        return view[len(part) :]

    def write(chunk: bytes) -> None:
        view = memoryview(chunk)
        while view:
            while index < len(files) and files[index].size == 0:
                close_current()
            if index >= len(files):
                raise invalid_field("chunk", "more bytes arrived than the header declared")
            view = take(view)

    try:
        async for chunk in chunks:
            await asyncio.to_thread(write, chunk)
        while index < len(files) and files[index].size == 0:
            close_current()
        if index < len(files):
            raise invalid_field(
                "chunk", f"{files[index].name}: {written:,} bytes arrived, the header declared {files[index].size:,}"
            )
    finally:
        if out is not None:
            out.close()
