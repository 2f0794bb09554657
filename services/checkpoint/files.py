"""Moving checkpoint folders between local disk and the object store, with checksums.

Used by the trainer (upload), the rollout engine and the trainer (download +
verify), and ``yieldloop up`` (publishing the base model). Weights never
travel over gRPC: only manifests do.
"""

from __future__ import annotations

import pathlib
import shutil
import tempfile

from yieldloop.errors import FailedPreconditionError
from yieldloop_server.checkpoint.registry import Manifest, ObjectInfo, checkpoint_prefix
from yieldloop_server.store import ObjectStore
from yieldloop_server.store.base import sha256_file


def upload_folder(store: ObjectStore, model: str, checkpoint_id: str, folder: pathlib.Path) -> list[ObjectInfo]:
    """Uploads every file of ``folder`` under the checkpoint's prefix; returns their ObjectInfos."""
    objects = []
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        key = checkpoint_prefix(model, checkpoint_id) + path.name
        store.put_file(key, path)
        objects.append(ObjectInfo(name=path.name, size=path.stat().st_size, sha256=sha256_file(path), key=key))
    return objects


def download_verified(store: ObjectStore, manifest: Manifest, folder: pathlib.Path) -> pathlib.Path:
    """Downloads a checkpoint's objects into ``folder`` and checks every size and sha256.

    The files land in a temporary sibling folder that is renamed into place only
    when every object verified, so ``folder`` is either complete or absent.

    Raises:
        FailedPreconditionError: CHECKPOINT_CORRUPT when an object differs from the manifest.
    """
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(dir=folder.parent, prefix=".dl-"))
    try:
        for obj in manifest.objects:
            target = staging / obj.name
            store.get_file(obj.key, target)
            if target.stat().st_size != obj.size or sha256_file(target) != obj.sha256:
                raise FailedPreconditionError(
                    f"checkpoint {manifest.model}/{manifest.checkpoint_id}: object {obj.name} fails its checksum",
                    reason="CHECKPOINT_CORRUPT",
                )
        check_finite(staging, f"checkpoint {manifest.model}/{manifest.checkpoint_id}")
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def check_finite(folder: pathlib.Path, what: str) -> None:
    """FAILED_PRECONDITION/NON_FINITE when a floating-point tensor of the folder's safetensors holds NaN or inf
    (nothing non-finite is ever served or trained from)."""
    import torch
    from safetensors import safe_open

    from safetensors import SafetensorError

    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as weights:
                for name in weights.keys():  # noqa: SIM118  (safe_open is not a mapping)
                    tensor = weights.get_tensor(name)
                    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                        raise FailedPreconditionError(
                            f"{what}: tensor {name} of {path.name} holds NaN or inf; refused", reason="NON_FINITE"
                        )
        except SafetensorError as err:
            raise FailedPreconditionError(f"{what}: {path.name} is not a safetensors file: {err}",
                                          reason="CHECKPOINT_CORRUPT") from None
