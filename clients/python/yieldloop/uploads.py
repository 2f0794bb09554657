"""Model folders uploaded to CheckpointService (UploadModel): which files go (the request stream:
:mod:`yieldloop.wire.uploads`).

A model folder in Hugging Face format is uploaded from the caller's machine: its top-level weights, configs,
tokenizer files and chat templates, each declared (name, size, sha256) in a header before its bytes follow. The
service never reads a path the caller names (only an admin may import from the service's own filesystem, under
the operator's import roots), so ``yieldloop models import ./folder`` means the caller's folder.
"""

from __future__ import annotations

import hashlib
import pathlib
import re

MODEL_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
"""A file name a model folder may upload (top level only: no separators)."""
CHECKPOINT_FILE = re.compile(r".*\.(safetensors|json|txt|model|jinja|tiktoken)$")
"""What of a model folder a checkpoint keeps: weights, configs, tokenizer files, chat templates."""
UPLOADED_FILE = re.compile(rf"{CHECKPOINT_FILE.pattern}|^pytorch_model.*\.bin$")
"""What of a model folder is uploaded: a checkpoint's files, and PyTorch weights (converted on import)."""
CHUNK_BYTES = 1 << 20
"""Bytes per UploadModel chunk."""


def model_files(folder: pathlib.Path) -> list[pathlib.Path]:
    """The files of ``folder`` that make up its model, sorted by name."""
    return sorted(
        p for p in folder.iterdir() if p.is_file() and MODEL_FILE.fullmatch(p.name) and UPLOADED_FILE.fullmatch(p.name)
    )


def sha256_of(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(CHUNK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()
