"""A training session: one model's weights in training, kept on the model's head, committed as checkpoints.

The session owns what the TrainerService servicer only translates for: which checkpoint the weights came
from (and reloading when HEAD moved away from it: a rollback or a branch point), single- or multi-rank
training, the one thread that owns the weights, turning runs into datums, and saving, uploading and
committing each optimizer step. Plain Python over the client library: no grpc, no protobuf.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import pathlib
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from yieldloop.client import RETRY, Client
from yieldloop.errors import (
    AbortedError,
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    YieldloopError,
    as_yieldloop_error,
    invalid_field,
)
from yieldloop.groups import GroupStats, runs_to_datums
from yieldloop.types import Datum, Head, Manifest, ObjectInfo, Run, RunStatus
from yieldloop_server.common import lora, telemetry
from yieldloop_server.common.pool import Pool
from yieldloop_server.store import ObjectStore
from yieldloop_server.store.traces import RunReader
from yieldloop_server.trainer.trainer import (
    STATE_FILE,
    STATE_FILES,
    AdamConfig,
    AdapterSetup,
    ModelTrainer,
    Trainer,
    TrainerConfig,
)
from yieldloop_server.weights.base import WeightSource
from yieldloop_server.weights.files import describe_folder, download_verified, upload_objects

log = logging.getLogger(__name__)

CLOSE_FLUSH_S = 120.0
"""How long closing a session waits for its checkpoints to become durable (the store may be unreachable)."""
PENDING_WAIT_S = 60.0
"""How long a trainer loading a pending head waits for the live trainer that committed it to make it durable."""


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """How a batch of runs becomes a loss: the loss and GRPO's grouping knobs."""

    loss_fn: str = "importance_sampling"
    loss_fn_config: dict[str, float] = dataclasses.field(default_factory=dict)
    normalize_advantages_by_std: bool = False
    drop_groups_without_signal: bool = False
    reward_scale: float = 1.0
    group_size: int = 0
    allow_incomplete_groups: bool = False


@dataclasses.dataclass
class StepOutcome:
    """What an optimizer step did: the step, and the checkpoint it committed (empty when skipped)."""

    step: int
    grad_norm: float
    checkpoint_id: str = ""
    head: Head | None = None
    parent_checkpoint_id: str = ""
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    """Seconds spent: optimizer_s, save_s, commit_s, upload_s (the objects written, the checkpoint made durable)."""
    durable: bool = False
    """The checkpoint is in the object store (every committed step's is when it answers)."""
    has_state: bool = False
    """The checkpoint holds the full training state."""


class TrainingSession:
    """Trains one model slug.

    Args:
        model: The model slug trained.
        store: Where checkpoints are written (the same store CheckpointService reads).
        checkpoints: Client connected to CheckpointService.
        traces: The trace store, to read runs sent by trace id.
        work_dir: Local scratch space for checkpoint folders.
        config: Device, dtype and micro-batch size.
        nproc: Ranks (data parallel when > 1).
        publisher: Serves the sampler weights of pending checkpoints to the fleet (None: every checkpoint is
            written to the store before it is committed).
        state_every: The full training state (optimizer moments) is saved with every ``state_every``-th step
            (0: only on demand and when the session closes).
    """

    def __init__(
        self,
        model: str,
        store: ObjectStore,
        checkpoints: Client,
        traces: RunReader,
        work_dir: pathlib.Path,
        config: TrainerConfig,
        nproc: int = 1,
        publisher: WeightSource | None = None,
        state_every: int = 10,
    ) -> None:
        self.model = model
        self.store = store
        self.checkpoints = checkpoints
        self.traces = traces
        self.work_dir = work_dir
        self.config = config
        self.nproc = nproc
        self.publisher = publisher
        self.state_every = state_every
        self.trainer: ModelTrainer | None = None
        self.checkpoint_id = ""
        self.manifest: Manifest | None = None
        """The checkpoint the weights are at (None before the first load)."""
        self._uploads: dict[str, asyncio.Task] = {}
        """Background uploads of pending checkpoints by id, until they end (their steps answer then)."""
        self._stalls: dict[str, asyncio.Future] = {}
        """Per background upload: resolved by an attempt that a full disk failed (the step waiting answers it)."""
        self._durability: asyncio.Task | None = None
        """The newest background upload (each waits for the one before it: a child may share its parent's
        objects)."""
        self._produced: set[str] = set()
        """Checkpoints this session committed (their training state is the trainer's)."""
        self._outcomes: collections.OrderedDict[str, StepOutcome] = collections.OrderedDict()
        """Recent optimizer steps by idempotency key."""
        self._uncertain: set[str] = set()
        """Keys of steps whose commit failed in a way that may have committed (the answer lost)."""
        self._in_flight = 0
        """Gradient computations running now (a head-following reload waits for them)."""
        self.trained_traces: list[str] = []
        """Trace ids of the runs whose gradients wait for the next optimizer step (its span links to them)."""
        # One thread owns the weights, so calls apply in arrival order.
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainer")

    async def _run(self, fn: Any, *args: Any) -> Any:
        """``fn`` on the trainer's thread. A call that leaves the trainer spoiled (a step gone non-finite without a
        kept copy, a rank lost mid-call) reloads it from the head before its error goes up."""
        # In the caller's context: the trainer thread's spans are children of the call's (run_in_executor
        # alone would drop the context).
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, telemetry.in_context(fn), *args)
        except YieldloopError:
            trainer = self.trainer
            if trainer is not None and trainer.spoiled and fn != trainer.close:
                await self.close_trainer()
                await self.load_head()
            raise

    @property
    def vocab_size(self) -> int:
        assert self.trainer is not None
        return self.trainer.vocab_size

    @property
    def max_tokens(self) -> int:
        """The model's context (datums longer are refused)."""
        assert self.trainer is not None
        return int(getattr(self.trainer.model.config, "max_position_embeddings", 0) or 0)

    async def follow_head(self) -> None:
        """Reloads from the head when it moved away from our last checkpoint (a rollback or a branch point),
        so the next commit extends the tree from there. Only between steps: pending gradients pin the weights.

        The head is read at the call (GetHead), not followed by WatchHead: a caller that moved it (SetHead answered)
        and then calls the trainer must find the trainer at the new head, and a watched head can arrive after that
        call (measured: the rollback test failed on a loaded 2-core machine when a watch stood in for the read)."""
        assert self.trainer is not None
        if self.trainer.num_pending_datums or self._in_flight:
            return  # gradients pending or being computed: they pin the weights
        head = await self.checkpoints.get_head(self.model)
        if head.checkpoint_id != self.checkpoint_id:
            await self.close_trainer()
            await self.load_head()

    async def close_trainer(self) -> None:
        if self.trainer is not None:
            await self._run(self.trainer.close)
        self.trainer = None

    async def _download(
        self, manifest: Manifest, objects: list[ObjectInfo] | None = None, suffix: str = ""
    ) -> pathlib.Path:
        """The checkpoint's objects (or ``objects`` of it, cached under ``suffix``: a folder holding part of a
        checkpoint never stands for all of it), verified, in the trainer's cache."""
        folder = self.work_dir / "cache" / manifest.model / (manifest.checkpoint_id + suffix)
        return await asyncio.to_thread(download_verified, self.store, manifest, folder, objects)

    async def load_head(self) -> None:
        """Loads the model's head checkpoint (weights and optimizer state) from the store; for a LoRA fork,
        its frozen base weights and the adapter at its head. A head still pending (not yet durable) is made
        durable first when this trainer holds its files, and waited for while the trainer that committed it
        serves it (CheckpointService settles a pending head whose trainer is gone: GetHead then answers the
        nearest durable checkpoint, whatever training state it holds; see :meth:`_resume_folder`)."""
        info = await self.checkpoints.get_model(self.model)
        head = await self.checkpoints.get_head(self.model)
        manifest = await self.checkpoints.get_checkpoint(self.model, head.checkpoint_id)
        if manifest.pending:
            manifest = await self._settle_pending(manifest)
        folder = await self._resume_folder(manifest)
        adapter = None
        if info.lora is not None:
            adapter = AdapterSetup(folder, lora.init_seed(self.model))
            folder = await self._download(
                await self.checkpoints.get_checkpoint(info.adapter_base_model, info.adapter_base_checkpoint_id)
            )
        if self.nproc > 1:  # data parallel: rank 0 here, the other ranks in spawned processes
            from yieldloop_server.trainer.distributed import DistributedTrainer

            self.trainer = await self._run(DistributedTrainer, folder, self.config, self.nproc, adapter)
        else:
            self.trainer = await self._run(Trainer, folder, self.config, adapter)
        self.checkpoint_id, self.manifest = manifest.checkpoint_id, manifest

    async def _resume_folder(self, manifest: Manifest) -> pathlib.Path:
        """A local folder with the checkpoint's weights and the training state to resume from: its own, or,
        for a checkpoint saved without one, the optimizer moments of its nearest ancestor that has them (with
        the checkpoint's step)."""
        if manifest.has_state or not manifest.parent_checkpoint_id:
            return await self._download(manifest)
        weights = await self._download(manifest, manifest.sampler_objects, "+weights")
        ancestor = await self._ancestor(manifest, lambda m: m.has_state)
        folder = weights.with_name(f"{manifest.checkpoint_id}+state-{ancestor.checkpoint_id if ancestor else 'none'}")
        if folder.is_dir():
            return folder
        state = None
        if ancestor is not None:
            log.warning(
                "%s: checkpoint %s (step %d) has no training state; resuming with the optimizer moments of %s "
                "(step %d): %d step(s) of moments are missing, the weights are exact",
                self.model,
                manifest.checkpoint_id,
                manifest.step,
                ancestor.checkpoint_id,
                ancestor.step,
                manifest.step - ancestor.step,
            )
            state = await self._download(ancestor, [o for o in ancestor.objects if o.state], "+state")
        staging = pathlib.Path(tempfile.mkdtemp(dir=weights.parent, prefix=".resume-"))
        for path in [*weights.iterdir(), *(state.iterdir() if state else ())]:
            os.symlink(path.resolve(), staging / path.name)
        (staging / STATE_FILE).unlink(missing_ok=True)
        (staging / STATE_FILE).write_text(json.dumps({"step": manifest.step}))
        staging.rename(folder)
        return folder

    async def _ancestor(self, manifest: Manifest, wanted: Callable[[Manifest], bool]) -> Manifest | None:
        """The nearest durable strict ancestor of ``manifest`` that is ``wanted`` (or is a root), or None when
        the chain leaves the model (a fork's first checkpoint) first."""
        while manifest.parent_checkpoint_id:
            try:
                manifest = await self.checkpoints.get_checkpoint(self.model, manifest.parent_checkpoint_id)
            except NotFoundError:
                return None
            if not manifest.pending and (wanted(manifest) or not manifest.parent_checkpoint_id):
                return manifest
        return None

    async def _settle_pending(self, manifest: Manifest) -> Manifest:
        """The checkpoint to load for a pending head (see :meth:`load_head`)."""
        held = self.publisher.find(self.model, manifest.checkpoint_id) if self.publisher else None
        if held is not None:  # ours: finish its upload here
            await self._make_durable(*held, self._durability)
        deadline = time.monotonic() + PENDING_WAIT_S
        while True:
            head = await self.checkpoints.get_head(self.model)  # settled there when its trainer is gone
            manifest = await self.checkpoints.get_checkpoint(self.model, head.checkpoint_id)
            if not manifest.pending:
                return manifest
            if time.monotonic() > deadline:
                raise FailedPreconditionError(
                    f"head {manifest.checkpoint_id} of {self.model!r} is still being written to the store by its "
                    f"trainer ({manifest.weights_source}); try again shortly",
                    reason="CHECKPOINT_PENDING",
                )
            await asyncio.sleep(0.5)

    async def _make_durable(self, manifest: Manifest, folder: pathlib.Path, previous: asyncio.Task | None) -> None:
        """Writes a pending checkpoint's objects to the store and commits it durable, retrying store and
        CheckpointService failures with backoff (its earlier checkpoints first)."""
        if previous is not None:
            await asyncio.wait([previous])  # its outcome is its own step's
        for attempt in itertools.count():
            try:
                await asyncio.to_thread(
                    upload_objects, self.store, self.model, manifest.checkpoint_id, folder, manifest.objects, True
                )
                await self.checkpoints.commit_checkpoint(
                    dataclasses.replace(manifest, pending=False, weights_source="")
                )
                break
            except Exception as err:  # deliberate: the store or CheckpointService is away; try again, unless...
                error = as_yieldloop_error(err)
                if (
                    isinstance(error, (NotFoundError, InvalidArgumentError))  # the model was deleted
                    or error.reason == "CHECKPOINT_ABANDONED"  # CheckpointService gave up on it
                    or (isinstance(error, DataLossError) and attempt >= 2)
                ):  # bytes damaged, written 3 times
                    log.error("%s: checkpoint %s never becomes durable: %s", self.model, manifest.checkpoint_id, err)
                    raise
                stalled = self._stalls.get(manifest.checkpoint_id)
                if error.reason == "NO_SPACE" and stalled is not None and not stalled.done():
                    stalled.set_result(error)  # its step answers RESOURCE_EXHAUSTED; the upload goes on trying
                log.warning("%s: checkpoint %s not durable yet (%s); retrying", self.model, manifest.checkpoint_id, err)
                await asyncio.sleep(RETRY.delay(attempt))
        if self.manifest is not None and self.manifest.checkpoint_id == manifest.checkpoint_id:
            self.manifest = dataclasses.replace(manifest, pending=False, weights_source="")
        assert self.publisher is not None
        self.publisher.durable(self.model, manifest.checkpoint_id)

    async def flush(self) -> None:
        """Returns once every checkpoint this session committed is durable."""
        if self._durability is not None:
            await asyncio.shield(self._durability)

    async def save_state(self) -> None:
        """Adds the training state to the current checkpoint when this session produced it without one (what
        resuming there exactly needs), once it is durable."""
        await self.flush()
        manifest = self.manifest
        if (
            self.trainer is None
            or manifest is None
            or manifest.has_state
            or manifest.checkpoint_id not in self._produced
        ):
            return
        scratch = pathlib.Path(tempfile.mkdtemp(dir=self.work_dir, prefix=".state-"))
        try:
            await self._run(self.trainer.save_state, scratch)
            added = await asyncio.to_thread(
                describe_folder, self.model, manifest.checkpoint_id, scratch, state_names=STATE_FILES
            )
            await asyncio.to_thread(
                upload_objects, self.store, self.model, manifest.checkpoint_id, scratch, added, True
            )
            manifest = dataclasses.replace(manifest, objects=[*manifest.objects, *added], pending=False)
            self.manifest, _ = await self.checkpoints.commit_checkpoint(manifest)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    async def close(self) -> None:
        """Makes everything durable (the training state included) within ``CLOSE_FLUSH_S``, then frees the
        weights."""
        try:
            await asyncio.wait_for(self.save_state(), CLOSE_FLUSH_S)
        except Exception as err:  # deliberate: closing must go on; what is not durable stays pending (rolled back)
            log.error(
                "%s: closing without everything durable (%s): a pending head is rolled back by the next trainer",
                self.model,
                err or type(err).__name__,
            )
        if self._durability is not None:
            self._durability.cancel()
        await self.close_trainer()
        if self.publisher is not None:
            self.publisher.release_model(self.model)
        self._executor.shutdown(wait=True)

    async def get_runs(self, trace_ids: Sequence[str]) -> list[Run]:
        """Recorded runs by trace id, read together (NOT_FOUND/TRACE_NOT_FOUND when one is missing)."""
        if not trace_ids:
            return []
        return await asyncio.to_thread(lambda: [self.traces.get(trace_id) for trace_id in trace_ids])

    async def forward_backward(
        self, datums: Sequence[Datum], runs: Sequence[Run], options: LossOptions
    ) -> tuple[dict[str, float], int, GroupStats]:
        """Accumulates the gradient of a built-in loss on ``datums`` plus the runs' datums (GRPO advantages).

        Runs that were not graded (env or infra failures) carry no reward signal and are left out.
        Returns the loss metrics, the number of datums trained on and the group statistics.
        """
        assert self.trainer is not None
        graded = [run for run in runs if run.status in (RunStatus.GRADED, RunStatus.UNSPECIFIED)]
        run_datums, stats = runs_to_datums(
            graded,
            normalize_by_std=options.normalize_advantages_by_std,
            drop_groups_without_signal=options.drop_groups_without_signal,
            reward_scale=options.reward_scale or 1.0,
            group_size=options.group_size,
            allow_incomplete_groups=options.allow_incomplete_groups,
        )
        for i, datum in enumerate(run_datums):
            datum.validate(self.vocab_size, f"runs[{i}]", self.max_tokens)
        all_datums = [*datums, *run_datums]
        if not all_datums:
            raise invalid_field("items", "the batch is empty (no datums, or every group was dropped)")
        self._in_flight += 1
        try:
            metrics = await self._run(
                self.trainer.forward_backward, all_datums, options.loss_fn, dict(options.loss_fn_config)
            )
        finally:
            self._in_flight -= 1
        metrics["num_runs_ungraded"] = len(runs) - len(graded)
        return metrics, len(all_datums), stats

    async def score(self, items: Sequence[Datum | Run]) -> list[tuple[Datum, list[float]]]:
        """Each item as the datum scored (runs with their group-centred advantages) and its learner logprobs."""
        assert self.trainer is not None
        runs = [item for item in items if not isinstance(item, Datum)]
        run_datums = iter(runs_to_datums(runs)[0])
        datums = [item if isinstance(item, Datum) else next(run_datums) for item in items]
        for i, datum in enumerate(datums):
            datum.validate(self.vocab_size, f"items[{i}]")
        logprobs = await self._run(self.trainer.logprobs, datums)
        return list(zip(datums, logprobs, strict=True))

    async def backward(self, datums: Sequence[Datum]) -> int:
        """Accumulates the gradient of -(weights * logprob).sum() (a custom loss's); returns the tokens counted."""
        assert self.trainer is not None
        # -(weights * lp).sum() is exactly the cross_entropy loss with these weights.
        self._in_flight += 1
        try:
            metrics = await self._run(self.trainer.forward_backward, list(datums), "cross_entropy", {})
        finally:
            self._in_flight -= 1
        return int(metrics["num_action_tokens"])

    async def discard_gradients(self) -> int:
        """Forgets the accumulated gradients (every caller's); returns how many datums they came from. The next
        call trains from the model's head (pending gradients no longer pin the weights)."""
        assert self.trainer is not None
        dropped = self.trainer.num_pending_datums
        await self._run(self.trainer.drop_gradients)
        self.trained_traces.clear()
        return dropped

    async def optim_step(
        self,
        adam: AdamConfig,
        *,
        skip_checkpoint: bool = False,
        set_head: bool = True,
        metadata_json: str = "",
        idempotency_key: str = "",
        drop_gradients_if_refused: bool = False,
        save_state: bool = False,
        wait_durable: bool = False,
    ) -> StepOutcome:
        """Applies the accumulated gradient; unless ``skip_checkpoint``, saves and commits the step as a
        checkpoint whose parent is the one the weights came from, moving HEAD (when ``set_head``) only if it
        still points there (ABORTED/HEAD_CONFLICT otherwise: another trainer or a rollback moved it).

        A checkpoint that moves HEAD is committed pending (its sampler weights served to the fleet by the publisher)
        and written to the store meanwhile; one that does not (a candidate for a promotion gate), or with
        ``wait_durable``, is written to the store first and committed once. The step returns once it is durable,
        so a returned step is never rolled back. The training state goes with it every
        ``state_every`` steps and with ``save_state``.

        All or nothing: a step refused for non-finite values, or whose commit fails, leaves the session
        exactly as before it (weights, optimizer state, accumulated gradients), unless
        ``drop_gradients_if_refused``. A retry with the same ``idempotency_key`` returns the first outcome,
        also from a new trainer process (the key is recorded in the checkpoint's metadata).
        """
        assert self.trainer is not None
        if idempotency_key:
            earlier = await self._replay(idempotency_key)
            if earlier is not None:
                return earlier
        parent = self.checkpoint_id
        started = time.perf_counter()
        grad_norm = await self._apply(adam, revocable=not skip_checkpoint, drop_if_refused=drop_gradients_if_refused)
        step = self.trainer.step
        timings = {"optimizer_s": time.perf_counter() - started}
        if skip_checkpoint:
            await self._run(self.trainer.finish_step, True)
            return self._remember(
                idempotency_key, StepOutcome(step, grad_norm, parent_checkpoint_id=parent, timings=timings)
            )
        checkpoint_id = f"step-{step:06d}-{uuid.uuid4().hex[:8]}"
        metadata = {"grad_norm": grad_norm, **(json.loads(metadata_json) if metadata_json else {})}
        if idempotency_key:
            metadata["idempotency_key"] = idempotency_key
        with_state = save_state or (self.state_every > 0 and step % self.state_every == 0)
        # Pending only when HEAD moves (the fleet reloads while the store is written); a candidate that does not
        # move it is sampled by nobody before it is durable: written first, committed once.
        pending = set_head and not wait_durable and self.publisher is not None and bool(self.publisher.address)
        folder = (
            self.publisher.folder(self.model, checkpoint_id)
            if self.publisher is not None
            else self.work_dir / ".save" / checkpoint_id
        )
        try:
            manifest = await self._save(checkpoint_id, folder, parent, step, metadata, with_state, pending, timings)
            started = time.perf_counter()
            head = await self._commit(manifest, parent, set_head)
        except BaseException:
            await self._run(self.trainer.finish_step, False)  # exactly as before the step, gradients included
            if idempotency_key:
                self._uncertain.add(idempotency_key)
            else:  # nobody will ask again: its files go (an uncertain commit keeps them to finish it)
                self._discard(checkpoint_id, folder)
            raise
        timings["commit_s"] = time.perf_counter() - started
        await self._run(self.trainer.finish_step, True)
        self.checkpoint_id, self.manifest = checkpoint_id, manifest
        self._produced.add(checkpoint_id)
        outcome = self._remember(
            idempotency_key,
            StepOutcome(step, grad_norm, checkpoint_id, head, parent, timings, durable=True, has_state=with_state),
        )
        if not pending:
            self._discard(checkpoint_id, folder)
            return outcome
        # The head moved (the fleet reloads from this trainer meanwhile); the answer waits for durability, so an
        # acknowledged step is never rolled back. A caller that gives up waiting finds it by its key.
        self._stalls[checkpoint_id] = asyncio.get_running_loop().create_future()
        self._durability = task = asyncio.create_task(self._make_durable(manifest, folder, self._durability))
        task.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved: awaited or not
        self._uploads[checkpoint_id] = task
        started = time.perf_counter()
        await self._until_durable(idempotency_key, checkpoint_id)
        timings["upload_s"] = time.perf_counter() - started
        return outcome

    async def _replay(self, idempotency_key: str) -> StepOutcome | None:
        """The outcome of the step already made with ``idempotency_key``, if one was (waiting until it is durable);
        None when this is the key's first step."""
        assert self.trainer is not None
        earlier = self._outcomes.get(idempotency_key)
        # The store is asked only when the step may have been committed unheard: its commit's answer was lost
        # here, or this trainer was restarted (then no gradients are pending).
        maybe = idempotency_key in self._uncertain or not self.trainer.num_pending_datums
        if earlier is None and maybe and (earlier := await self._committed_with_key(idempotency_key)) is not None:
            # Committed, though its caller heard an error (the answer was lost, or this trainer restarted): the
            # gradients it applied are in that checkpoint; continue from there.
            if self.checkpoint_id != earlier.checkpoint_id:
                await self._run(self.trainer.drop_gradients)
                await self.close_trainer()
                await self.load_head()
        if earlier is not None:
            await self._until_durable(idempotency_key, earlier.checkpoint_id)
            return earlier
        if not self.trainer.num_pending_datums:
            raise FailedPreconditionError(
                "no gradients accumulated since the last step, and no committed step has this idempotency "
                "key: if this retries a step whose trainer restarted, that step was not committed and its "
                "gradients were lost with the trainer; run forward_backward again",
                reason="NO_GRADIENTS",
            )
        return None

    async def _apply(self, adam: AdamConfig, revocable: bool, drop_if_refused: bool) -> float:
        """The AdamW step; returns the gradient norm. A refused step changes nothing, unless it spoiled the weights
        (reloaded from the head) or ``drop_if_refused`` drops the non-finite gradients."""
        assert self.trainer is not None
        before = self.trainer
        try:
            return await self._run(self.trainer.optim_step, adam, revocable)
        except YieldloopError as err:  # a spoiled trainer was reloaded from the head (_run)
            if self.trainer is before and drop_if_refused and err.reason == "NON_FINITE":
                await self._run(self.trainer.drop_gradients)
            raise

    async def _save(
        self,
        checkpoint_id: str,
        folder: pathlib.Path,
        parent: str,
        step: int,
        metadata: dict[str, Any],
        with_state: bool,
        pending: bool,
        timings: dict[str, float],
    ) -> Manifest:
        """Writes the step's checkpoint into ``folder`` and describes it; a ``pending`` one is published (served
        to the fleet before the store has it), any other is written to the store first."""
        assert self.trainer is not None
        started = time.perf_counter()
        await self._run(self.trainer.save, folder, with_state)
        reuse = self.manifest.sampler_objects if self.manifest is not None else []
        objects = await asyncio.to_thread(
            describe_folder, self.model, checkpoint_id, folder, state_names=STATE_FILES, reuse=reuse
        )
        timings["save_s"] = time.perf_counter() - started
        manifest = Manifest(
            model=self.model,
            checkpoint_id=checkpoint_id,
            objects=objects,
            parent_checkpoint_id=parent,
            step=step,
            metadata_json=json.dumps(metadata),
            pending=pending,
            weights_source=self.publisher.address if pending and self.publisher else "",
        )
        if pending:
            assert self.publisher is not None
            self.publisher.publish(manifest)
        else:  # durable before the commit: earlier pending checkpoints first (this one may share their objects)
            await self.flush()
            started = time.perf_counter()
            await asyncio.to_thread(upload_objects, self.store, self.model, checkpoint_id, folder, objects, True)
            timings["upload_s"] = time.perf_counter() - started
        return manifest

    async def _commit(self, manifest: Manifest, parent: str, set_head: bool) -> Head | None:
        """Commits the step's checkpoint, moving HEAD (``set_head``) only if it still names ``parent``."""
        try:
            _, head = await self.checkpoints.commit_checkpoint(
                manifest, set_head=set_head, expected_head_checkpoint_id=parent if set_head else ""
            )
        except AbortedError as err:
            if err.reason != "HEAD_CONFLICT":
                raise
            raise AbortedError(
                f"{err.message}. The step was not applied; its gradients, computed on the weights of {parent}, "
                "are kept and pin them: DiscardGradients (`yieldloop models discard-gradients MODEL`) drops them, "
                "then the next call trains from the new head",
                reason="HEAD_CONFLICT",
            ) from None
        return head

    async def _until_durable(self, key: str, checkpoint_id: str) -> None:
        """Returns once the step's checkpoint is durable; raises (and forgets the step's outcome) when it never
        will be (abandoned, or its model deleted), and RESOURCE_EXHAUSTED (NO_SPACE) while the store's disk is full
        (the upload goes on retrying; a retry of the step with its key waits for it again)."""
        task = self._uploads.get(checkpoint_id)
        if task is None:
            return
        stalled = self._stalls.get(checkpoint_id)
        if stalled is not None and stalled.done():  # a retry: wait for the upload's next attempt
            stalled = self._stalls[checkpoint_id] = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait([task, *([stalled] if stalled is not None else [])], return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                raise stalled.result()
            task.result()
        except YieldloopError:
            if key and task.done():
                self._outcomes.pop(key, None)
            raise
        finally:
            if task.done():
                self._uploads.pop(checkpoint_id, None)
                self._stalls.pop(checkpoint_id, None)

    def _discard(self, checkpoint_id: str, folder: pathlib.Path) -> None:
        if self.publisher is not None:
            self.publisher.release(self.model, checkpoint_id)
        shutil.rmtree(folder, ignore_errors=True)

    def _remember(self, key: str, outcome: StepOutcome) -> StepOutcome:
        if key:
            self._uncertain.discard(key)
            self._outcomes[key] = outcome
            while len(self._outcomes) > 256:
                self._outcomes.popitem(last=False)
        return outcome

    async def _committed_with_key(self, key: str) -> StepOutcome | None:
        """The step committed with ``key`` by an earlier trainer process, when it is the head (what a retry after
        the trainer died mid-answer finds)."""
        head = await self.checkpoints.get_head(self.model)
        manifest = await self.checkpoints.get_checkpoint(self.model, head.checkpoint_id)
        try:
            metadata = json.loads(manifest.metadata_json or "{}")
        except ValueError:
            return None
        if not isinstance(metadata, dict) or metadata.get("idempotency_key") != key:
            return None
        if manifest.pending and (
            self.publisher is None or self.publisher.find(self.model, manifest.checkpoint_id) is None
        ):
            return None  # another live trainer's (GetHead settled it otherwise): not this step's commit to finish
        # (Pending and ours: the commit went through but its answer was lost; reloading the head finishes it.)
        return self._remember(
            key,
            StepOutcome(
                manifest.step,
                float(metadata.get("grad_norm", 0.0)),
                manifest.checkpoint_id,
                head,
                manifest.parent_checkpoint_id,
                durable=True,
                has_state=manifest.has_state,
            ),
        )


class TrainingSessions:
    """One :class:`TrainingSession` per model slug: loaded from the slug's head on first use, never sharing
    weights, optimizer state or gradients with another slug. Beyond ``max_sessions`` loaded at once, the least
    recently used idle session (no call in flight, no pending gradients) is closed; when none is idle the call
    is refused (RESOURCE_EXHAUSTED/TOO_MANY_MODELS) rather than dropping a slug's gradients (a
    :class:`~yieldloop_server.common.pool.Pool`).

    Args:
        make: Builds the (unloaded) session of a slug.
        default: The slug a call naming no model trains.
        max_sessions: Sessions loaded at once.
        checkpoints: CheckpointService client: a slug is checked to exist before any session is closed for it.
    """

    def __init__(
        self,
        make: Callable[[str], TrainingSession],
        default: str,
        max_sessions: int = 2,
        checkpoints: Client | None = None,
    ) -> None:
        self.make = make
        self.default = default
        self.checkpoints = checkpoints
        self._pool: Pool[TrainingSession] = Pool(
            default,
            self._load,
            TrainingSession.close,
            max_sessions,
            check=self._check,
            busy=lambda session: bool(session.trainer and session.trainer.num_pending_datums),
            owner="the trainer",
            busy_hint="run their optimizer steps first",
        )

    async def start(self) -> None:
        """Loads the default slug (a missing model fails the start, not the first call)."""
        async with self.use(self.default):
            pass

    def use(self, model: str = "") -> contextlib.AbstractAsyncContextManager[TrainingSession]:
        """The session of ``model`` (default: the default slug), loaded if needed, held for the block."""
        return self._pool.use(model)

    async def _check(self, slug: str) -> int:
        if self.checkpoints is not None:
            await self.checkpoints.get_head(slug)  # NOT_FOUND (MODEL_NOT_FOUND) for a slug that does not exist
        return 0

    async def _load(self, slug: str) -> TrainingSession:
        session = self.make(slug)
        try:
            await session.load_head()  # NOT_FOUND (MODEL_NOT_FOUND) for a slug that does not exist
        except BaseException:
            await session.close()
            raise
        return session

    @property
    def loaded(self) -> list[str]:
        return self._pool.names

    async def close(self) -> None:
        await self._pool.close()
