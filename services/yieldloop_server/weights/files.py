"""The checkpoint folder format: where a checkpoint's objects live in the store, moving folders between local
disk and the store with checksums, verifying what arrived by any transport.

Used by the trainer (upload), the rollout engine and the trainer (download + verify), the importer and
``yieldloop up`` (publishing the base model). Each object is hashed once, where it is produced; every reader
verifies that hash.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import shutil
import socket
import tempfile
from collections.abc import Collection, Iterator, Sequence

from yieldloop.errors import FailedPreconditionError
from yieldloop.types import Manifest, ObjectInfo
from yieldloop_server.store import ObjectStore
from yieldloop_server.store.base import sha256_file


def checkpoint_prefix(slug: str, checkpoint_id: str) -> str:
    """The store prefix of a checkpoint's own objects (its manifest and the files it did not share)."""
    return f"models/{slug}/checkpoints/{checkpoint_id}/"


def describe_folder(
    model: str,
    checkpoint_id: str,
    folder: pathlib.Path,
    *,
    state_names: Collection[str] = (),
    reuse: Sequence[ObjectInfo] = (),
) -> list[ObjectInfo]:
    """The ObjectInfos of every file of ``folder`` (each hashed here, once, where it was produced), keyed under
    the checkpoint's prefix, or under an object of ``reuse`` (the parent's) with the same name and bytes: a file
    that did not change (config, tokenizer) is not stored again. Files named in ``state_names`` are training
    state (a name ending in "-" names every file it begins)."""
    earlier = {(obj.name, obj.size, obj.sha256): obj.key for obj in reuse}
    objects = []
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        size, digest = path.stat().st_size, sha256_file(path)
        key = earlier.get((path.name, size, digest)) or checkpoint_prefix(model, checkpoint_id) + path.name
        state = any(path.name == n or (n.endswith("-") and path.name.startswith(n)) for n in state_names)
        objects.append(ObjectInfo(name=path.name, size=size, sha256=digest, key=key, state=state))
    return objects


PARALLEL_UPLOADS = 8
"""Objects of one checkpoint written to the store at once."""


def upload_objects(
    store: ObjectStore,
    model: str,
    checkpoint_id: str,
    folder: pathlib.Path,
    objects: Sequence[ObjectInfo],
    adopt: bool = False,
) -> None:
    """Writes the objects of ``folder`` stored under the checkpoint's own prefix (not those shared with an
    earlier checkpoint), several at once (a sharded model's files, each rank's state file: the store's
    bandwidth, not one stream's); the first failure goes up once every upload has ended. ``adopt``: nobody
    writes into the folder's files again (a trainer's checkpoint), so the store may keep them (``adopt_file``)."""
    from concurrent.futures import ThreadPoolExecutor

    own = [obj for obj in objects if obj.key.startswith(checkpoint_prefix(model, checkpoint_id))]
    put = store.adopt_file if adopt else store.put_file
    if len(own) <= 1:
        for obj in own:
            put(obj.key, folder / obj.name)
        return
    with ThreadPoolExecutor(max_workers=min(PARALLEL_UPLOADS, len(own)), thread_name_prefix="upload") as pool:
        futures = [pool.submit(put, obj.key, folder / obj.name) for obj in own]
    for future in futures:
        future.result()


def upload_folder(store: ObjectStore, model: str, checkpoint_id: str, folder: pathlib.Path) -> list[ObjectInfo]:
    """Uploads every file of ``folder`` under the checkpoint's prefix; returns their ObjectInfos."""
    objects = describe_folder(model, checkpoint_id, folder)
    upload_objects(store, model, checkpoint_id, folder, objects)
    return objects


def verify_file(path: pathlib.Path, obj: ObjectInfo, what: str, digest: str = "") -> None:
    """CHECKPOINT_CORRUPT unless the file has the object's size and sha256 (computed where it was produced);
    ``digest``: the file's sha256 as computed while it was received (not read again)."""
    if not path.is_file() or path.stat().st_size != obj.size or (digest or sha256_file(path)) != obj.sha256:
        raise FailedPreconditionError(f"{what}: object {obj.name} fails its checksum", reason="CHECKPOINT_CORRUPT")


def download_verified(
    store: ObjectStore,
    manifest: Manifest,
    folder: pathlib.Path,
    objects: Sequence[ObjectInfo] | None = None,
    read_only: bool = False,
) -> pathlib.Path:
    """Downloads a checkpoint's objects (or only ``objects`` of it, e.g. its sampler weights) into ``folder``
    and checks every size and sha256. ``read_only``: nothing will ever write into the folder's files (an
    engine's cache), so objects the store holds on this machine are hard-linked, not copied.

    The files land in a temporary sibling folder that is renamed into place only
    when every object verified, so ``folder`` is either complete or absent.

    Raises:
        FailedPreconditionError: CHECKPOINT_CORRUPT when an object differs from the manifest; CHECKPOINT_PENDING
            when the checkpoint is not in the store yet.
    """
    if folder.is_dir():
        return folder
    if manifest.pending:
        raise FailedPreconditionError(
            f"checkpoint {manifest.model}/{manifest.checkpoint_id} is not in the store yet", reason="CHECKPOINT_PENDING"
        )
    with staged(folder) as staging:
        objects = manifest.objects if objects is None else objects
        for obj in objects:
            local = store.local_file(obj.key) if read_only else None
            if local is None or not _linked(local, staging / obj.name):
                store.get_file(obj.key, staging / obj.name)
        verify_folder(staging, objects, f"checkpoint {manifest.model}/{manifest.checkpoint_id}")
    return folder


@contextlib.contextmanager
def staged(folder: pathlib.Path) -> Iterator[pathlib.Path]:
    """A temporary sibling of ``folder`` to fill, renamed to ``folder`` when the block succeeds (removed when it
    fails): ``folder`` is either complete or absent. When another writer completed ``folder`` meanwhile (the same
    verified checkpoint, pulled and broadcast at once), theirs stays."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(dir=folder.parent, prefix=".dl-"))
    try:
        yield staging
        try:
            staging.rename(folder)
        except OSError:
            if not folder.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@functools.cache
def host_id() -> str:
    """This host: hostname and boot id (a process on the same host can read another's files in place)."""
    try:
        boot = pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def link_objects(source: pathlib.Path, target: pathlib.Path, objects: Sequence[ObjectInfo]) -> None:
    """Hard-links (or, across filesystems, copies) the objects' files of ``source`` into ``target``."""
    for obj in objects:
        if not _linked(source / obj.name, target / obj.name):
            shutil.copyfile(source / obj.name, target / obj.name)


def _linked(source: pathlib.Path, target: pathlib.Path) -> bool:
    """Whether ``target`` is now a hard link to ``source`` (False: another filesystem, or links not allowed)."""
    try:
        os.link(source, target)
    except OSError:
        return False
    return True


def verify_folder(
    folder: pathlib.Path, objects: Sequence[ObjectInfo], what: str, digests: dict[str, str] | None = None
) -> None:
    """Every object's file is in ``folder`` with its size and sha256 (``digests``: by name, as computed while the
    files were received), and no tensor is NaN or inf."""
    for obj in objects:
        verify_file(folder / obj.name, obj, what, (digests or {}).get(obj.name, ""))
    check_finite(folder, what)


def check_finite(folder: pathlib.Path, what: str) -> None:
    """FAILED_PRECONDITION/NON_FINITE when a floating-point tensor of the folder's safetensors holds NaN or inf
    (nothing non-finite is ever served or trained from)."""
    import torch
    from safetensors import SafetensorError, safe_open

    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as weights:
                for name in weights.keys():
                    tensor = weights.get_tensor(name)
                    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                        raise FailedPreconditionError(
                            f"{what}: tensor {name} of {path.name} holds NaN or inf; refused", reason="NON_FINITE"
                        )
        except SafetensorError as err:
            raise FailedPreconditionError(
                f"{what}: {path.name} is not a safetensors file: {err}", reason="CHECKPOINT_CORRUPT"
            ) from None
