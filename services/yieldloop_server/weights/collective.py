"""Process groups of their own for moving weights: a trainer (rank 0) and the rollout services of a weight group.

These groups are not torch.distributed's global one (a trainer's own data-parallel ranks, an engine's tensor
parallel workers are untouched): each is built directly on a prefix of a TCPStore the trainer owns, so one
process can hold several, one per generation of members, and close them. gloo moves bytes between CPU
buffers; NCCL between CUDA ones (each side copies its pieces to and from its current device).
"""

from __future__ import annotations

import datetime
import pathlib
import threading
import time
from collections.abc import Sequence
from typing import Any

from yieldloop.types import ObjectInfo

BACKENDS = ("gloo", "nccl")

GROUP_TIMEOUT_S = 30.0
"""How long joining a group (every rank must) or one piece of a broadcast may take before the group is given up."""


def open_store(host: str, port: int, timeout_s: float, master: bool = False) -> Any:
    """A TCPStore: the trainer's (``master``: listening, ``port`` 0 picks a free one), or a client of it."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if master:
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)
    return dist.TCPStore(host, port, is_master=False, timeout=timeout)


OPEN_WAIT_S = 3600.0
"""How long a member waits for the trainer to open a group it was told to join (:func:`wait_opened`): the trainer
opens a model's next group only once that model's previous broadcast ended, minutes for a large model."""

_OPENED, _ABANDONED = b"open", b"abandoned"


def _state_key(name: str) -> str:
    return f"{name}state"  # beside the group's own keys (``name`` + "/" + key under its PrefixStore)


def open_group(store: Any, name: str) -> None:
    """Rank 0 is about to join group ``name``: the members waiting in :func:`wait_opened` join now (each join then
    has ``GROUP_TIMEOUT_S``, counted from here and not from when the member was told of the group)."""
    store.set(_state_key(name), _OPENED)


def abandon_group(store: Any, name: str) -> None:
    """Group ``name`` will not be formed (or failed): members still waiting for it stop waiting."""
    store.set(_state_key(name), _ABANDONED)


def wait_opened(store: Any, name: str, stopped: threading.Event, timeout_s: float = OPEN_WAIT_S) -> None:
    """Blocks until rank 0 opens group ``name`` (:func:`open_group`). Raises RuntimeError when it was abandoned,
    when ``stopped`` is set (the member is closing) or after ``timeout_s``."""
    key, deadline, pause = _state_key(name), time.monotonic() + timeout_s, 0.01
    while not store.check([key]):
        if stopped.is_set():
            raise RuntimeError(f"stopped while waiting for weight group {name} to open")
        if time.monotonic() > deadline:
            raise RuntimeError(f"weight group {name} was not opened within {timeout_s:g} s")
        time.sleep(pause)
        pause = min(pause * 2, 0.2)
    if store.get(key) != _OPENED:
        raise RuntimeError(f"weight group {name} was abandoned before it formed")


def make_group(store: Any, name: str, rank: int, size: int, backend: str, timeout_s: float) -> Any:
    """Joins the group ``name`` (a key prefix of ``store``) as ``rank`` of ``size``; blocks until every rank has
    (at most ``timeout_s``: then raises)."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(name, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        import torch

        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        probe = torch.zeros(1, device="cuda")  # NCCL connects at the first collective: do it now, within the timeout
        group.allreduce([probe]).wait()
        torch.cuda.synchronize()
        return group
    return dist.ProcessGroupGloo(prefixed, rank, size, timeout)


def close_group(group: Any) -> None:
    """Releases a group's connections (a member gone or a failed broadcast leaves nothing behind)."""
    if group is None:
        return
    try:
        group.shutdown()
    except Exception:
        pass


def broadcast_files(
    group: Any,
    backend: str,
    objects: Sequence[ObjectInfo],
    chunk_bytes: int,
    source: pathlib.Path | None = None,
    target: pathlib.Path | None = None,
) -> dict[str, str]:
    """Rank 0 (``source``: the folder holding the objects) sends every object's bytes to the group, in pieces of
    at most ``chunk_bytes``; every other rank (``target``) writes them under that folder and returns each file's
    sha256 as received (name -> hex digest), hashed piece by piece. Both sides walk the same list, so the pieces
    line up without any other message."""
    import hashlib

    import torch
    import torch.distributed as dist

    device = "cuda" if backend == "nccl" else "cpu"
    options = dist.BroadcastOptions()
    options.rootRank = 0
    folder = source if source is not None else target
    assert folder is not None
    digests = {}
    for obj in objects:
        path = folder / obj.name
        digest = hashlib.sha256() if target is not None else None
        with path.open("rb" if source is not None else "wb") as file:
            left = obj.size
            while left > 0:
                size = min(left, chunk_bytes)
                if source is not None:
                    data = bytearray(file.read(size))
                    if len(data) != size:
                        raise OSError(f"{path} is shorter than its manifest says ({obj.size} bytes)")
                    buffer = torch.frombuffer(data, dtype=torch.uint8).to(device)
                else:
                    buffer = torch.empty(size, dtype=torch.uint8, device=device)
                group.broadcast([buffer], options).wait()
                if device != "cpu":
                    torch.cuda.synchronize()
                if digest is not None:
                    received = memoryview(buffer.cpu().numpy())
                    digest.update(received)
                    file.write(received)
                left -= size
        if digest is not None:
            digests[obj.name] = digest.hexdigest()
    return digests
