"""Filesystem object store and checkpoint registry: conditional puts, commit protocol, heads."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import pathlib

import pytest

from yieldloop import errors
from yieldloop_server.checkpoint.registry import CheckpointRegistry, Manifest, ModelInfo, ObjectInfo
from yieldloop_server.store import PreconditionFailed
from yieldloop_server.weights.files import download_verified


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


def _record_fsyncs(monkeypatch) -> list[str]:
    """The paths the filesystem store fsyncs from now on, in order (each still synced)."""
    import os

    from yieldloop_server.store import fs

    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(fs.os, "fsync", fsync)
    return synced


def test_fs_store_syncs_every_folder_entry_it_writes(tmp_path: pathlib.Path, monkeypatch) -> None:
    """An acknowledged object survives a machine crash: its bytes are fsynced, and so are the folder that holds
    its name (after the rename) and the parents of every folder the write created."""

    from yieldloop_server.store import fs

    store = fs.FsStore(tmp_path / "store")
    synced = _record_fsyncs(monkeypatch)
    store.put_bytes("runs/job-1/segment", b"x", if_none_match=True)
    root = str(store.root)
    assert [p for p in synced if ".tmp-" not in p] == [root, f"{root}/runs", f"{root}/runs/job-1"]
    assert any(f"{root}/runs/job-1/.tmp-" in p for p in synced), "the object's bytes themselves"
    synced.clear()
    store.put_bytes("runs/job-1/marker", b"")
    assert [p for p in synced if ".tmp-" not in p] == [f"{root}/runs/job-1"], "an existing folder: just itself"


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

    # An object missing or of another size than declared is refused, and nothing moves. (Checksums are computed
    # once, by the producer, and verified by every reader: test_download_verifies_checksums.)
    registry.store.put_bytes("models/m/checkpoints/bad/model.safetensors", b"xx")
    bad = Manifest(
        "m", "bad", [ObjectInfo("model.safetensors", 3, "0" * 64, "models/m/checkpoints/bad/model.safetensors")]
    )
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


def test_a_pending_checkpoint_becomes_durable_only_by_gaining_its_objects(any_store, tmp_path: pathlib.Path) -> None:
    registry = CheckpointRegistry(any_store)
    registry.create_model(ModelInfo(slug="m", base="m"))
    _commit(registry, "m", "c1", b"weights-1")
    key = "models/m/checkpoints/c2/model.safetensors"
    weights = ObjectInfo("model.safetensors", 9, hashlib.sha256(b"weights-2").hexdigest(), key)
    pending = Manifest(
        "m", "c2", [weights], parent_checkpoint_id="c1", step=1, pending=True, weights_source="127.0.0.1:1"
    )
    # Committed (and HEAD moved) before its objects are in the store; it says so, and cannot be forked or read.
    _, head = registry.commit(pending, set_head=True, expected_head="c1")
    assert head.checkpoint_id == "c2" and registry.get_manifest("m", "c2").pending
    with pytest.raises(errors.FailedPreconditionError) as err:
        registry.fork_model("m", "m-fork")
    assert err.value.reason == "CHECKPOINT_PENDING"
    with pytest.raises(errors.FailedPreconditionError) as err:
        download_verified(registry.store, registry.get_manifest("m", "c2"), tmp_path / "c2")
    assert err.value.reason == "CHECKPOINT_PENDING"
    assert registry.commit(pending)[0].pending, "a retried pending commit is the same checkpoint"
    # Durable only once every object is there; anything but durability and added training state is refused.
    durable = dataclasses.replace(pending, pending=False, weights_source="")
    with pytest.raises(errors.FailedPreconditionError):
        registry.commit(durable)
    registry.store.put_bytes(key, b"weights-2")
    with pytest.raises(errors.AlreadyExistsError):
        registry.commit(dataclasses.replace(durable, step=2))
    with pytest.raises(errors.AlreadyExistsError):  # a sampler object cannot be added
        registry.commit(dataclasses.replace(durable, objects=[weights, dataclasses.replace(weights, name="x.json")]))
    assert not registry.commit(durable)[0].pending and not registry.get_manifest("m", "c2").pending
    assert not registry.get_manifest("m", "c2").has_state
    # A durable checkpoint without training state may gain it, once.
    state_key = "models/m/checkpoints/c2/optimizer.pt"
    registry.store.put_bytes(state_key, b"moments")
    state = ObjectInfo("optimizer.pt", 7, hashlib.sha256(b"moments").hexdigest(), state_key, state=True)
    assert registry.commit(dataclasses.replace(durable, objects=[weights, state]))[0].has_state
    assert registry.get_manifest("m", "c2").sampler_objects == [weights]
    assert registry.fork_model("m", "m-fork")[1].checkpoint_id == "c2"


def test_an_adopted_file_is_stored_synced_without_a_copy(any_store, tmp_path: pathlib.Path, monkeypatch) -> None:
    """A trainer's checkpoint file (never written again) is adopted: a filesystem store keeps the file itself (a
    hard link whose bytes and folder entry are synced), an S3 store uploads it; deleting the producer's file
    loses nothing, and where links fail the file is copied."""
    import os

    from yieldloop_server.store import fs

    produced = tmp_path / "out" / "model.safetensors"
    produced.parent.mkdir()
    produced.write_bytes(b"weights")
    synced = _record_fsyncs(monkeypatch)
    any_store.adopt_file("models/m/checkpoints/c1/model.safetensors", produced)
    local = any_store.local_file("models/m/checkpoints/c1/model.safetensors")
    if isinstance(any_store, fs.FsStore):
        assert local is not None and os.path.samefile(local, produced)
        assert f"{any_store.root}/models/m/checkpoints/c1" in synced and any(".tmp-" in p for p in synced)
        assert not [p for p in local.parent.iterdir() if p.name.startswith(".tmp-")]
    produced.unlink()
    assert any_store.get_bytes("models/m/checkpoints/c1/model.safetensors")[0] == b"weights"
    if isinstance(any_store, fs.FsStore):
        produced.write_bytes(b"other")

        def no_links(*_: object) -> None:
            raise PermissionError("links not allowed here")

        monkeypatch.setattr(fs.os, "link", no_links)
        any_store.adopt_file("models/m/checkpoints/c2/model.safetensors", produced)
        copied = any_store.local_file("models/m/checkpoints/c2/model.safetensors")
        assert copied is not None and copied.read_bytes() == b"other" and not os.path.samefile(copied, produced)


def test_download_verifies_checksums(any_store, tmp_path: pathlib.Path) -> None:
    registry = CheckpointRegistry(any_store)
    registry.create_model(ModelInfo(slug="m", base="m"))
    import torch
    from safetensors.torch import save

    weights = save({"w": torch.ones(4)})
    manifest = _commit(registry, "m", "c1", weights)
    folder = download_verified(registry.store, manifest, tmp_path / "cache" / "c1")
    assert (folder / "model.safetensors").read_bytes() == weights
    registry.store.put_bytes(manifest.objects[0].key, weights[:-1] + b"\x00")  # a flipped byte
    with pytest.raises(errors.FailedPreconditionError) as err:
        download_verified(registry.store, manifest, tmp_path / "cache" / "c1-again")
    assert err.value.reason == "CHECKPOINT_CORRUPT"
    assert not (tmp_path / "cache" / "c1-again").exists(), "no half-downloaded folder is left"


def test_a_read_only_download_links_what_the_store_holds_here(any_store, tmp_path: pathlib.Path) -> None:
    """An engine's cache takes a filesystem store's objects as hard links (nothing copied; a later write of the
    key is a new file, so the cached bytes stay the verified ones) and still verifies them; an S3 store's are
    downloaded."""
    import os

    import torch
    from safetensors.torch import save

    registry = CheckpointRegistry(any_store)
    registry.create_model(ModelInfo(slug="m", base="m"))
    weights = save({"w": torch.ones(4)})
    manifest = _commit(registry, "m", "c1", weights)
    folder = download_verified(registry.store, manifest, tmp_path / "cache" / "c1", read_only=True)
    local = registry.store.local_file(manifest.objects[0].key)
    assert (local is not None) == (type(registry.store).__name__ == "FsStore")
    if local is not None:
        assert os.path.samefile(local, folder / "model.safetensors")
    registry.store.put_bytes(manifest.objects[0].key, weights[:-1] + b"\x00")
    assert (folder / "model.safetensors").read_bytes() == weights
    with pytest.raises(errors.FailedPreconditionError) as err:
        download_verified(registry.store, manifest, tmp_path / "cache" / "c1-again", read_only=True)
    assert err.value.reason == "CHECKPOINT_CORRUPT"


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
                outcomes[w] = registry.set_head("race", f"w{w}", expected_sequence=before.sequence)
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
                assert f"sequence {after.sequence}" in outcome.message


def test_retention_keeps_recent_ever_head_and_shared_objects(any_store) -> None:
    registry = CheckpointRegistry(any_store)
    registry.create_model(ModelInfo(slug="m", base="m"))
    for i in range(6):
        _commit(registry, "m", f"c{i}", f"weights-{i}".encode())  # each commit moves HEAD ...
    registry.set_head("m", "c2")  # ... then a rollback: c2 is head again
    registry.store.put_bytes("models/m/checkpoints/n6/model.safetensors", b"never-head")
    registry.commit(
        Manifest(
            "m",
            "n6",
            [
                ObjectInfo(
                    "model.safetensors",
                    10,
                    hashlib.sha256(b"never-head").hexdigest(),
                    "models/m/checkpoints/n6/model.safetensors",
                )
            ],
        )
    )
    registry.store.put_bytes("models/m/checkpoints/n7/model.safetensors", b"never-head-7")
    registry.commit(
        Manifest(
            "m",
            "n7",
            [
                ObjectInfo(
                    "model.safetensors",
                    12,
                    hashlib.sha256(b"never-head-7").hexdigest(),
                    "models/m/checkpoints/n7/model.safetensors",
                )
            ],
        )
    )
    registry.store.put_bytes("models/m/checkpoints/n8/model.safetensors", b"never-head-8")
    registry.commit(
        Manifest(
            "m",
            "n8",
            [
                ObjectInfo(
                    "model.safetensors",
                    12,
                    hashlib.sha256(b"never-head-8").hexdigest(),
                    "models/m/checkpoints/n8/model.safetensors",
                )
            ],
        )
    )
    registry.fork_model("m", "m-fork")  # shares c2's objects
    deleted = registry.apply_retention("m", keep_last=1)
    assert deleted == ["n6", "n7"]  # never head and not among the last 1; every c* was head once
    assert [m.checkpoint_id for m in registry.list_checkpoints("m")] == ["c0", "c1", "c2", "c3", "c4", "c5", "n8"]
    assert registry.store.stat("models/m/checkpoints/n6/model.safetensors") is None
    assert registry.store.get_bytes("models/m/checkpoints/c2/model.safetensors")[0] == b"weights-2"
    assert registry.get_head("m").checkpoint_id == "c2"


def test_retention_never_deletes_objects_a_fork_references(any_store) -> None:
    registry = CheckpointRegistry(any_store)
    registry.create_model(ModelInfo(slug="p", base="p"))
    _commit(registry, "p", "a", b"A")
    registry.fork_model("p", "child")  # child's checkpoint "a" points at p's objects
    registry.store.delete("models/p/head-history/a")  # pretend "a" was never head of p, so p may drop it
    registry.store.put_bytes("models/p/checkpoints/b/model.safetensors", b"B")
    registry.commit(
        Manifest(
            "p",
            "b",
            [
                ObjectInfo(
                    "model.safetensors", 1, hashlib.sha256(b"B").hexdigest(), "models/p/checkpoints/b/model.safetensors"
                )
            ],
        ),
        set_head=True,
    )
    assert registry.apply_retention("p", keep_last=1) == ["a"]
    assert registry.store.get_bytes("models/p/checkpoints/a/model.safetensors")[0] == b"A", "the fork still uses it"
    assert registry.get_manifest("child", "a").objects[0].key == "models/p/checkpoints/a/model.safetensors"


UPLOADER = """
import pathlib, sys, time
from yieldloop_server.weights.files import upload_folder
from yieldloop_server.store import open_store
from yieldloop_server.store.s3 import S3Store
url, endpoint, folder = sys.argv[1:4]
if url.startswith("s3://"):
    store = S3Store(url[5:].split("/", 1)[0], url[5:].split("/", 1)[1], endpoint_url=endpoint)
else:
    store = open_store(url)
print("uploading", flush=True)
upload_folder(store, "m", "killed", pathlib.Path(folder))  # the parent kills us part-way
print("finished", flush=True)
"""


def test_trainer_killed_during_upload_leaves_everything_intact(any_store, tmp_path: pathlib.Path, request) -> None:
    import signal
    import subprocess
    import sys
    import time

    registry = CheckpointRegistry(any_store)
    registry.create_model(ModelInfo(slug="m", base="m"))
    _commit(registry, "m", "c1", b"good")
    before = (registry.get_head("m"), [m.checkpoint_id for m in registry.list_checkpoints("m")])
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    for i in range(400):
        (folder / f"shard-{i:03d}.bin").write_bytes(bytes([i % 256]) * (256 << 10))
    if hasattr(any_store, "bucket"):
        url, endpoint = (
            f"s3://{any_store.bucket}/{any_store.prefix.rstrip('/')}",
            request.getfixturevalue("moto_endpoint"),
        )
    else:
        url, endpoint = str(any_store.root), ""
    uploader = subprocess.Popen(
        [sys.executable, "-c", UPLOADER, url, endpoint, str(folder)], stdout=subprocess.PIPE, text=True
    )
    assert uploader.stdout.readline().strip() == "uploading"
    prefix = "models/m/checkpoints/killed/"
    deadline = time.monotonic() + 60
    while not list(any_store.list(prefix)):  # wait until some objects are written, then kill
        assert time.monotonic() < deadline and uploader.poll() is None
        time.sleep(0.01)
    uploader.send_signal(signal.SIGKILL)
    uploader.wait(10)
    written = len(list(any_store.list(prefix)))
    assert 0 < written < 400, "killed part-way"

    assert (registry.get_head("m"), [m.checkpoint_id for m in registry.list_checkpoints("m")]) == before
    with pytest.raises(errors.NotFoundError):
        registry.get_manifest("m", "killed")  # objects without a manifest are not a checkpoint
    _commit(registry, "m", "c2", b"next", parent_checkpoint_id="c1")
    assert registry.get_head("m").checkpoint_id == "c2"
    assert [m.checkpoint_id for m in registry.list_checkpoints("m")] == ["c1", "c2"]
    # The orphaned objects are garbage collected once older than the grace period, and only they.
    assert registry.collect_orphans("m", grace_s=3600) == []
    assert registry.collect_orphans("m", grace_s=0) == ["killed"]
    assert list(any_store.list(prefix)) == [] and registry.get_manifest("m", "c1").objects


def test_fork_from_a_named_checkpoint(any_store) -> None:
    """`source@checkpoint` forks from that node of the tree; a missing one fails before anything is written."""
    registry = CheckpointRegistry(any_store)
    registry.create_model(ModelInfo(slug="src", base="src", architecture="LlamaForCausalLM", num_parameters=7))
    _commit(registry, "src", "c1", b"one")
    _commit(registry, "src", "c2", b"two", parent_checkpoint_id="c1")
    info, head = registry.fork_model("src@c1", "from-c1", owner="team")
    forked = registry.get_manifest("from-c1", "c1")
    assert head.checkpoint_id == "c1" and forked.objects[0].key == "models/src/checkpoints/c1/model.safetensors"
    assert (info.parent, info.owner, info.architecture, info.num_parameters) == ("src", "team", "LlamaForCausalLM", 7)
    assert registry.get_head("src").checkpoint_id == "c2"  # the source's head never moves
    with pytest.raises(errors.NotFoundError) as err:
        registry.fork_model("src@missing", "never")
    assert err.value.reason == "CHECKPOINT_NOT_FOUND"
    assert list(any_store.list("models/never/")) == []
