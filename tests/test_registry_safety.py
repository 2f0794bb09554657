"""The registry under bad or partial operations: object keys it will not trust, forks that resume, models
that can be deleted, names that cannot smuggle a newline, errors that cannot grow past the wire (issue 14)."""

from __future__ import annotations

import hashlib

import pytest
from test_checkpoints import _commit

from yieldloop import errors
from yieldloop.client import Client
from yieldloop.types import LoraConfig, Manifest, ModelInfo, ObjectInfo
from yieldloop_server.checkpoint.registry import CheckpointRegistry


def _object(registry: CheckpointRegistry, key: str, data: bytes, name: str = "model.safetensors") -> ObjectInfo:
    registry.store.put_bytes(key, data)
    return ObjectInfo(name, len(data), hashlib.sha256(data).hexdigest(), key)


@pytest.mark.parametrize(
    "key",
    [
        "models/victim/model.json",
        "models/victim/HEAD",
        "models/m/checkpoints/c1/manifest.json",
        "models/victim/checkpoints/v1/model.safetensors",
        "../../etc/passwd",
        "/abs/key",
        "models/m/checkpoints/../x/y",
    ],
)
def test_a_checkpoint_references_only_its_own_lineage(any_store, key: str) -> None:
    """Keys of another model's metadata, of a model outside the lineage, manifests and paths are refused, even
    when size and sha256 match; retention then never deletes another model's files."""
    registry = CheckpointRegistry(any_store)
    for slug in ("victim", "m"):
        registry.create_model(ModelInfo(slug=slug, base=slug))
        _commit(registry, slug, "c1" if slug == "m" else "v1", slug.encode())
    real = key.startswith("models/victim/") or key.endswith("manifest.json")
    data = any_store.get_bytes(key)[0] if real and key != "models/m/checkpoints/c1/manifest.json" else b"x"
    if key == "models/m/checkpoints/c1/manifest.json":
        data = any_store.get_bytes(key)[0]
    obj = ObjectInfo("model.safetensors", len(data), hashlib.sha256(data).hexdigest(), key)
    with pytest.raises(errors.InvalidArgumentError) as err:
        registry.commit(
            Manifest(model="m", checkpoint_id="c2", objects=[obj], parent_checkpoint_id="c1"), set_head=True
        )
    assert err.value.field.startswith("manifest.objects")
    assert registry.get_head("m").checkpoint_id == "c1"
    assert registry.get_model("victim") and registry.get_head("victim").checkpoint_id == "v1"


def test_a_fork_may_reference_its_sources_objects_and_retention_keeps_metadata(any_store) -> None:
    registry = CheckpointRegistry(any_store)
    registry.create_model(ModelInfo(slug="src", base="src"))
    shared = _commit(registry, "src", "s1", b"shared").objects[0]
    registry.fork_model("src", "fork")
    own = _object(registry, "models/fork/checkpoints/f2/extra.bin", b"own", "extra.bin")
    registry.commit(
        Manifest(model="fork", checkpoint_id="f2", objects=[shared, own], parent_checkpoint_id="s1"), set_head=True
    )
    for i in range(3, 6):
        obj = _object(registry, f"models/fork/checkpoints/f{i}/model.safetensors", bytes([i]))
        registry.commit(Manifest(model="fork", checkpoint_id=f"f{i}", objects=[obj]), set_head=False)
    registry.apply_retention("fork", keep_last=1)
    for key in ("models/fork/model.json", "models/fork/HEAD", "models/src/model.json", "models/src/HEAD", shared.key):
        assert any_store.stat(key) is not None, key


def test_an_interrupted_fork_is_resumed_and_models_can_be_deleted(any_store) -> None:
    registry = CheckpointRegistry(any_store)
    registry.create_model(ModelInfo(slug="base", base="base"))
    base = _commit(registry, "base", "b1", b"weights").objects[0]
    # A fork that died after writing its record, before its head: retrying it finishes it.
    info, _ = registry.fork_model("base", "full")
    registry.store.delete("models/full/HEAD")
    _, head = registry.fork_model("base", "full")
    assert head.checkpoint_id == "b1"
    registry.fork_model("base", "adapter", lora=LoraConfig(4))
    with pytest.raises(errors.AlreadyExistsError):  # a different fork under an existing name is not a resume
        registry.fork_model("base", "adapter")

    for force in (False, True):  # a LoRA fork runs on base's weights: never deleted under it
        with pytest.raises(errors.FailedPreconditionError) as err:
            registry.delete_model("base", force=force)
        assert err.value.reason == "MODEL_IN_USE"
    registry.delete_model("adapter")
    with pytest.raises(errors.FailedPreconditionError):
        registry.delete_model("base")  # "full" was forked from it
    registry.delete_model("base", force=True)
    with pytest.raises(errors.NotFoundError):
        registry.get_model("base")
    assert list(any_store.list("models/adapter/")) == []
    # The full fork keeps working: its checkpoint's objects (base's) stay.
    assert registry.get_manifest("full", "b1").objects == [base] and any_store.stat(base.key) is not None
    # An interrupted delete (head gone, the rest not) is finished by deleting again.
    any_store.delete("models/full/HEAD")
    registry.delete_model("full")
    assert list(any_store.list("models/")) == []


async def test_names_and_huge_inputs_over_grpc(client: Client) -> None:
    for name in ("evil\n", "evil\r\n", "a/b", "..", "x" * 129, "", "\x00"):
        with pytest.raises(errors.InvalidArgumentError) as err:
            await client.fork_model("tiny", name)
        assert err.value.reason == "INVALID_FIELD" and err.value.field == "name"
    with pytest.raises(errors.InvalidArgumentError) as huge:  # not RESOURCE_EXHAUSTED ("metadata size exceeds")
        await client.fork_model("tiny", "y" * 100_000)
    assert len(huge.value.message) < 1200
    with pytest.raises(errors.NotFoundError):
        await client.get_head("z" * 100)
    assert "evil" not in {m.slug.strip() for m in (await client.list_models())}


async def test_watchers_of_a_model_share_one_head_poller(tmp_path) -> None:
    """150 WatchHead streams on one model read HEAD from the store once per poll interval between them (not
    once each), and every one sees a move at once."""
    import asyncio

    from yieldloop_server.store.fs import FsStore

    class Counting(FsStore):
        reads = 0

        def get_bytes(self, key: str):
            if key.endswith("/HEAD"):
                Counting.reads += 1
            return super().get_bytes(key)

    registry = CheckpointRegistry(Counting(tmp_path / "store"), poll_interval=0.2)
    registry.create_model(ModelInfo(slug="m", base="m"))
    _commit(registry, "m", "c1", b"1")
    seen: list[list[str]] = [[] for _ in range(150)]

    async def watch(i: int) -> None:
        async for head in registry.watch_head("m"):
            seen[i].append(head.checkpoint_id)

    watchers = [asyncio.create_task(watch(i)) for i in range(150)]
    await asyncio.sleep(0.3)
    Counting.reads = 0
    await asyncio.sleep(1.0)
    idle_reads = Counting.reads
    await asyncio.to_thread(_commit, registry, "m", "c2", b"2")
    await asyncio.sleep(0.1)
    for task in watchers:
        task.cancel()
    await asyncio.gather(*watchers, return_exceptions=True)
    assert idle_reads <= 8, idle_reads  # ~5 polls in a second, not 150 x 5
    assert all(s == ["c1", "c2"] for s in seen)
    assert not registry._pollers  # the last watcher gone, the poller stops


def test_a_commit_whose_bytes_do_not_match_their_sha256_is_refused(any_store) -> None:
    """Sizes and sha256 are checked before the manifest is written: a declared hash the bytes do not have is
    DATA_LOSS naming the object, nothing is committed and HEAD stays; objects verified once are not read again."""
    registry = CheckpointRegistry(any_store)
    registry.create_model(ModelInfo(slug="m", base="m"))
    good = _object(registry, "models/m/checkpoints/c1/model.safetensors", b"weights-1")
    config = _object(registry, "models/m/checkpoints/c1/config.json", b"{}", "config.json")
    registry.commit(Manifest("m", "c1", [good, config]), set_head=True)
    right = _object(registry, "models/m/checkpoints/c2/model.safetensors", b"weights-2")
    zeros = ObjectInfo("model.safetensors", right.size, "0" * 64, right.key)

    with pytest.raises(errors.DataLossError) as err:
        registry.commit(Manifest("m", "c2", [zeros, config], parent_checkpoint_id="c1"), set_head=True)
    assert err.value.reason == "CHECKPOINT_CORRUPT" and err.value.field == "manifest.objects[0].sha256"
    assert right.key in err.value.message
    assert registry.get_head("m").checkpoint_id == "c1"
    with pytest.raises(errors.NotFoundError):
        registry.get_manifest("m", "c2")

    # Committed pending (HEAD moved, the weights served by a trainer), then sealed with the false hash: it stays
    # pending (never durable, so never loaded from the store).
    lie = Manifest(
        "m", "c2-pending", [zeros, config], parent_checkpoint_id="c1", pending=True, weights_source="127.0.0.1:1"
    )
    registry.commit(lie, set_head=True, expected_head="c1")
    with pytest.raises(errors.DataLossError):
        registry.commit(Manifest("m", "c2-pending", [zeros, config], parent_checkpoint_id="c1"))
    assert registry.get_manifest("m", "c2-pending").pending
    registry.set_head("m", "c1")

    # The true hash commits. A restarted registry hashes only what no durable manifest vouches for: the shared
    # config was verified with c1, the new weights are read once.
    registry.commit(Manifest("m", "c2", [right, config], parent_checkpoint_id="c1"), set_head=True)
    fresh = CheckpointRegistry(any_store)
    read: list[str] = []
    original = any_store.sha256
    any_store.sha256 = lambda key: read.append(key) or original(key)
    try:
        own = _object(registry, "models/m/checkpoints/c3/model.safetensors", b"weights-3")
        fresh.commit(Manifest("m", "c3", [own, config], parent_checkpoint_id="c2"), set_head=True)
        assert read == [own.key], "only the new object is hashed"
        read.clear()
        fresh.commit(Manifest("m", "c4", [own, config], parent_checkpoint_id="c3"), set_head=True)
        assert read == [], "an object verified once is not read again"
    finally:
        del any_store.sha256


async def test_commit_checkpoint_refuses_a_false_hash_over_grpc(client: Client) -> None:
    """A team's own lineage, one object's sha256 replaced by zeros, set_head: refused, and the model still
    serves and trains from its head."""
    head = await client.get_head("tiny")
    manifest = await client.get_checkpoint("tiny", head.checkpoint_id)
    assert not manifest.pending
    forged = manifest.objects[0]
    forged.sha256 = "0" * 64
    manifest.checkpoint_id = "forged-" + head.checkpoint_id[-8:]
    manifest.parent_checkpoint_id = head.checkpoint_id
    with pytest.raises(errors.DataLossError) as err:
        await client.commit_checkpoint(manifest, set_head=True)
    assert err.value.reason == "CHECKPOINT_CORRUPT" and err.value.field.startswith("manifest.objects[")
    assert (await client.get_head("tiny")) == head
    with pytest.raises(errors.NotFoundError):
        await client.get_checkpoint("tiny", manifest.checkpoint_id)
