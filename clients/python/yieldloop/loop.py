"""The closed loop: roll out -> train -> checkpoint -> held-out gate -> promote (HEAD) -> reload, repeated.

Each step:

1. rolls out the training tasks with the served head (``group_size`` episodes per task) and reports the
   groups without reward spread before training on them; with ``max_off_policy`` N > 0 (default 1) the next N
   batches are already sampling while this one trains, and each step reports how many of its runs were
   sampled by older weights, and how much older (the loss's importance ratio uses their recorded logprobs);
   the first batch samples while the starting head is evaluated (the gate's reference); on-policy (N = 0), the
   next batch samples the candidate while step 3 evaluates it, where the rollout service samples candidates
   with an engine like the head's (``ServingInfo.candidate_engine_like_head``), and is dropped if step 4
   rejects it;
2. ``forward_backward`` (the trainer's KL and clip fraction are kept), then ``optim_step``, which commits
   the candidate checkpoint to the tree *without* moving HEAD;
3. evaluates the candidate on the held-out tasks (disjoint from the training tasks) through
   RolloutService, which loads the candidate beside the served head;
4. the promotion gate: the candidate becomes HEAD (the rollout fleet reloads it) unless its held-out mean
   reward is below the head's by more than ``promotion_tolerance``; a rejected candidate stays in the
   tree, unpromoted, with the reason recorded, and the trainer continues from HEAD;
5. the reward-hacking monitor compares training reward and held-out reward: rising training reward with
   falling held-out reward two evals in a row is a warning.

Every step is written to ``<runs_dir>/<job id>/steps.jsonl`` (plus sample trajectories and, at the end, the
checkpoint tree), which ``yieldloop report`` turns into a PNG and an HTML page.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import math
import pathlib
import random
import time
import tomllib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from yieldloop.client import Client
from yieldloop.environment import Task
from yieldloop.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from yieldloop.specs import called, load_attr
from yieldloop.training import Agent, Job, failures, mean_reward, off_policy, report_groups_without_spread, run_tasks
from yieldloop.types import CheckpointSummary, Head, JobInfo, Promotion, PromotionState, Run, RunStatus, TaskRef

CONFIG_ERROR = "BAD_CONFIG"


@dataclasses.dataclass
class LoopConfig:
    """A training run, as ``yieldloop train <config.toml|config.json>`` reads it (every key but ``train_tasks``
    optional; the demo's are :data:`yieldloop.envs.letters.TASKS`)."""

    model: str = "tiny"
    train_tasks: str = ""
    """Training taskset (required): a .py/.json/.jsonl file, ``file.py:attr`` or ``module:attr`` (a list of tasks
    or a function returning one)."""
    heldout_tasks: str = ""
    """Held-out taskset for the promotion gate, disjoint from the training tasks (empty: no gate, every checkpoint
    is promoted)."""
    steps: int = 30
    """Optimizer steps at most."""
    target_heldout_reward: float = 0.0
    """Stop once the head's held-out mean reward reaches this (0: run every step)."""
    group_size: int = 8
    tasks_per_step: int = 0
    """Training tasks sampled per step (0: all of them)."""
    heldout_group_size: int = 1
    """Held-out episodes per task (1 suits the default greedy evaluation)."""
    learning_rate: float = 1e-3
    loss_fn: str = "importance_sampling"
    loss_fn_config: dict[str, float] = dataclasses.field(default_factory=dict)
    normalize_advantages_by_std: bool = False
    max_grad_norm: float = 0.0
    temperature: float = 1.0
    heldout_temperature: float = 0.0
    """Sampling temperature of the held-out evaluation (0: greedy, so the gate compares weights, not luck)."""
    max_tokens: int = 12
    max_steps: int = 0
    """Model turns per episode (0: the rollout service's default)."""
    max_concurrent: int = 0
    promotion_tolerance: float = 0.05
    """A candidate is promoted unless its held-out reward is below the head's by more than this."""
    seed: int = 0
    name: str = ""
    max_off_policy: int = 1
    """Overlap: the next batches' rollouts run while the current batch trains, so a batch is sampled by weights
    at most this many steps older than the ones it trains (each token's sampling logprob and weight version are
    recorded, so the importance ratio uses the true sampler). 0: every batch is sampled by the weights it trains
    (with held-out tasks, by the candidate while the gate evaluates it, dropped if the gate rejects it)."""

    @classmethod
    def from_file(cls, path: str | pathlib.Path) -> LoopConfig:
        """Reads a ``.toml`` or ``.json`` config; unknown keys and wrong types are INVALID_ARGUMENT (BAD_CONFIG)."""
        path = pathlib.Path(path)
        try:
            text = path.read_text()
        except OSError as err:
            raise InvalidArgumentError(f"cannot read config {path}: {err.strerror}", reason=CONFIG_ERROR) from None
        try:
            raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except ValueError as err:
            raise InvalidArgumentError(
                f"config {path} is not valid {path.suffix[1:] or 'JSON'}: {err}", reason=CONFIG_ERROR
            ) from None
        if path.suffix not in (".toml", ".json"):
            raise InvalidArgumentError(f"config {path}: use a .toml or .json file", reason=CONFIG_ERROR)
        return cls.from_dict(raw, str(path))

    @classmethod
    def from_dict(cls, raw: Any, where: str = "config") -> LoopConfig:
        if not isinstance(raw, dict):
            raise InvalidArgumentError(f"{where}: a config is a table of keys", reason=CONFIG_ERROR)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(fields))
        if unknown:
            raise InvalidArgumentError(
                f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(fields)})", reason=CONFIG_ERROR
            )
        defaults = cls()
        for key, value in raw.items():
            expected = type(getattr(defaults, key))
            ok = isinstance(value, expected) or (expected is float and isinstance(value, int))
            if not ok or isinstance(value, bool) != (expected is bool):
                raise InvalidArgumentError(
                    f"{where}: {key} must be {expected.__name__}, got {value!r}", reason=CONFIG_ERROR
                )
        config = cls(**{k: (float(v) if isinstance(getattr(defaults, k), float) else v) for k, v in raw.items()})
        if not config.train_tasks:
            raise InvalidArgumentError(
                f"{where}: train_tasks is required (a .py/.json/.jsonl file, file.py:attr or module:attr; "
                f"heldout_tasks, disjoint from it, adds the promotion gate)",
                reason=CONFIG_ERROR,
            )
        return config.validate(where)

    def validate(self, where: str = "config") -> LoopConfig:
        checks = {
            "steps": self.steps >= 1,
            "group_size": self.group_size >= 1,
            "heldout_group_size": self.heldout_group_size >= 1,
            "tasks_per_step": self.tasks_per_step >= 0,
            "learning_rate": self.learning_rate > 0,
            "max_tokens": self.max_tokens >= 1,
            "promotion_tolerance": self.promotion_tolerance >= 0,
            "temperature": self.temperature >= 0,
            "target_heldout_reward": 0 <= self.target_heldout_reward <= 1,
            "max_off_policy": self.max_off_policy >= 0,
        }
        for key, ok in checks.items():
            if not ok:
                raise InvalidArgumentError(
                    f"{where}: {key} = {getattr(self, key)!r} is out of range", reason=CONFIG_ERROR
                )
        return self


def load_tasks(spec: str) -> list[Task]:
    """Tasks from a .py/.json/.jsonl file or a ``module:attr`` naming a list of tasks or a function returning one."""
    from yieldloop.taskset import Taskset

    if not spec:
        return []
    if spec.endswith((".py", ".json", ".jsonl")):
        if not pathlib.Path(spec).is_file():
            raise InvalidArgumentError(f"taskset file {spec} does not exist", reason=CONFIG_ERROR)
        return list(Taskset.load(spec))
    tasks = called(load_attr(spec, "tasks", prefix="yieldloop_tasks"), spec)
    if not isinstance(tasks, list) or not all(isinstance(t, Task) for t in tasks) or not tasks:
        raise InvalidArgumentError(f"{spec!r} is not a non-empty list of tasks", reason=CONFIG_ERROR)
    return tasks


def _task_key(task: Task | TaskRef) -> tuple[str, str, str]:
    return (task.env, task.scenario, json.dumps(json.loads(task.args_json or "{}"), sort_keys=True))


@dataclasses.dataclass
class StepReport:
    """One loop step, as printed and written to ``steps.jsonl``."""

    step: int
    job_id: str
    """The loop's job (its training runs; ``runs_dir/<job_id>/`` holds the record)."""
    checkpoint_id: str
    """The candidate this step committed."""
    parent_checkpoint_id: str
    promoted: bool
    reason: str
    head_checkpoint_id: str
    """HEAD after the gate's decision."""
    served_weight_version: str
    train_reward: float
    heldout_reward: float
    """The candidate's held-out mean reward."""
    head_heldout_reward: float
    """The held-out mean reward of HEAD after the decision."""
    num_runs: int
    groups_without_spread: int
    loss: float
    kl: float
    clip_fraction: float
    entropy: float
    sampled_weight_versions: list[str]
    rollout_s: float
    forward_backward_s: float
    optim_s: float
    """Optimizer step + checkpoint write and commit."""
    heldout_s: float
    reload_s: float
    """Head move -> the rollout service serves the new weights."""
    total_s: float
    warning: str = ""
    off_policy_runs: int = 0
    """Runs of this batch sampled (in part) by weights older than the ones it trained (overlap)."""
    max_staleness: int = 0
    """How many steps older than the trained weights the oldest sampling weights were."""
    completion_tokens: int = 0
    """Tokens the policy sampled in this step's training runs."""
    useful_tokens: int = 0
    """Tokens of the datums the trainer ran forward/backward on (those with an action token)."""
    computed_tokens: int = 0
    """Positions the trainer's forwards computed for them: as many packed, more with padding."""

    def line(self) -> str:
        """The step in one line (under 120 characters): rewards, the candidate and the gate's decision, the step's
        time, how many groups taught nothing and how many runs were off-policy (``steps.jsonl`` has the rest)."""
        mark = "promoted" if self.promoted else "NOT promoted"
        flat = f"  {self.groups_without_spread} flat group(s)" if self.groups_without_spread else ""
        stale = f"  off-policy {self.off_policy_runs}/{self.num_runs}" if self.off_policy_runs else ""
        return (
            f"step {self.step:>2}: train {self.train_reward:.3f}  held-out {self.heldout_reward:.3f}  "
            f"kl {self.kl:.4f}  {self.checkpoint_id} {mark}  {self.total_s:.1f}s{flat}{stale}"
        )


@dataclasses.dataclass
class Baseline:
    """The held-out evaluation of the starting head (step 0)."""

    checkpoint_id: str
    heldout_reward: float
    heldout_s: float


class RunRecorder:
    """Writes a loop's steps, sample trajectories and checkpoint tree under ``run_dir`` for ``yieldloop report``."""

    def __init__(self, run_dir: pathlib.Path, config: LoopConfig, job_id: str, resume: bool = False) -> None:
        self.run_dir = run_dir
        self.resumed = resume and (run_dir / "steps.jsonl").exists()
        """Appending to an interrupted run's files (its baseline stays the first one)."""
        run_dir.mkdir(parents=True, exist_ok=True)
        if self.resumed:
            return
        meta = {"job_id": job_id, "config": dataclasses.asdict(config), "started": time.time()}
        (run_dir / "run.json").write_text(json.dumps(meta, indent=1) + "\n")
        for name in ("steps.jsonl", "samples.jsonl"):
            (run_dir / name).write_text("")

    def steps_done(self) -> int:
        """Steps recorded so far (an interrupted run's, when resumed)."""
        return len(recorded_steps(self.run_dir))

    def _append(self, name: str, row: dict[str, Any]) -> None:
        with open(self.run_dir / name, "a") as f:
            f.write(json.dumps(row) + "\n")

    def baseline(self, baseline: Baseline) -> None:
        if self.resumed:
            return
        self._append("steps.jsonl", {"step": 0, **dataclasses.asdict(baseline)})

    def step(self, report: StepReport) -> None:
        self._append("steps.jsonl", dataclasses.asdict(report))

    def samples(self, step: int, kind: str, runs: Sequence[Run], count: int = 2) -> None:
        for run in list(runs)[:count]:
            self._append(
                "samples.jsonl",
                {
                    "step": step,
                    "kind": kind,
                    "trace_id": run.trace_id,
                    "task": json.loads(run.task.args_json or "{}"),
                    "prompt": run.prompt,
                    "answer": run.answer,
                    "reward": run.reward,
                    "weight_version": run.turns[-1].weight_version if run.turns else "",
                },
            )

    async def checkpoint_tree(self, client: Client, model: str) -> None:
        rows = [_summary_record(c) for c in await client.list_checkpoints(model)]
        (self.run_dir / "checkpoints.json").write_text(json.dumps(rows, indent=1) + "\n")


def recorded_steps(run_dir: pathlib.Path) -> list[dict[str, Any]]:
    """The optimizer steps a run folder records (``steps.jsonl`` without its baseline row), oldest first."""
    try:
        rows = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines() if line]
    except (OSError, ValueError):
        return []
    return [row for row in rows if "checkpoint_id" in row]


def _summary_record(summary: CheckpointSummary) -> dict:
    """A checkpoint of the tree as ``checkpoints.json`` keeps it (the promotion state by its wire name)."""
    record = dataclasses.asdict(summary)
    if summary.promotion is None:
        del record["promotion"]
    else:
        record["promotion"]["state"] = f"PROMOTION_STATE_{summary.promotion.state.name}"
    return record


async def closed_loop(
    client: Client,
    config: LoopConfig,
    *,
    train_tasks: Sequence[Task] | None = None,
    heldout_tasks: Sequence[Task] | None = None,
    runs_dir: pathlib.Path | None = None,
    baseline: list[Baseline] | None = None,
    resume: str = "",
    on_start: Callable[[str], None] | None = None,
) -> AsyncIterator[StepReport]:
    """Runs the loop and yields a report after each step (see the module docstring).

    Tasks default to the config's specs; with ``runs_dir`` the run is recorded in ``runs_dir/<job id>/``;
    ``baseline``, when given, receives the step-0 held-out evaluation; ``on_start`` is told the job's id before
    the first rollout. ``resume`` names an interrupted loop's job: this one continues it (the same job and run
    folder, the steps it had left, from the model's head).
    """
    train = list(train_tasks) if train_tasks is not None else load_tasks(config.train_tasks)
    heldout = list(heldout_tasks) if heldout_tasks is not None else load_tasks(config.heldout_tasks)
    _check_tasks(train, heldout)
    loop = await _Loop.start(client, config, train, heldout, runs_dir, resume)
    if on_start is not None:
        on_start(loop.job.id)
    done = loop.recorder.steps_done() if loop.recorder is not None and resume else 0
    try:
        if heldout:
            first = await loop.evaluate_start()
            if baseline is not None:
                baseline.append(first)
        for step_index in range(done + 1, config.steps + 1):
            report = await loop.step(step_index)
            yield report
            if config.target_heldout_reward and heldout and loop.head_score >= config.target_heldout_reward:
                break
    finally:
        await loop.cancel_batches()


def _resumable(jobs: dict[str, JobInfo], job_id: str, config: LoopConfig) -> JobInfo:
    """The job ``yieldloop train --resume JOB`` continues: a training loop's, of the config's model.

    Raises:
        NotFoundError: JOB_NOT_FOUND naming the training jobs there are.
        InvalidArgumentError: BAD_CONFIG when it is not a training loop's job or trained another model.
    """
    record = jobs.get(job_id)
    trained = [j.job_id for j in jobs.values() if "loop" in _metadata(j)]
    if record is None:
        raise NotFoundError(
            f"no job {job_id!r} to resume (training jobs: {', '.join(trained[-5:]) or 'none'})", reason="JOB_NOT_FOUND"
        )
    if job_id not in trained:
        raise InvalidArgumentError(f"job {job_id} ({record.name!r}) is not a training loop's", reason=CONFIG_ERROR)
    if record.model != config.model:
        raise InvalidArgumentError(
            f"job {job_id} trained {record.model!r}, the config trains {config.model!r}", reason=CONFIG_ERROR
        )
    return record


def _metadata(job: JobInfo) -> dict[str, Any]:
    """A job's metadata (a training loop's holds its config under "loop"); {} when it holds no JSON object."""
    try:
        metadata = json.loads(job.metadata_json or "{}")
    except ValueError:
        return {}
    return metadata if isinstance(metadata, dict) else {}


def _check_tasks(train: list[Task], heldout: list[Task]) -> None:
    overlap = {_task_key(t) for t in train} & {_task_key(t) for t in heldout}
    if overlap:
        raise InvalidArgumentError(
            f"{len(overlap)} held-out task(s) are also training tasks, e.g. {sorted(overlap)[0]}",
            reason=CONFIG_ERROR,
        )
    if not train:
        raise InvalidArgumentError(
            "no training tasks: set train_tasks (a .py/.json/.jsonl file, file.py:attr or module:attr)",
            reason=CONFIG_ERROR,
        )


@dataclasses.dataclass
class _Gate:
    """The promotion gate's outcome for one candidate."""

    score: float
    runs: list[Run]
    promoted: bool
    reason: str
    evaluated: float
    """perf_counter() when the evaluation ended."""


class _Loop:
    """The state of one closed loop between steps: the jobs, the head and its held-out score, the heads trained
    from (staleness is a distance in that list), the batches sampling ahead, the divergence watch."""

    def __init__(
        self, client: Client, config: LoopConfig, train: list[Task], heldout: list[Task], job: Job, heldout_job: Job
    ) -> None:
        self.client, self.config, self.train, self.heldout = client, config, train, heldout
        self.job, self.heldout_job = job, heldout_job
        self.rng = random.Random(config.seed)
        self.agent = Agent(
            model=config.model, temperature=config.temperature, max_tokens=config.max_tokens, max_steps=config.max_steps
        )
        self.heldout_agent = dataclasses.replace(self.agent, temperature=config.heldout_temperature)
        self.recorder: RunRecorder | None = None
        self.head: Head | None = None
        self.head_score = float("nan")
        self.heads: list[str] = []
        self.history: list[tuple[float, float]] = []
        self.diverging = 0
        self.batches: collections.deque[asyncio.Task] = collections.deque()
        self.sample_candidates = False
        """Whether a candidate is sampled by an engine like the head's (then an on-policy batch samples it while the
        gate evaluates it)."""

    @classmethod
    async def start(
        cls,
        client: Client,
        config: LoopConfig,
        train: list[Task],
        heldout: list[Task],
        runs_dir: pathlib.Path | None,
        resume: str = "",
    ) -> _Loop:
        jobs = {job.job_id: job for job in await client.list_jobs()} if resume else {}
        if resume:
            job = Job(client, _resumable(jobs, resume, config))
        else:
            job = await Job.start(
                config.model,
                config.group_size,
                name=config.name or "train",
                client=client,
                metadata={"loop": dataclasses.asdict(config)},
            )
        heldout_name = f"{job.id}-heldout"
        earlier = next((j for j in jobs.values() if j.name == heldout_name), None)
        heldout_job = (
            Job(client, earlier)
            if earlier is not None
            else await Job.start(config.model, config.heldout_group_size, name=heldout_name, client=client)
        )
        loop = cls(client, config, train, heldout, job, heldout_job)
        loop.recorder = RunRecorder(runs_dir / job.id, config, job.id, bool(resume)) if runs_dir is not None else None
        loop.head = await client.get_head(config.model)
        loop.heads = [loop.head.checkpoint_id]
        loop.sample_candidates = (await client.get_serving_info(model=config.model)).candidate_engine_like_head
        return loop

    def launch(self, checkpoint_id: str = "") -> None:
        """Starts sampling one training batch (by the served head, or by ``checkpoint_id``)."""
        config, train = self.config, self.train
        tasks = train if not config.tasks_per_step else self.rng.sample(train, min(config.tasks_per_step, len(train)))
        run = run_tasks(
            tasks, self.agent, job=self.job, max_concurrent=config.max_concurrent, checkpoint_id=checkpoint_id
        )
        self.batches.append(asyncio.ensure_future(run))

    async def evaluate(self, checkpoint_id: str) -> tuple[float, list[Run]]:
        runs = await run_tasks(
            self.heldout,
            self.heldout_agent,
            job=self.heldout_job,
            max_concurrent=self.config.max_concurrent,
            checkpoint_id=checkpoint_id,
        )
        return mean_reward(runs), runs

    async def evaluate_start(self) -> Baseline:
        """The starting head's held-out score. The first batch samples meanwhile: both use the head's weights, so
        the batch is on-policy for the first step whatever max_off_policy says."""
        assert self.head is not None
        started = time.perf_counter()
        self.launch()
        self.head_score, runs = await self.evaluate(self.head.checkpoint_id)
        first = Baseline(self.head.checkpoint_id, self.head_score, time.perf_counter() - started)
        if self.recorder:
            self.recorder.baseline(first)
            self.recorder.samples(0, "heldout", runs)
        return first

    async def step(self, step_index: int) -> StepReport:
        """One step: the next batch, forward_backward + optim_step, the gate, the new head served."""
        assert self.head is not None
        client, config = self.client, self.config
        started = time.perf_counter()
        parent = self.head.checkpoint_id
        if not self.batches:  # on-policy: sampled now, by the weights just served
            self.launch()
        runs = await self.batches.popleft()
        rolled = time.perf_counter()
        for _ in range(min(config.max_off_policy, config.steps - step_index) - len(self.batches)):
            self.launch()  # the next batches sample while this one trains
        if not any(run.status == RunStatus.GRADED for run in runs):
            raise FailedPreconditionError(f"0 of {len(runs)} runs graded: {failures(runs)}", reason="NO_GRADED_RUNS")
        stale = [_staleness(run, self.heads) for run in runs]
        flat = report_groups_without_spread(runs)  # before training: these groups teach nothing
        fb = await client.forward_backward(  # the trainer reads the recorded runs by trace id
            runs=[r.trace_id or r for r in runs if r.status == RunStatus.GRADED],
            loss_fn=config.loss_fn,
            loss_fn_config=config.loss_fn_config,
            normalize_advantages_by_std=config.normalize_advantages_by_std,
            allow_incomplete_groups=True,
            model=config.model,
        )
        backward = time.perf_counter()
        adam = {"max_grad_norm": config.max_grad_norm} if config.max_grad_norm else {}
        optim = await client.optim_step(
            config.learning_rate,
            set_head=not self.heldout,
            model=config.model,
            metadata_json=json.dumps({"job_id": self.job.id}),
            **adam,
        )
        assert optim.checkpoint is not None
        candidate = optim.checkpoint.checkpoint_id
        optimized = time.perf_counter()
        ahead = self.sample_candidates and bool(self.heldout) and not self.batches and step_index < config.steps
        if ahead:
            # On-policy: the next batch samples the candidate while the gate evaluates it (one engine, loaded once,
            # runs both). Promoted, the candidate is the head the batch trains from; rejected, the batch is dropped
            # and the next step samples the head, as if it had waited.
            self.launch(candidate)
        gate = await self.gate(candidate, optimized)
        if ahead and not gate.promoted:
            await self.cancel_batches()
        if self.head.checkpoint_id != self.heads[-1]:
            self.heads.append(self.head.checkpoint_id)
        info = await client.get_serving_info(wait_for_checkpoint_id=self.head.checkpoint_id, model=config.model)
        reloaded = time.perf_counter()
        train_reward = mean_reward(runs)
        report = StepReport(
            step=optim.step,
            job_id=self.job.id,
            checkpoint_id=candidate,
            parent_checkpoint_id=parent,
            promoted=gate.promoted,
            reason=gate.reason,
            head_checkpoint_id=self.head.checkpoint_id,
            served_weight_version=info.weight_version,
            train_reward=train_reward,
            heldout_reward=gate.score,
            head_heldout_reward=self.head_score,
            num_runs=len(runs),
            groups_without_spread=len(flat),
            loss=fb.loss_sum,
            kl=fb.metrics.get("kl_sampler_learner", math.nan),
            clip_fraction=fb.metrics.get("clip_fraction", math.nan),
            entropy=fb.metrics.get("entropy", math.nan),
            sampled_weight_versions=sorted({t.weight_version for run in runs for t in run.turns}),
            rollout_s=rolled - started,
            forward_backward_s=backward - rolled,
            optim_s=optimized - backward,
            heldout_s=gate.evaluated - optimized,
            reload_s=reloaded - gate.evaluated,
            total_s=reloaded - started,
            warning=self.watch_divergence(train_reward, gate.score),
            off_policy_runs=off_policy(runs, parent),
            max_staleness=max(stale, default=0),
            completion_tokens=sum(len(t.completion_token_ids) for run in runs for t in run.turns),
            useful_tokens=int(fb.metrics.get("tokens_useful", 0)),
            computed_tokens=int(fb.metrics.get("tokens_computed", 0)),
        )
        if self.recorder:
            self.recorder.step(report)
            self.recorder.samples(report.step, "train", runs)
            self.recorder.samples(report.step, "heldout", gate.runs)
            await self.recorder.checkpoint_tree(client, config.model)
        return report

    async def gate(self, candidate: str, optimized: float) -> _Gate:
        """The promotion gate: the candidate's held-out score against the head's (minus the tolerance), recorded
        on the checkpoint, HEAD moved when it passes; with no held-out tasks the trainer promoted it already."""
        assert self.head is not None
        client, config = self.client, self.config
        if not self.heldout:
            self.head = await client.get_head(config.model)
            return _Gate(float("nan"), [], True, "no held-out tasks: promoted by the trainer", optimized)
        score, runs = await self.evaluate(candidate)
        evaluated = time.perf_counter()
        promoted = score >= self.head_score - config.promotion_tolerance
        comparison = ">=" if promoted else "<"
        reason = (
            f"held-out {score:.3f} {comparison} head {self.head_score:.3f} - tolerance {config.promotion_tolerance:g}"
        )
        await client.record_promotion(
            config.model,
            candidate,
            Promotion(
                state=PromotionState.PROMOTED if promoted else PromotionState.REJECTED,
                reason=reason,
                heldout_reward=score,
                baseline_checkpoint_id=self.head.checkpoint_id,
                baseline_reward=self.head_score,
                decided_time=time.time(),
            ),
        )
        if promoted:
            self.head = await client.set_head(config.model, candidate, expected_checkpoint_id=self.head.checkpoint_id)
            self.head_score = score
        return _Gate(score, runs, promoted, reason, evaluated)

    def watch_divergence(self, train_reward: float, heldout_reward: float) -> str:
        """A warning when the training reward rose while the held-out one fell twice in a row or more."""
        self.history.append((train_reward, heldout_reward))
        if len(self.history) < 2:
            return ""
        (prev_train, prev_heldout), (now_train, now_heldout) = self.history[-2], self.history[-1]
        self.diverging = self.diverging + 1 if now_train > prev_train and now_heldout < prev_heldout else 0
        if self.diverging < 2:
            return ""
        return (
            f"possible reward hacking: training reward rose while held-out fell {self.diverging} evals "
            f"in a row ({prev_train:.3f}->{now_train:.3f} vs {prev_heldout:.3f}->{now_heldout:.3f})"
        )

    async def cancel_batches(self) -> None:
        """Rollouts launched ahead for steps that will not run (or sampled by a candidate the gate rejected)."""
        for batch in self.batches:
            batch.cancel()
        await asyncio.gather(*self.batches, return_exceptions=True)
        self.batches.clear()


def _staleness(run: Run, heads: list[str]) -> int:
    """How many of the loop's heads the oldest weights that sampled ``run`` are behind the newest (0: on-policy;
    weights the loop never trained from count as older than all of them)."""
    behind = 0
    for turn in run.turns:
        version = turn.weight_version
        behind = max(behind, len(heads) - 1 - heads.index(version) if version in heads else len(heads))
    return behind
