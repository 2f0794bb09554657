"""Data-parallel training over torch.distributed: gloo on CPU, NCCL on GPU.

Rank 0 is the TrainerService process; ranks 1..N-1 hold the same weights: worker
processes it spawns on its own host (``--nproc N``), or, across several nodes,
processes started by torchrun beside it (``torchrun --nnodes M --nproc-per-node G
-m yieldloop.cli serve trainer ...``: rank 0 serves, every other rank follows; see
:func:`launched` and :func:`follower_main`), which receive each session's weights
from rank 0 over the process group. Every trainer call on rank 0 is broadcast
to all ranks over a gloo control group; each rank runs the forward/backward of
its shard (``datums[rank::world_size]``); at ``optim_step`` the accumulated
gradients are summed with one flat all-reduce and every rank applies the same
AdamW step, so the weights stay identical. The loss is a plain sum over tokens
and datums, so the summed shard gradients equal the single-process gradient of
the whole batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import socket
from collections.abc import Sequence
from typing import Any

from yieldloop.errors import FailedPreconditionError, UnavailableError, YieldloopError, invalid_field
from yieldloop.types import Datum
from yieldloop_server.trainer import losses
from yieldloop_server.trainer.trainer import (
    AdamConfig,
    AdapterSetup,
    Trainer,
    TrainerConfig,
    metrics_from_totals,
    zero_totals,
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclasses.dataclass
class _Groups:
    control: Any
    """gloo group for commands and metrics (works whatever the device)."""
    rank: int
    world_size: int


def launched() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when torchrun started this process (its environment says so), else None."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env or "MASTER_ADDR" not in env or int(env["WORLD_SIZE"]) < 2:
        return None
    return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0"))


_LAUNCHED: _Groups | None = None


def _launched_groups(config: TrainerConfig) -> _Groups:
    """The process group torchrun's environment describes, joined once per process (every session reuses it)."""
    global _LAUNCHED
    if _LAUNCHED is None:
        import torch
        import torch.distributed as dist

        rank, world_size, local_rank = launched() or (0, 1, 0)
        if config.device.startswith("cuda"):
            torch.cuda.set_device(local_rank)
            dist.init_process_group("nccl", init_method="env://", device_id=torch.device("cuda", local_rank))
        else:
            dist.init_process_group("gloo", init_method="env://")
        _LAUNCHED = _Groups(dist.new_group(backend="gloo"), rank, world_size)
    return _LAUNCHED


def join_launched(config: TrainerConfig) -> int:
    """Rank 0 under torchrun: joins the process group at start (the other ranks wait in it); returns the world
    size."""
    return _launched_groups(config).world_size


def stop_launched() -> None:
    """Rank 0 under torchrun, stopping: the other ranks return (their torchrun ends)."""
    global _LAUNCHED
    if _LAUNCHED is None or _LAUNCHED.rank != 0:
        return
    import torch.distributed as dist

    dist.broadcast_object_list([("stop",)], src=0, group=_LAUNCHED.control)
    dist.destroy_process_group()
    _LAUNCHED = None


def _send_folder(folder: pathlib.Path, group: Any) -> None:
    """Rank 0: every file of ``folder`` to the other ranks (names and sizes, then each file's bytes)."""
    import torch
    import torch.distributed as dist

    files = sorted(p for p in folder.rglob("*") if p.is_file())
    dist.broadcast_object_list([[(str(p.relative_to(folder)), p.stat().st_size) for p in files]], src=0, group=group)
    for path in files:
        data = bytearray(path.read_bytes())
        if data:
            dist.broadcast(torch.frombuffer(data, dtype=torch.uint8), src=0, group=group)


def _receive_folder(folder: pathlib.Path, group: Any) -> pathlib.Path:
    """Other ranks: the files rank 0 sends, written under ``folder`` (replaced)."""
    import shutil

    import torch
    import torch.distributed as dist

    listing: list[Any] = [None]
    dist.broadcast_object_list(listing, src=0, group=group)
    shutil.rmtree(folder, ignore_errors=True)
    for name, size in listing[0]:
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        buffer = torch.empty(size, dtype=torch.uint8)
        if size:
            dist.broadcast(buffer, src=0, group=group)
        target.write_bytes(buffer.numpy().tobytes())
    return folder


def _init(rank: int, world_size: int, address: str, port: int, config: TrainerConfig) -> _Groups:
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
    if config.device.startswith("cuda"):
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    return _Groups(dist.new_group(backend="gloo"), rank, world_size)


def _device_for(config: TrainerConfig, rank: int) -> TrainerConfig:
    return dataclasses.replace(config, device=f"cuda:{rank}") if config.device.startswith("cuda") else config


def _forward_backward(trainer: Trainer, groups: _Groups, datums: list[Datum], loss_fn: str, config: dict) -> dict:
    import torch.distributed as dist

    shard = datums[groups.rank :: groups.world_size]
    # sharded, a rank without datums still joins every pass (its layers' weights are gathered from all ranks)
    totals = trainer.forward_backward_totals(shard, loss_fn, config) if shard or trainer.sharded else zero_totals()
    gathered: list[Any] = [None] * groups.world_size
    dist.all_gather_object(gathered, totals, group=groups.control)
    summed = {key: sum(t[key] for t in gathered) for key in totals}
    trainer.end_call(summed)  # every rank keeps, or every rank discards (and raises NON_FINITE)
    return summed


def _optim_step(trainer: Trainer, groups: _Groups, adam: AdamConfig, keep: bool = True) -> float:
    import torch
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    if trainer.sharded:  # the gradients were reduce-scattered (summed) in the backward passes
        return trainer.apply_step(adam, keep)
    params = [p for p in trainer.model.parameters() if p.requires_grad]  # a LoRA fork: its adapter only
    for param in params:
        if param.grad is None:  # a rank whose shards were empty still joins the sum
            param.grad = torch.zeros_like(param)
    grads = [p.grad for p in params]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(reduced)
    return trainer.apply_step(adam, keep)


def _logprobs(trainer: Trainer, groups: _Groups, datums: list[Datum]) -> list[list[float]]:
    """Sharded: each rank scores its share of ``datums`` (every rank joins every pass); rank 0 gets them all."""
    import torch.distributed as dist

    mine = trainer.logprobs(datums[groups.rank :: groups.world_size])
    gathered: list[Any] = [None] * groups.world_size
    dist.all_gather_object(gathered, mine, group=groups.control)
    out: list[list[float]] = [[] for _ in datums]
    for rank, part in enumerate(gathered):
        out[rank :: groups.world_size] = part
    return out


def _follow(trainer: Trainer, groups: _Groups) -> str:
    """Runs rank 0's commands on this rank's trainer until a session ends; returns how ("stop" or "close")."""
    import torch.distributed as dist

    while True:
        command: list[Any] = [None]
        dist.broadcast_object_list(command, src=0, group=groups.control)
        op, *args = command[0]
        if op in ("stop", "close"):
            return op
        try:  # a refused call (NON_FINITE) is refused on every rank alike; rank 0 tells the client
            if op == "forward_backward":
                _forward_backward(trainer, groups, *args)
            elif op == "optim_step":
                _optim_step(trainer, groups, *args)
            elif op == "finish_step":
                trainer.finish_step(*args)
            elif op == "drop_gradients":
                trainer.drop_gradients()
            elif op == "logprobs":
                _logprobs(trainer, groups, *args)
            elif op == "save":
                trainer.save(*args)
            elif op == "save_state":
                trainer.save_state(*args)
        except YieldloopError:
            pass


def worker_main(
    rank: int,
    world_size: int,
    folder: str,
    config: TrainerConfig,
    address: str,
    port: int,
    adapter: AdapterSetup | None = None,
) -> None:
    """Ranks 1..N-1 on rank 0's host: load the weights, then follow rank 0's commands until told to stop."""
    import torch.distributed as dist

    groups = _init(rank, world_size, address, port, config)
    _follow(Trainer(pathlib.Path(folder), _device_for(config, rank), adapter), groups)
    dist.destroy_process_group()


def follower_main(config: TrainerConfig, work_dir: pathlib.Path) -> None:
    """A rank > 0 that torchrun started (any node): for each session rank 0 opens, receive its weights (and LoRA
    adapter), follow its commands until it closes; return when rank 0 stops."""
    import torch.distributed as dist

    groups = _launched_groups(config)
    _, _, local_rank = launched() or (0, 1, 0)
    while True:
        command: list[Any] = [None]
        dist.broadcast_object_list(command, src=0, group=groups.control)
        op, *args = command[0]
        if op == "stop":
            break
        if op != "open":
            continue
        (seed,) = args
        folder = _receive_folder(work_dir / f"rank-{groups.rank}" / "weights", groups.control)
        adapter = None
        if seed is not None:
            adapter = AdapterSetup(_receive_folder(work_dir / f"rank-{groups.rank}" / "adapter", groups.control), seed)
        trainer = Trainer(folder, _device_for(config, local_rank), adapter)
        if _follow(trainer, groups) == "stop":
            break
        del trainer
    dist.destroy_process_group()


class DistributedTrainer:
    """Rank 0's trainer: the :class:`Trainer` interface, every call run on all ranks.

    Args:
        folder: HF checkpoint folder every rank loads (a shared filesystem on one machine).
        config: Device and dtype; on CUDA rank r uses ``cuda:r``.
        world_size: Number of ranks (>= 2).
    """

    def __init__(
        self, folder: pathlib.Path, config: TrainerConfig, world_size: int, adapter: AdapterSetup | None = None
    ) -> None:
        import torch.multiprocessing as mp

        if world_size < 2:
            raise ValueError("a distributed trainer needs world_size >= 2")
        self.world_size = world_size
        self._workers = []
        self._launched = launched() is not None
        if self._launched:  # the other ranks are torchrun's, waiting: send them this session's weights
            self._groups = _launched_groups(config)
            self._broadcast("open", adapter.seed if adapter is not None else None)
            _send_folder(folder, self._groups.control)
            if adapter is not None:
                _send_folder(adapter.folder, self._groups.control)
            _, _, local_rank = launched() or (0, 1, 0)
            self.local = Trainer(folder, _device_for(config, local_rank), adapter)
        else:
            address, port = "127.0.0.1", free_port()
            context = mp.get_context("spawn")
            self._workers = [
                context.Process(
                    target=worker_main,
                    args=(rank, world_size, str(folder), config, address, port, adapter),
                    daemon=True,
                )
                for rank in range(1, world_size)
            ]
            for worker in self._workers:
                worker.start()
            self._groups = _init(0, world_size, address, port, config)
            self.local = Trainer(folder, _device_for(config, 0), adapter)
        self.num_pending_datums = 0
        self._lost = False
        """A rank stopped mid-call: the process group is unusable (close kills the others)."""

    @contextlib.contextmanager
    def _ranks(self, what: str) -> Any:
        """Runs a call that every rank joins; a rank that stops meanwhile (killed, out of memory, its node gone)
        fails it typed: UNAVAILABLE/WORKER_DIED, the trainer spoiled (its owner starts the ranks again from the
        model's last checkpoint: nothing of the call, or since that checkpoint, is kept)."""
        try:
            yield
        except RuntimeError as err:  # torch.distributed's own: a peer closed its connections mid-collective
            self._lost = True
            self.local.spoiled = True
            raise UnavailableError(
                f"a trainer rank stopped during {what} ({str(err).splitlines()[0][:160]}): the call was not applied; "
                "the trainer starts its ranks again from the model's last checkpoint (gradients accumulated since "
                "the last step are lost)",
                reason="WORKER_DIED",
            ) from None

    # The Trainer interface -------------------------------------------------------------------

    @property
    def step(self) -> int:
        return self.local.step

    @property
    def vocab_size(self) -> int:
        return self.local.vocab_size

    @property
    def model(self) -> Any:
        return self.local.model

    @property
    def spoiled(self) -> bool:
        return self.local.spoiled

    @property
    def optimizer(self) -> Any:
        return self.local.optimizer

    @property
    def sharded(self) -> bool:
        return self.local.sharded

    def logprobs(self, datums: Sequence[Datum]) -> list[list[float]]:
        if not self.sharded:
            return self.local.logprobs(datums)  # the weights are the same on every rank
        with self._ranks("logprobs"):
            self._broadcast("logprobs", list(datums))
            return _logprobs(self.local, self._groups, list(datums))

    def save(self, folder: pathlib.Path, with_state: bool = True) -> pathlib.Path:
        with self._ranks("a checkpoint's write"):
            if self.sharded:  # every rank gathers each tensor in turn (this one writes the sampler files)
                self._broadcast("save", folder, with_state)
            self.local.save(folder, with_state)
        return folder

    def save_state(self, folder: pathlib.Path) -> pathlib.Path:
        with self._ranks("the training state's write"):
            if self.sharded:  # every rank writes its shards of the optimizer state
                self._broadcast("save_state", folder)
            return self.local.save_state(folder)

    def _broadcast(self, *command: Any) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([command], src=0, group=self._groups.control)

    def forward_backward(
        self, datums: Sequence[Datum], loss_fn: str, loss_config: dict[str, float]
    ) -> dict[str, float]:
        losses.resolve(loss_fn, loss_config)  # fail here, before any rank starts
        if not datums:
            raise invalid_field("items", "the batch is empty")
        datums = list(datums)
        with self._ranks("forward_backward"):
            self._broadcast("forward_backward", datums, loss_fn, dict(loss_config))
            totals = _forward_backward(self.local, self._groups, datums, loss_fn, dict(loss_config))
        self.num_pending_datums += len(datums)
        return metrics_from_totals(totals)

    def optim_step(self, adam: AdamConfig, revocable: bool = False) -> float:
        adam.validate()
        if self.num_pending_datums == 0:
            raise FailedPreconditionError("no gradients accumulated since the last step", reason="NO_GRADIENTS")
        with self._ranks("the optimizer step"):
            self._broadcast("optim_step", adam, revocable)
            grad_norm = _optim_step(self.local, self._groups, adam, revocable)
        if not revocable:
            self.finish_step(True)
        return grad_norm

    def finish_step(self, committed: bool) -> None:
        with self._ranks("the step's commit"):
            self._broadcast("finish_step", committed)
        self.local.finish_step(committed)
        if committed:
            self.num_pending_datums = 0

    def drop_gradients(self) -> None:
        with self._ranks("discarding the gradients"):
            self._broadcast("drop_gradients")
        self.local.drop_gradients()
        self.num_pending_datums = 0

    def close(self) -> None:
        import torch.distributed as dist

        if self._lost:  # the group is unusable: the ranks still alive are stopped, not told
            for worker in self._workers:
                worker.kill()
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            for worker in self._workers:
                worker.join(30)
            return
        if self._launched:  # torchrun's ranks stay in the group for the next session
            self._broadcast("close")
            return
        self._broadcast("stop")
        dist.destroy_process_group()
        for worker in self._workers:
            worker.join(30)
