"""Weight groups' transport across processes: a group of its own on a TCPStore, files broadcast in pieces.

gloo runs everywhere (CI); NCCL needs two GPUs (one per rank: NCCL refuses two ranks on one device) and is
marked ``gpu``.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import pathlib

import pytest

from yieldloop.types import ObjectInfo
from yieldloop_server.weights.collective import broadcast_files, close_group, make_group, open_store

SIZES = {"model.safetensors": 10 * (1 << 20) + 123, "config.json": 321, "empty.txt": 0}


def _member(port: int, rank: int, size: int, backend: str, target: str, chunk: int, out: multiprocessing.Queue) -> None:
    try:
        if backend == "nccl":
            import torch

            torch.cuda.set_device(rank)
        store = open_store("127.0.0.1", port, 60)
        group = make_group(store, "test/1/", rank, size, backend, 60)
        objects = [ObjectInfo(name, length, "", "") for name, length in SIZES.items()]
        out.put((rank, broadcast_files(group, backend, objects, chunk, target=pathlib.Path(target))))
        close_group(group)
    except BaseException as err:  # reported to the test
        out.put((rank, repr(err)))


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpu)])
def test_files_reach_every_member_with_their_digests(backend: str, tmp_path: pathlib.Path) -> None:
    if backend == "nccl":
        import torch

        if torch.cuda.device_count() < 2:
            pytest.skip("NCCL needs a GPU per rank: two GPUs")
        torch.cuda.set_device(0)
    source = tmp_path / "source"
    source.mkdir()
    for name, length in SIZES.items():
        (source / name).write_bytes(os.urandom(length))
    objects = [
        ObjectInfo(name, length, hashlib.sha256((source / name).read_bytes()).hexdigest(), "")
        for name, length in SIZES.items()
    ]
    members = 2 if backend == "gloo" else 1
    chunk = 1 << 20  # the big file in 11 pieces, the last one short
    store = open_store("0.0.0.0", 0, 60, master=True)
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    processes = []
    for rank in range(1, members + 1):
        (tmp_path / f"m{rank}").mkdir()
        process = context.Process(
            target=_member, args=(store.port, rank, members + 1, backend, str(tmp_path / f"m{rank}"), chunk, out)
        )
        process.start()
        processes.append(process)
    group = make_group(store, "test/1/", 0, members + 1, backend, 60)
    assert broadcast_files(group, backend, objects, chunk, source=source) == {}
    results = dict(out.get(timeout=120) for _ in processes)
    for process in processes:
        process.join(60)
    close_group(group)
    for rank in range(1, members + 1):
        assert results[rank] == {o.name: o.sha256 for o in objects}, results[rank]
        for obj in objects:
            assert (tmp_path / f"m{rank}" / obj.name).read_bytes() == (source / obj.name).read_bytes()
