"""Filesystem object store and checkpoint registry: conditional puts, commit protocol, heads."""

from __future__ import annotations

import asyncio
import hashlib
import pathlib

import pytest

from yieldloop import errors
from yieldloop.services.checkpoint.files import download_verified
from yieldloop.services.checkpoint.registry import CheckpointRegistry, Manifest, ModelInfo, ObjectInfo
from yieldloop.services.store import PreconditionFailed, open_store


def test_conditional_puts(any_store) -> None:
    store = any_store
    etag = store.put_bytes("models/m/HEAD", b"one", if_none_match=True)
    with pytest.raises(PreconditionFailed):
        store.put_bytes("models/m/HEAD", b"two", if_none_match=True)
    with pytest.raises(PreconditionFailed):
        store.put_bytes("models/m/HEAD", b"two", if_match="stale")
    store.put_bytes("models/m/HEAD", b"two", if_match=etag)
    assert store.get_bytes("models/m/HEAD")[0] == b"two"
    assert list(store.list("models/")) == ["models/m/HEAD"]
    for bad in ("../x", "a//b", "/abs", "a/./b", ""):
        with pytest.raises(ValueError):
            store.put_bytes(bad, b"")


def _commit(registry: CheckpointRegistry, model: str, cid: str, payload: bytes, **kwargs) -> Manifest:
    key = f"models/{model}/checkpoints/{cid}/model.safetensors"
    registry.store.put_bytes(key, payload)
    obj = ObjectInfo("model.safetensors", len(payload), hashlib.sha256(payload).hexdigest(), key)
    return registry.commit(Manifest(model=model, checkpoint_id=cid, objects=[obj], **kwargs), set_head=True)[0]


def test_commit_protocol_and_heads(any_store) -> None:
    registry = CheckpointRegistry(any_store)
    registry.create_model(ModelInfo(slug="m", base="m"))
    with pytest.raises(errors.AlreadyExistsError):
        registry.create_model(ModelInfo(slug="m", base="m"))
    _commit(registry, "m", "c1", b"weights-1")
    _commit(registry, "m", "c2", b"weights-2", parent_checkpoint_id="c1")
    assert registry.get_head("m").checkpoint_id == "c2" and registry.get_head("m").sequence == 2

    # Objects without a manifest are not a checkpoint.
    registry.store.put_bytes("models/m/checkpoints/half/model.safetensors", b"partial")
    assert [m.checkpoint_id for m in registry.list_checkpoints("m")] == ["c1", "c2"]

    # A declared checksum that does not match is refused, and nothing moves.
    registry.store.put_bytes("models/m/checkpoints/bad/model.safetensors", b"xx")
    bad = Manifest("m", "bad", [ObjectInfo("model.safetensors", 2, "0" * 64, "models/m/checkpoints/bad/model.safetensors")])
    with pytest.raises(errors.FailedPreconditionError) as err:
        registry.commit(bad, set_head=True)
    assert err.value.reason == "CHECKPOINT_CORRUPT"
    assert registry.get_head("m").checkpoint_id == "c2"

    # Compare-and-swap: a stale expectation is ABORTED, the right one moves HEAD (rollback).
    with pytest.raises(errors.AbortedError):
        registry.set_head("m", "c1", expected="c1")
    assert registry.set_head("m", "c1", expected="c2").sequence == 3

    # Fork shares the parent's objects.
    info, head = registry.fork_model("m", "m-fork")
    assert info.parent == "m" and head.checkpoint_id == "c1"
    assert registry.get_manifest("m-fork", "c1").objects[0].key.startswith("models/m/")


def test_download_verifies_checksums(any_store, tmp_path: pathlib.Path) -> None:
    registry = CheckpointRegistry(any_store)
    registry.create_model(ModelInfo(slug="m", base="m"))
    manifest = _commit(registry, "m", "c1", b"weights")
    folder = download_verified(registry.store, manifest, tmp_path / "cache" / "c1")
    assert (folder / "model.safetensors").read_bytes() == b"weights"
    registry.store.put_bytes(manifest.objects[0].key, b"weightz")  # a flipped byte
    with pytest.raises(errors.FailedPreconditionError) as err:
        download_verified(registry.store, manifest, tmp_path / "cache" / "c1-again")
    assert err.value.reason == "CHECKPOINT_CORRUPT"
    assert not (tmp_path / "cache" / "c1-again").exists(), "no half-downloaded folder is left"


async def test_watch_head_sees_every_move(any_store) -> None:
    registry = CheckpointRegistry(any_store, poll_interval=5.0)
    registry.create_model(ModelInfo(slug="m", base="m"))
    _commit(registry, "m", "c1", b"1")
    seen = []

    async def watch() -> None:
        async for head in registry.watch_head("m"):
            seen.append((head.checkpoint_id, head.sequence))
            if len(seen) == 3:
                return

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0.05)
    _commit(registry, "m", "c2", b"2")
    await asyncio.sleep(0.05)
    await asyncio.to_thread(registry.set_head, "m", "c1")  # from another thread, as CommitCheckpoint does
    await asyncio.wait_for(watcher, 2.0)  # well under the 5 s poll: woken, not polled
    assert seen == [("c1", 1), ("c2", 2), ("c1", 3)]


def test_head_race_has_one_winner_per_round(any_store) -> None:
    """16 writers move the same HEAD with compare-and-swap for many rounds: one winner, no lost update."""
    import threading

    registry = CheckpointRegistry(any_store)
    registry.create_model(ModelInfo(slug="race", base="race"))
    writers, rounds = 16, 12
    for w in range(writers):
        _commit(registry, "race", f"w{w}", f"weights-{w}".encode())
    registry.set_head("race", "w0")
    barrier = threading.Barrier(writers)
    for round_ in range(rounds):
        before = registry.get_head("race")
        outcomes: list = [None] * writers

        def write(w: int) -> None:
            barrier.wait()
            try:
                outcomes[w] = registry.set_head("race", f"w{w}", expected=before.checkpoint_id)
            except errors.AbortedError as err:
                outcomes[w] = err

        threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        winners = [o for o in outcomes if not isinstance(o, errors.AbortedError)]
        assert len(winners) == 1, f"round {round_}: {len(winners)} winners"
        after = registry.get_head("race")
        assert after.sequence == before.sequence + 1, "no lost or extra update"
        assert after.checkpoint_id == winners[0].checkpoint_id
        for outcome in outcomes:
            if isinstance(outcome, errors.AbortedError):
                assert outcome.reason == "HEAD_CONFLICT" and repr(after.checkpoint_id) in outcome.message
