"""The checkpoint registry: models, manifests and HEAD pointers in an object store.

Layout (all state lives in the store; the service is stateless)::

    models/<slug>/model.json                          base, parent, owner, trainable
    models/<slug>/checkpoints/<id>/<objects...>       safetensors, config, tokenizer, optimizer
    models/<slug>/checkpoints/<id>/manifest.json      written last: a checkpoint without it does not exist
    models/<slug>/HEAD                                checkpoint id + sequence, moved by conditional put

Plain Python: no grpc here; errors are :mod:`yieldloop.errors` classes.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator

from yieldloop.errors import (
    AbortedError,
    AlreadyExistsError,
    DataLossError,
    FailedPreconditionError,
    NotFoundError,
    invalid_field,
)
from yieldloop.types import Head, LoraConfig, Manifest, ModelInfo, ObjectInfo
from yieldloop_server.common import lora as lora_files
from yieldloop_server.common.lora import adapter_config
from yieldloop_server.store import ObjectNotFound, ObjectStore, PreconditionFailed
from yieldloop_server.store.base import check_name
from yieldloop_server.weights.files import checkpoint_prefix

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LIST_THREADS = 2
"""Manifests read at once by one listing: enough to hide S3's round trips, few enough that the threads' share
of the GIL never stalls the service's event loop."""

VERIFIED_CACHE = 65536
"""Objects (key, size, sha256) whose bytes this registry hashed, remembered so they are not read again."""


def check_owner(owner: str) -> str:
    """An owner is empty or a name like a slug (a team)."""
    if owner:
        check_name(owner, "owner")
    return owner


def model_prefix(slug: str) -> str:
    return f"models/{slug}/"


def promotion_key(slug: str, checkpoint_id: str) -> str:
    return f"models/{slug}/promotions/{checkpoint_id}.json"


def abandoned_key(slug: str, checkpoint_id: str) -> str:
    """The marker of a pending checkpoint given up (its trainer died before it became durable)."""
    return f"models/{slug}/abandoned/{checkpoint_id}"


class CheckpointRegistry:
    """Models, checkpoints and heads over an :class:`ObjectStore`.

    Args:
        store: Where everything lives.
        poll_interval: How often :meth:`watch_head` re-reads HEAD to see moves
            made by other processes (moves made through this registry wake
            watchers at once).
    """

    def __init__(self, store: ObjectStore, poll_interval: float = 0.5, keep_last: int = 0) -> None:
        self.store = store
        self.poll_interval = poll_interval
        self.keep_last = keep_last
        # Per model: the event current watchers wait on, and the loop it belongs to
        # (commit may run in a worker thread, so waking goes through the loop).
        self._head_moved: dict[str, tuple[asyncio.Event, asyncio.AbstractEventLoop]] = {}
        self._pollers: dict[str, _HeadPoller] = {}
        self._verified: collections.OrderedDict[tuple[str, int, str], None] = collections.OrderedDict()

    # Models -----------------------------------------------------------------

    def create_model(self, info: ModelInfo) -> ModelInfo:
        check_name(info.slug, "slug")
        info.created_time = info.created_time or time.time()
        try:
            self.store.put_bytes(
                model_prefix(info.slug) + "model.json",
                json.dumps(info.to_dict(), sort_keys=True).encode(),
                if_none_match=True,
            )
        except PreconditionFailed:
            raise AlreadyExistsError(f"model {info.slug!r} exists", reason="MODEL_ALREADY_EXISTS") from None
        return info

    def get_model(self, slug: str) -> ModelInfo:
        check_name(slug, "model")
        try:
            data, _ = self.store.get_bytes(model_prefix(slug) + "model.json")
        except ObjectNotFound:
            raise NotFoundError(f"no model {slug!r}", reason="MODEL_NOT_FOUND") from None
        return ModelInfo.from_dict(json.loads(data))

    def list_models(self, describe: bool = False) -> list[ModelInfo]:
        """Every model; with ``describe``, as :meth:`describe_model` gives them."""
        slugs = sorted({key.split("/")[1] for key in self.store.list("models/") if key.endswith("/model.json")})
        return [self.describe_model(slug) if describe else self.get_model(slug) for slug in slugs]

    def fork_model(
        self, source: str, name: str, owner: str = "", lora: LoraConfig | None = None
    ) -> tuple[ModelInfo, Head]:
        """A new slug starting from the source's head, or ``source@checkpoint``. Everything is checked before
        anything is written.

        A full fork's first checkpoint is the source's (objects shared, not copied). With ``lora`` the fork
        trains a LoRA adapter over the source's frozen weights at that checkpoint: its first checkpoint is a
        fresh adapter (config only). A fork of a LoRA fork is a LoRA fork over the same frozen weights, sharing
        its source's adapter; it cannot change the adapter's config.
        """
        check_name(name, "name")
        check_owner(owner)
        source, _, checkpoint_id = source.partition("@")
        src = self.get_model(source)
        manifest = self.get_manifest(source, checkpoint_id or self.get_head(source).checkpoint_id)
        if manifest.pending:
            raise FailedPreconditionError(
                f"checkpoint {source}@{manifest.checkpoint_id} is still being written to the store; fork it once "
                f"it is durable (seconds), or fork an earlier checkpoint",
                reason="CHECKPOINT_PENDING",
            )
        if lora is not None:
            lora = lora.validate("lora")
            if src.lora is not None and lora != src.lora:
                raise invalid_field(
                    "lora",
                    f"{source!r} is a LoRA fork ({src.lora.describe()}): its forks keep its adapter's "
                    f"config; fork {src.adapter_base_model!r} for another adapter",
                )
            if src.lora is None:
                config = next((o for o in manifest.objects if o.name == "config.json"), None)
                if config is not None:
                    lora_files.check_targets(lora.target_modules, self.store.get_bytes(config.key)[0].decode(), source)
        # The fork inherits what the weights are (architecture, size, chat template) from its source.
        info = dataclasses.replace(
            src, slug=name, parent=source, owner=owner, trainable=True, created_time=0.0, public=False
        )
        if lora is None or src.lora is not None:
            self._create_or_resume(info)
            forked = dataclasses.replace(manifest, model=name, created_time=time.time())
            self.store.put_bytes(checkpoint_prefix(name, forked.checkpoint_id) + MANIFEST, forked.to_json())
            return info, self.set_head(name, forked.checkpoint_id)
        info = self._create_or_resume(
            dataclasses.replace(
                info,
                lora=lora,
                adapter_base_model=source,
                adapter_base_checkpoint_id=manifest.checkpoint_id,
            )
        )
        checkpoint_id = "adapter-init"
        config = json.dumps(adapter_config(lora, f"{source}@{manifest.checkpoint_id}"), indent=2).encode()
        key = checkpoint_prefix(name, checkpoint_id) + lora_files.CONFIG_FILE
        self.store.put_bytes(key, config)
        first = Manifest(
            model=name,
            checkpoint_id=checkpoint_id,
            step=0,
            objects=[ObjectInfo(lora_files.CONFIG_FILE, len(config), hashlib.sha256(config).hexdigest(), key)],
            metadata_json=json.dumps({"adapter_of": f"{source}@{manifest.checkpoint_id}"}),
        )
        with contextlib.suppress(AlreadyExistsError):  # resuming: an identical first checkpoint is already there
            self.commit(first)
        return info, self.set_head(name, checkpoint_id)

    def _create_or_resume(self, info: ModelInfo) -> ModelInfo:
        """Creates the model, or resumes a fork interrupted before its head was written (the same record, no
        head): a failed fork can be retried instead of leaving an unusable slug."""
        try:
            return self.create_model(info)
        except AlreadyExistsError:
            existing = self.get_model(info.slug)
            same = dataclasses.replace(existing, created_time=0.0) == dataclasses.replace(info, created_time=0.0)
            if not same or self.find_head(info.slug) is not None:
                raise
            return existing

    def delete_model(self, slug: str, force: bool = False) -> None:
        """Deletes a model: HEAD first (the slug stops being usable), then its checkpoints' manifests,
        promotions and head history, the objects no other model's checkpoint references, and ``model.json``
        last, so an interrupted delete is finished by calling it again.

        Refused (FAILED_PRECONDITION/MODEL_IN_USE) while models forked from it exist, unless ``force`` (full forks
        keep working: the objects they reference stay); never while a LoRA fork's adapter runs on its weights.
        """
        self.get_model(slug)
        others = [m for m in self.list_models() if m.slug != slug]
        adapters = sorted(m.slug for m in others if m.lora and m.adapter_base_model == slug)
        forks = sorted(m.slug for m in others if m.parent == slug)
        if adapters or (forks and not force):
            names = adapters or forks
            raise FailedPreconditionError(
                f"model {slug!r} is in use by {', '.join(names[:10])}{' ...' if len(names) > 10 else ''}: "
                + (
                    "LoRA forks run on its weights; delete them first"
                    if adapters
                    else "delete its forks first, or delete with force (forks keep the objects they use)"
                ),
                reason="MODEL_IN_USE",
            )
        prefix = model_prefix(slug)
        self.store.delete(prefix + "HEAD")
        self._wake(slug)
        own = {obj.key for m in self.list_checkpoints(slug) for obj in m.objects}  # also a source's, for a fork
        referenced = {obj.key for info in others for m in self.list_checkpoints(info.slug) for obj in m.objects}
        keys = set(self.store.list(prefix))
        manifests = {key for key in keys if key.endswith("/" + MANIFEST)}
        for key in sorted((own | keys) - manifests - referenced - {prefix + "model.json"}):
            self.store.delete(key)  # objects first: while the manifests exist, a retry still knows them
        for key in sorted(manifests):
            self.store.delete(key)
        self.store.delete(prefix + "model.json")

    def describe_model(self, slug: str) -> ModelInfo:
        """The model's record, with a LoRA fork's size the adapter's at its head."""
        info = self.get_model(slug)
        head = self.find_head(slug) if info.lora else None
        if head is not None:
            objects = self.get_manifest(slug, head.checkpoint_id).objects
            info.size_bytes = sum(o.size for o in objects if o.name == lora_files.WEIGHTS_FILE)
        return info

    def adapter_bases(self) -> set[tuple[str, str]]:
        """(slug, checkpoint id) of every checkpoint a LoRA fork's adapter applies to."""
        return {(m.adapter_base_model, m.adapter_base_checkpoint_id) for m in self.list_models() if m.lora}

    # Checkpoints --------------------------------------------------------------

    def get_manifest(self, model: str, checkpoint_id: str) -> Manifest:
        self.get_model(model)
        check_name(checkpoint_id, "checkpoint_id")
        try:
            data, _ = self.store.get_bytes(checkpoint_prefix(model, checkpoint_id) + MANIFEST)
        except ObjectNotFound:
            raise NotFoundError(
                f"model {model!r} has no checkpoint {checkpoint_id!r}", reason="CHECKPOINT_NOT_FOUND"
            ) from None
        return Manifest.from_json(data)

    def list_checkpoints(self, model: str) -> list[Manifest]:
        """Committed checkpoints (those with a manifest), oldest first (manifests read a few at a time: on S3
        each is a round trip)."""
        self.get_model(model)
        prefix = f"models/{model}/checkpoints/"
        keys = [key for key in self.store.list(prefix) if key.endswith("/" + MANIFEST)]

        def read(key: str) -> Manifest | None:
            try:
                return Manifest.from_json(self.store.get_bytes(key)[0])
            except ObjectNotFound:  # deleted meanwhile (retention)
                return None

        with concurrent.futures.ThreadPoolExecutor(min(LIST_THREADS, max(1, len(keys)))) as pool:
            manifests = [m for m in pool.map(read, keys) if m is not None]
        return sorted(manifests, key=lambda m: (m.created_time, m.step, m.checkpoint_id))

    def commit(
        self, manifest: Manifest, *, set_head: bool = False, expected_head: str = ""
    ) -> tuple[Manifest, Head | None]:
        """Checks the objects, writes the manifest last, and optionally moves HEAD.

        Objects are checked by size and sha256 (see :meth:`_check_objects`) before a durable manifest is written: a
        checkpoint whose bytes differ from its manifest is never committed, so HEAD never names one. A ``pending``
        manifest is committed before its objects reach the store (its trainer serves the weights meanwhile);
        committing it again with ``pending`` false, once they are all there, makes it durable (then it may also gain
        training-state objects; nothing else may change).

        With ``expected_head`` the commit is compare-and-swap: when HEAD is not that checkpoint (checked before
        the manifest is written, and again when HEAD moves) it is ABORTED/HEAD_CONFLICT and nothing stays
        committed. Committing a manifest identical to one already committed (a retry) returns it.
        """
        self.get_model(manifest.model)
        check_name(manifest.checkpoint_id, "manifest.checkpoint_id")
        manifest.validate()
        if not manifest.objects:
            raise invalid_field("manifest.objects", "a checkpoint needs at least one object")
        if manifest.parent_checkpoint_id:
            self.get_manifest(manifest.model, manifest.parent_checkpoint_id)
        if set_head and expected_head:
            self._check_head(manifest.model, expected_head)
        self._check_keys(manifest)
        marker = abandoned_key(manifest.model, manifest.checkpoint_id)
        if self.store.stat(marker) is not None:
            raise self._gone(manifest.model, manifest.checkpoint_id)
        if not manifest.pending:
            self._check_objects(manifest)
        manifest.created_time = manifest.created_time or time.time()
        key = checkpoint_prefix(manifest.model, manifest.checkpoint_id) + MANIFEST
        try:
            self.store.put_bytes(key, manifest.to_json(), if_none_match=True)
            if self.store.stat(marker) is not None:  # abandoned (and its manifest removed) while we wrote
                self.store.delete(key)
                raise self._gone(manifest.model, manifest.checkpoint_id)
        except PreconditionFailed:
            existing, etag = self._read_manifest(manifest.model, manifest.checkpoint_id)
            if _seals(existing, manifest):  # its objects all arrived (durable now), or its training state
                existing = self._seal(existing, manifest, etag)
            if _same_checkpoint(existing, manifest):  # a retry of a commit that went through
                head = self.find_head(manifest.model)
                if set_head and (head is None or head.checkpoint_id != existing.checkpoint_id):
                    head = self.set_head(manifest.model, existing.checkpoint_id, expected_head)
                return existing, head if set_head else None
            raise AlreadyExistsError(
                f"checkpoint {manifest.checkpoint_id!r} exists", reason="CHECKPOINT_ALREADY_EXISTS"
            ) from None
        head = None
        if set_head:
            try:
                head = self.set_head(manifest.model, manifest.checkpoint_id, expected_head)
            except AbortedError:
                self.store.delete(key)  # lost the race after all: the checkpoint is not committed
                raise
        if self.keep_last:
            self.apply_retention(manifest.model, self.keep_last)
            self.collect_orphans(manifest.model)
        return manifest, head

    def _find_manifest(self, model: str, checkpoint_id: str) -> Manifest | None:
        try:
            return self.get_manifest(model, checkpoint_id)
        except NotFoundError:
            return None

    def _read_manifest(self, model: str, checkpoint_id: str) -> tuple[Manifest, str]:
        try:
            data, etag = self.store.get_bytes(checkpoint_prefix(model, checkpoint_id) + MANIFEST)
        except ObjectNotFound:
            raise self._gone(model, checkpoint_id) from None
        return Manifest.from_json(data), etag

    def _gone(self, model: str, checkpoint_id: str) -> Exception:
        if self.store.stat(abandoned_key(model, checkpoint_id)) is not None:
            return FailedPreconditionError(
                f"checkpoint {model}/{checkpoint_id} was abandoned: its trainer stopped serving it before its objects "
                "reached the store, and the head went back to its nearest durable ancestor",
                reason="CHECKPOINT_ABANDONED",
            )
        return NotFoundError(f"model {model!r} has no checkpoint {checkpoint_id!r}", reason="CHECKPOINT_NOT_FOUND")

    def _seal(self, existing: Manifest, new: Manifest, etag: str) -> Manifest:
        """Replaces a committed manifest by ``new`` (durable now, or with its training state added), unless it was
        abandoned meanwhile: the write is conditional on the version read, and the abandon marker (checked by
        :meth:`commit` before) is checked again after it (:meth:`settle_pending` writes the marker, then reads the
        manifest again)."""
        sealed = dataclasses.replace(new, created_time=existing.created_time)
        key = checkpoint_prefix(new.model, new.checkpoint_id) + MANIFEST
        marker = abandoned_key(new.model, new.checkpoint_id)
        try:
            self.store.put_bytes(key, sealed.to_json(), if_match=etag)
        except PreconditionFailed:  # changed or removed since it was read: read again (a retry decides)
            raise AbortedError(
                f"checkpoint {new.model}/{new.checkpoint_id} changed while it was being sealed; retry",
                reason="HEAD_CONFLICT",
            ) from None
        if self.store.stat(marker) is not None:  # abandoned while we wrote: whoever abandons decides
            raise self._gone(new.model, new.checkpoint_id)
        return sealed

    def settle_pending(self, model: str, seen: Head) -> Head:
        """Settles a head that names a pending checkpoint no live trainer serves any more (the caller found so):
        it is sealed (made durable) when every object reached the store with its size and sha256; otherwise it
        and its pending ancestors are abandoned: HEAD goes back to the nearest durable ancestor (compare-and-swap
        on ``seen``), their manifests and own objects are removed, and a marker refuses sealing them later.
        Returns the head as it is now.

        Against a trainer that seals concurrently (it was alive after all): the markers are written first, then
        the manifests read again; one found durable means its trainer won, and nothing is abandoned.
        """
        manifest = self._find_manifest(model, seen.checkpoint_id)
        if manifest is None or not manifest.pending:  # settled meanwhile (sealed, or abandoned by another reader)
            return self.get_head(model)
        with contextlib.suppress(FailedPreconditionError, DataLossError, AbortedError):
            self.commit(dataclasses.replace(manifest, pending=False, weights_source=""))
            log.warning(
                "%s: head %s was pending and its trainer is gone; every object had reached the store: made durable",
                model,
                manifest.checkpoint_id,
            )
            return self.get_head(model)
        chain = [manifest]
        while chain[-1].pending:
            parent = chain[-1].parent_checkpoint_id
            if not parent:
                raise FailedPreconditionError(
                    f"head {seen.checkpoint_id} of {model!r} never reached the store and has no durable ancestor to "
                    "go back to",
                    reason="CHECKPOINT_PENDING",
                )
            chain.append(self.get_manifest(model, parent))
        target, abandoned = chain[-1], chain[:-1]
        for pending in abandoned:
            self.store.put_bytes(
                abandoned_key(model, pending.checkpoint_id),
                json.dumps(
                    {"head_sequence": seen.sequence, "went_back_to": target.checkpoint_id, "time": time.time()}
                ).encode(),
            )
        if any(not getattr(self._find_manifest(model, m.checkpoint_id), "pending", True) for m in abandoned):
            # a live trainer sealed one meanwhile: it was not gone after all
            for pending in abandoned:
                self.store.delete(abandoned_key(model, pending.checkpoint_id))
            return self.get_head(model)
        try:
            head = self.set_head(model, target.checkpoint_id, expected_sequence=seen.sequence)
        except AbortedError:  # moved meanwhile (another reader settled it, or a SetHead): theirs stands
            head = self.get_head(model)
        log.warning(
            "%s: head %s (step %d) never reached the store and its trainer is gone: abandoned with %d pending "
            "ancestor(s); the head went back to %s (step %d)",
            model,
            manifest.checkpoint_id,
            manifest.step,
            len(abandoned) - 1,
            target.checkpoint_id,
            target.step,
        )
        gone = {m.checkpoint_id for m in abandoned} - {head.checkpoint_id}
        for checkpoint_id in sorted(gone):
            prefix = checkpoint_prefix(model, checkpoint_id)
            self.store.delete(prefix + MANIFEST)
            for key in self.store.list(prefix):
                self.store.delete(key)
            self.store.delete(model_prefix(model) + f"head-history/{checkpoint_id}")
            self.store.delete(promotion_key(model, checkpoint_id))
        return head

    def _check_objects(self, manifest: Manifest) -> None:
        """Every object is in the store with its declared size and sha256, or nothing is committed.

        Bytes are hashed as they stream from the store, a few objects at once; an object verified before (by this
        registry, or as part of the durable checkpoint whose folder holds it: a parent's shared config and
        tokenizer) is not read again.

        Raises:
            FailedPreconditionError: CHECKPOINT_CORRUPT when an object is missing or of another size (a retry
                once the upload ends may succeed).
            DataLossError: CHECKPOINT_CORRUPT naming the object whose bytes do not hash to its declared sha256.
        """
        objects = list({obj.key: obj for obj in manifest.objects}.values())
        for obj in objects:
            if self.store.size(obj.key) != obj.size:
                raise FailedPreconditionError(
                    f"object {obj.key!r} is missing or differs from its declared size",
                    reason="CHECKPOINT_CORRUPT",
                )
        owners: dict[str, Manifest | None] = {}
        unverified = [obj for obj in objects if not self._known_good(obj, manifest, owners)]
        if not unverified:
            return
        with concurrent.futures.ThreadPoolExecutor(min(LIST_THREADS, len(unverified))) as pool:
            digests = list(pool.map(lambda obj: self.store.sha256(obj.key), unverified))
        for obj, digest in zip(unverified, digests, strict=True):
            if digest != obj.sha256:
                index = manifest.objects.index(obj)
                raise DataLossError(
                    f"object {obj.name!r} ({obj.key}) hashes to {digest}, not the declared {obj.sha256[:64]!r}: "
                    "nothing was committed",
                    reason="CHECKPOINT_CORRUPT",
                    field=f"manifest.objects[{index}].sha256",
                )
            self._verified[obj.key, obj.size, obj.sha256] = None
            while len(self._verified) > VERIFIED_CACHE:
                self._verified.popitem(last=False)

    def _known_good(self, obj: ObjectInfo, manifest: Manifest, owners: dict[str, Manifest | None]) -> bool:
        """Whether ``obj``'s bytes were verified already: by this registry, or at the commit of the durable
        checkpoint whose folder holds them (an object shared with an earlier checkpoint)."""
        if (obj.key, obj.size, obj.sha256) in self._verified:
            return True
        folder = obj.key.rsplit("/", 1)[0]
        if folder == checkpoint_prefix(manifest.model, manifest.checkpoint_id).rstrip("/"):
            return False
        if folder not in owners:
            try:
                owners[folder] = Manifest.from_json(self.store.get_bytes(f"{folder}/{MANIFEST}")[0])
            except ObjectNotFound:
                owners[folder] = None
        owner = owners[folder]
        return (
            owner is not None
            and not owner.pending
            and any((o.key, o.size, o.sha256) == (obj.key, obj.size, obj.sha256) for o in owner.objects)
        )

    def lineage(self, model: str) -> list[str]:
        """The model and the models it descends from (its parent, the parent's parent, ...)."""
        chain = [model]
        parent = self.get_model(model).parent
        while parent and parent not in chain:
            chain.append(parent)
            parent = self.get_model(parent).parent if self._exists(parent) else ""
        return chain

    def _exists(self, model: str) -> bool:
        return self.store.stat(model_prefix(model) + "model.json") is not None

    def _check_keys(self, manifest: Manifest) -> None:
        """A checkpoint's objects are checkpoint files of its own model or of a model it descends from (a fork
        shares its source's objects): never another model's metadata, never a manifest, never a path outside."""
        names = set()
        lineage = None
        for obj in manifest.objects:
            check_name(obj.name, "manifest.objects.name")
            if obj.name in names or obj.name == MANIFEST:
                raise invalid_field("manifest.objects.name", f"object name {obj.name!r} is repeated or reserved")
            names.add(obj.name)
            parts = obj.key.split("/")
            if (
                len(parts) != 5
                or parts[0] != "models"
                or parts[2] != "checkpoints"
                or parts[4] == MANIFEST
                or any(not part or part in (".", "..") or "\0" in part for part in parts)
            ):
                raise invalid_field(
                    "manifest.objects.key",
                    f"object key {obj.key[:200]!r} is not models/<model>/checkpoints/<id>/<file>",
                )
            if parts[1] != manifest.model:
                lineage = lineage or self.lineage(manifest.model)
                if parts[1] not in lineage:
                    raise invalid_field(
                        "manifest.objects.key",
                        f"object key {obj.key[:200]!r} belongs to {parts[1]!r}, which {manifest.model!r} does not "
                        f"descend from",
                    )

    def _check_head(self, model: str, expected: str) -> None:
        current = self.find_head(model)
        actual = current.checkpoint_id if current else ""
        if actual != expected:
            raise AbortedError(
                f"head of {model!r} is {actual!r} (sequence {current.sequence if current else 0}), not the "
                f"expected {expected!r}",
                reason="HEAD_CONFLICT",
            )

    def collect_orphans(self, model: str, grace_s: float = 3600.0) -> list[str]:
        """Deletes objects of checkpoints that never got a manifest (crashed uploads).

        Only folders whose newest object is older than ``grace_s`` go: an upload in progress is left alone.
        Returns the checkpoint ids whose objects were removed.
        """
        self.get_model(model)
        prefix = f"models/{model}/checkpoints/"
        folders: dict[str, list[str]] = {}
        for key in self.store.list(prefix):
            folders.setdefault(key[len(prefix) :].split("/")[0], []).append(key)
        removed = []
        now = time.time()
        for checkpoint_id, keys in folders.items():
            if any(key.endswith("/" + MANIFEST) for key in keys):
                continue
            modified = [self.store.modified(key) for key in keys]
            if all(m is not None and now - m >= grace_s for m in modified):
                for key in keys:
                    self.store.delete(key)
                removed.append(checkpoint_id)
        return removed

    def record_promotion(self, model: str, checkpoint_id: str, promotion: dict) -> None:
        """Keeps the promotion gate's decision on a committed checkpoint (JSON object)."""
        self.get_manifest(model, checkpoint_id)  # NOT_FOUND for a missing model or checkpoint
        for key in ("heldoutReward", "baselineReward", "decidedTime"):
            value = promotion.get(key, 0.0)
            if isinstance(value, str) or not math.isfinite(value):  # MessageToDict writes NaN as "NaN"
                raise invalid_field(f"promotion.{key}", f"{key} must be a finite number, got {value}")
        self.store.put_bytes(promotion_key(model, checkpoint_id), json.dumps(promotion, sort_keys=True).encode())

    def promotions(self, model: str) -> dict[str, dict]:
        """Checkpoint id -> recorded promotion decision."""
        prefix = model_prefix(model) + "promotions/"
        decided = {}
        for key in self.store.list(prefix):
            with contextlib.suppress(ObjectNotFound):
                decided[key[len(prefix) :].removesuffix(".json")] = json.loads(self.store.get_bytes(key)[0])
        return decided

    def apply_retention(self, model: str, keep_last: int) -> list[str]:
        """Deletes checkpoints beyond the last ``keep_last``, except any that was ever head.

        Manifests go first (a checkpoint without one does not exist), then only the objects no
        surviving checkpoint of any model references (forks share their parent's objects).
        Returns the deleted checkpoint ids.
        """
        manifests = self.list_checkpoints(model)
        ever_head = {key.rsplit("/", 1)[1] for key in self.store.list(model_prefix(model) + "head-history/")}
        adapter_bases = {cid for slug, cid in self.adapter_bases() if slug == model}  # LoRA forks' frozen weights
        keep = {m.checkpoint_id for m in manifests[-keep_last:]} | ever_head | adapter_bases
        doomed = [m for m in manifests if m.checkpoint_id not in keep]
        for manifest in doomed:
            self.store.delete(checkpoint_prefix(model, manifest.checkpoint_id) + MANIFEST)
            self.store.delete(promotion_key(model, manifest.checkpoint_id))
        if doomed:
            referenced = {
                obj.key
                for info in self.list_models()
                for surviving in self.list_checkpoints(info.slug)
                for obj in surviving.objects
            }
            for manifest in doomed:
                for obj in manifest.objects:
                    if obj.key not in referenced and "/checkpoints/" in obj.key:  # never a model's metadata
                        self.store.delete(obj.key)
        return [m.checkpoint_id for m in doomed]

    # Heads ----------------------------------------------------------------------

    def _read_head(self, model: str) -> tuple[Head | None, str | None]:
        try:
            data, etag = self.store.get_bytes(model_prefix(model) + "HEAD")
        except ObjectNotFound:
            return None, None
        return Head(**json.loads(data)), etag

    def find_head(self, model: str) -> Head | None:
        """The model's head, or None before its first checkpoint."""
        self.get_model(model)
        return self._read_head(model)[0]

    def get_head(self, model: str) -> Head:
        head = self.find_head(model)
        if head is None:
            raise NotFoundError(f"model {model!r} has no head yet", reason="CHECKPOINT_NOT_FOUND")
        return head

    def set_head(self, model: str, checkpoint_id: str, expected: str = "", expected_sequence: int = 0) -> Head:
        """Moves HEAD by conditional put; with ``expected`` (id) or ``expected_sequence``, a lost race is ABORTED."""
        self.get_manifest(model, checkpoint_id)
        while True:
            current, etag = self._read_head(model)
            actual = current.checkpoint_id if current else ""
            sequence = current.sequence if current else 0
            if (expected and actual != expected) or (expected_sequence and sequence != expected_sequence):
                raise AbortedError(
                    f"head of {model!r} is {actual!r} (sequence {sequence}), not the expected "
                    f"{expected or '-'!r} (sequence {expected_sequence or '-'})",
                    reason="HEAD_CONFLICT",
                )
            new = Head(model, checkpoint_id, (current.sequence if current else 0) + 1, time.time())
            try:
                self.store.put_bytes(
                    model_prefix(model) + "HEAD",
                    json.dumps(dataclasses.asdict(new)).encode(),
                    if_match=etag,
                    if_none_match=current is None,
                )
            except PreconditionFailed:
                continue  # someone moved it between our read and write: re-read and re-check
            # Checkpoints that were ever head survive retention (rollback targets, what was served).
            self.store.put_bytes(model_prefix(model) + f"head-history/{checkpoint_id}", b"")
            self._wake(model)
            return new

    def _wake(self, model: str) -> None:
        waiter = self._head_moved.pop(model, None)
        if waiter is not None:
            event, loop = waiter
            loop.call_soon_threadsafe(event.set)

    async def watch_head(self, model: str, after_sequence: int = 0) -> AsyncIterator[Head]:
        """Yields the head whenever its sequence passes ``after_sequence``, forever. All watchers of a model share
        one poller (one store read per poll interval, whatever their number); a store error ends each watch
        with that error (the watcher retries)."""
        await asyncio.to_thread(self.get_model, model)
        poller = self._pollers.get(model)
        if poller is None:
            poller = self._pollers[model] = _HeadPoller(self, model)
        poller.watchers += 1
        try:
            seen = -1
            while True:
                async with poller.changed:
                    await poller.changed.wait_for(lambda: poller.version != seen)
                    seen, head, error = poller.version, poller.head, poller.error
                if error is not None:
                    raise error
                if head is not None and head.sequence > after_sequence:
                    after_sequence = head.sequence
                    yield head
        finally:
            poller.watchers -= 1
            if poller.watchers == 0 and self._pollers.get(model) is poller:
                del self._pollers[model]
                poller.task.cancel()


class _HeadPoller:
    """Reads one model's HEAD for all its watchers: at once when this registry moved it, else every poll
    interval (moves made by other processes)."""

    def __init__(self, registry: CheckpointRegistry, model: str) -> None:
        self.registry, self.model = registry, model
        self.head: Head | None = None
        self.error: Exception | None = None
        self.version = 0
        """Bumped whenever the head or the error changes (watchers wait for it to move)."""
        self.watchers = 0
        self.changed = asyncio.Condition()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            event, _ = self.registry._head_moved.setdefault(self.model, (asyncio.Event(), loop))
            try:
                head, error = (await asyncio.to_thread(self.registry._read_head, self.model))[0], None
            except Exception as err:  # handed to the watchers, which end with it; polling goes on
                head, error = self.head, err
            if head != self.head or error is not None or self.error is not None:
                async with self.changed:
                    self.head, self.error = head, error
                    self.version += 1
                    self.changed.notify_all()
            try:
                await asyncio.wait_for(event.wait(), self.registry.poll_interval)
            except TimeoutError:
                pass


def _seals(existing: Manifest, new: Manifest) -> bool:
    """Whether ``new`` completes ``existing``: the same checkpoint, durable, with the same objects plus, at most,
    training-state objects (when ``existing`` had none); and ``existing`` was pending or gains them."""
    added = [obj for obj in new.objects if obj not in existing.objects]
    return (
        (existing.pending or (bool(added) and not existing.has_state))
        and not new.pending
        and all(obj.state for obj in added)
        and all(obj in new.objects for obj in existing.objects)
        and _same_checkpoint(
            dataclasses.replace(existing, objects=[], pending=False, weights_source=""),
            dataclasses.replace(new, objects=[], weights_source=""),
        )
    )


def _same_checkpoint(a: Manifest, b: Manifest) -> bool:
    """Whether two manifests describe the same checkpoint (all but the commit time)."""
    return dataclasses.replace(a, created_time=0.0) == dataclasses.replace(b, created_time=0.0)
