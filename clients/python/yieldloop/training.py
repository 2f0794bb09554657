"""The Python API users drive the loop with: ``Job``, ``Agent``, ``taskset.run`` and ``TrainingClient``.

::

    import asyncio
    from yieldloop import Job, TrainingClient, create_agent
    from yieldloop.envs.letters import train_tasks
    from yieldloop.taskset import Taskset

    async def main():
        agent = create_agent("tiny", max_tokens=12)
        trainer = TrainingClient("tiny")
        session = await Job.start("tiny", group=8)       # 8 rollouts per task (a GRPO group)
        taskset = Taskset(train_tasks())
        for _ in range(10):
            batch = await taskset.run(agent, job=session)
            result = await trainer.step(batch, learning_rate=3e-3, group_size=8)
            print(result.step, result.checkpoint_id, result.mean_reward)

    asyncio.run(main())

Everything goes over gRPC to a running stack: ``connect()`` finds it from
``YIELDLOOP_DATA_DIR`` (the data directory of ``yieldloop up``, default
``.yieldloop``) or from ``YIELDLOOP_<SERVICE>_ADDRESS`` variables.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from yieldloop.client import SERVICES, Client, sampling_params
from yieldloop.errors import NotFoundError, invalid_field
from yieldloop.groups import check_group_sizes, groups_without_spread
from yieldloop.transport import TransportConfig
from yieldloop.types import (
    CheckpointSummary,
    Datum,
    ForwardBackwardResult,
    Head,
    JobInfo,
    Run,
    RunStatus,
    SamplingParams,
)

log = logging.getLogger("yieldloop")


def data_dir_of(data_dir: str | pathlib.Path | None = None) -> pathlib.Path:
    """The stack's data directory: ``data_dir`` when given, else ``$YIELDLOOP_DATA_DIR``, else ``.yieldloop``."""
    return pathlib.Path(data_dir or os.environ.get("YIELDLOOP_DATA_DIR", ".yieldloop"))


def stack_addresses(data_dir: str | pathlib.Path | None = None) -> dict[str, str]:
    """Service addresses of a running stack: ``YIELDLOOP_<SERVICE>_ADDRESS`` variables, else the ready files
    ``yieldloop up`` writes under ``<data_dir>/run/`` (``data_dir``: ``YIELDLOOP_DATA_DIR`` or ``.yieldloop``).

    Raises:
        FailedPreconditionError: STACK_NOT_RUNNING when neither names every service.
    """
    from_env = {s: os.environ.get(f"YIELDLOOP_{s.upper()}_ADDRESS", "") for s in SERVICES}
    if all(from_env.values()):
        return from_env
    from yieldloop.stackdir import card

    return card(data_dir_of(data_dir))["addresses"]


def stack_api_key(data_dir: str | pathlib.Path | None = None) -> str:
    """The API key to call a stack with: ``$YIELDLOOP_API_KEY``, else the admin key ``yieldloop up`` keeps in
    ``<data_dir>/api_key`` (like a notebook's token), else "" (a stack started with ``--no-auth``)."""
    key = os.environ.get("YIELDLOOP_API_KEY", "").strip()
    if key:
        return key
    try:
        return (data_dir_of(data_dir) / API_KEY_FILE).read_text().strip()
    except OSError:
        return ""


API_KEY_FILE = "api_key"
"""The admin key of a stack, in its data directory (file mode 0600)."""


def stack_tls_ca(data_dir: str | pathlib.Path | None = None) -> str:
    """The CA file to trust a stack's TLS by: ``$YIELDLOOP_TLS_CA``, else ``<data_dir>/tls/ca.pem`` when the
    stack's ready files say it speaks TLS (``yieldloop up --tls``), else "" (plaintext)."""
    ca = os.environ.get("YIELDLOOP_TLS_CA", "")
    if ca:
        return ca
    folder = data_dir_of(data_dir)
    try:
        tls = json.loads((folder / "run" / "checkpoint.json").read_text()).get("tls", False)
    except (OSError, ValueError):
        tls = False
    return str(folder / "tls" / "ca.pem") if tls else ""


def connect(data_dir: str | pathlib.Path | None = None, timeout: float | None = 300.0) -> Client:
    """A :class:`Client` for the running stack (see :func:`stack_addresses`), with its key (:func:`stack_api_key`)
    and, when it speaks TLS, its CA (:func:`stack_tls_ca`)."""
    transport = TransportConfig(tls_ca=stack_tls_ca(data_dir))
    return Client(**stack_addresses(data_dir), timeout=timeout, api_key=stack_api_key(data_dir), transport=transport)


@dataclasses.dataclass
class Agent:
    """How episodes are played: the served model, its sampling and the agent loop's bounds.

    The agent loop runs inside RolloutService (tools rendered into the chat template, tool calls parsed,
    results fed back), so an Agent is configuration, not code.
    """

    model: str = ""
    """Model slug (empty: whatever the rollout service serves; otherwise it must match)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    """Tokens per model turn."""
    seed: int = 0
    """Sampling seed (0: unseeded). A seeded agent repeats its runs exactly on the same weights: every episode
    and turn samples with a seed derived from this one (so a group's members still differ)."""
    max_steps: int = 0
    """Model turns per episode (0: 8)."""
    episode_timeout_s: float = 0.0
    max_attempts: int = 0

    def sampling(self) -> SamplingParams:
        return sampling_params(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=self.max_tokens,
            seed=self.seed,
        )


def create_agent(model: str = "", **options: Any) -> Agent:
    """An :class:`Agent` for ``model`` (options: temperature, top_p, top_k, max_tokens, max_steps, ...)."""
    return Agent(model=model, **options)


class Job:
    """A named set of runs in the trace store: an eval, or the rollouts of a training session.

    ``job.runs`` holds every run this object collected (``taskset.run`` appends to it); each Run carries
    the prompt, the turns with token ids and sampling logprobs, the reward, its trace id and group id.
    """

    def __init__(self, client: Client, record: JobInfo) -> None:
        self.client = client
        self.record = record
        self.runs: list[Run] = []

    @property
    def id(self) -> str:
        return self.record.job_id

    @property
    def model(self) -> str:
        return self.record.model

    @property
    def group(self) -> int:
        return self.record.group_size

    @classmethod
    async def start(
        cls,
        model: str = "",
        group: int = 8,
        *,
        name: str = "",
        metadata: dict[str, Any] | None = None,
        client: Client | None = None,
    ) -> Job:
        """Opens a job sampling ``model`` with ``group`` rollouts per task."""
        if group < 1:
            raise invalid_field("group", f"group must be >= 1, got {group}")
        client = client or connect()
        record = await client.create_job(model, name, group, json.dumps(metadata) if metadata else "")
        return cls(client, record)

    @classmethod
    async def load(cls, job_id: str, *, client: Client | None = None) -> Job:
        """A recorded job with all its runs read back from the trace store."""
        client = client or connect()
        jobs = {job.job_id: job for job in await client.list_jobs()}
        if job_id not in jobs:
            raise NotFoundError(f"no job {job_id!r}", reason="JOB_NOT_FOUND")
        job = cls(client, jobs[job_id])
        job.runs = [run async for run in client.job_runs(job_id)]
        return job

    def mean_reward(self, runs: Sequence[Run] | None = None) -> float:
        return mean_reward(self.runs if runs is None else runs)


async def run_tasks(
    tasks: Iterable[Any],
    agent: Agent,
    *,
    job: Job,
    max_concurrent: int = 0,
    checkpoint_id: str = "",
    on_run: Callable[[Run], None] | None = None,
) -> list[Run]:
    """Plays every task ``job.group`` times with ``agent``; the runs are recorded in the job and returned."""
    if agent.model and job.model and agent.model != job.model:
        raise invalid_field("agent.model", f"the agent samples {agent.model!r} but the job is for {job.model!r}")
    runs = []
    async for run in job.client.stream_rollouts(
        list(tasks),
        group_size=job.group or 1,
        max_concurrent=max_concurrent,
        sampling=agent.sampling(),
        job_id=job.id,
        max_steps=agent.max_steps,
        episode_timeout_s=agent.episode_timeout_s,
        max_attempts=agent.max_attempts,
        checkpoint_id=checkpoint_id,
        model=agent.model or job.model,
    ):
        runs.append(run)
        if on_run is not None:
            on_run(run)
    job.runs.extend(runs)
    return runs


def graded(runs: Iterable[Run]) -> list[Run]:
    return [run for run in runs if run.status == RunStatus.GRADED]


def failure_reason(run: Run) -> str:
    """Why a run was not graded, as one word: its error's reason (ENVIRONMENT_ERROR, EPISODE_DEADLINE, ...), else
    its status ("" for a graded run)."""
    if run.status == RunStatus.GRADED:
        return ""
    code_reason, _, _ = run.error.partition(": ")
    _, slash, reason = code_reason.partition("/")
    return reason if slash and reason.isupper() else run.status.name


def failure_message(run: Run) -> str:
    """A run's error without its code and reason (they are :func:`failure_reason`)."""
    code_reason, colon, message = run.error.partition(": ")
    return message if colon and "/" in code_reason and code_reason.isupper() else run.error


def failures(runs: Iterable[Run]) -> str:
    """The runs that were not graded, for one line: "3 ENVIRONMENT_ERROR, 1 EPISODE_DEADLINE; first: <error>" ("" when
    every run was graded)."""
    failed = [run for run in runs if run.status != RunStatus.GRADED]
    if not failed:
        return ""
    counts: dict[str, int] = {}
    for run in failed:
        counts[failure_reason(run)] = counts.get(failure_reason(run), 0) + 1
    by_reason = ", ".join(f"{n} {reason}" for reason, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    return f"{by_reason}; first: {failure_message(failed[0]) or '(no message)'}"


def mean_reward(runs: Iterable[Run]) -> float:
    rewards = [run.reward for run in graded(runs)]
    return statistics.fmean(rewards) if rewards else float("nan")


def report_groups_without_spread(runs: Sequence[Run | str]) -> dict[str, float]:
    """Logs a warning naming the groups without reward spread (before they are sent to train; logger
    ``yieldloop.groups``, which the command line, showing their count instead, turns down) and returns them."""
    flat = groups_without_spread(runs)
    if flat:
        tasks = {run.group_id: f"{run.task.scenario}({run.task.args_json})" for run in runs if not isinstance(run, str)}
        shown = ", ".join(f"{tasks[g]} all {r:.2f}" for g, r in list(flat.items())[:4])
        more = f" and {len(flat) - 4} more" if len(flat) > 4 else ""
        logging.getLogger("yieldloop.groups").warning(
            "%d group(s) without reward spread teach nothing: %s%s", len(flat), shown, more
        )
    return flat


async def forward_backward_custom(
    client: Client,
    runs: Iterable[Run] = (),
    loss_fn: Callable[..., Any] | None = None,
    *,
    datums: Iterable[Datum] = (),
    model: str = "",
) -> tuple[float, dict[str, float]]:
    """Trains on any loss that depends on the weights only through the logprobs.

    ``loss_fn(datums, logprobs)`` gets the scored datums (runs carry their group-centred advantages) and one
    float64 tensor of learner logprobs per datum, and returns a scalar tensor, or ``(tensor, metrics)``.
    It is differentiated here with autograd (torch, imported only by this function) and
    ``weights = -d loss / d logprob`` go to Backward, so the gradient applied equals the custom loss's.
    Returns the loss value and the metrics.
    """
    import torch  # only custom losses need it, on the client

    if loss_fn is None:
        raise invalid_field("loss_fn", "forward_backward_custom needs a loss_fn(datums, logprobs)")
    scored = await client.forward_scored(runs=runs, datums=datums, model=model)
    logprobs = [torch.tensor(lps, dtype=torch.float64, requires_grad=True) for _, lps in scored]
    result = loss_fn([datum for datum, _ in scored], logprobs)
    loss, metrics = result if isinstance(result, tuple) else (result, {})
    loss.backward()
    await client.backward(
        [
            Datum(
                datum.input_tokens,
                datum.target_tokens,
                weights=(-lp.grad if lp.grad is not None else torch.zeros_like(lp)).tolist(),
            )
            for (datum, _), lp in zip(scored, logprobs, strict=True)
        ],
        model=model,
    )
    return float(loss.detach()), dict(metrics)


@dataclasses.dataclass
class StepResult:
    """What ``TrainingClient.step`` did."""

    step: int
    checkpoint_id: str
    """The checkpoint the optimizer step committed (HEAD when set_head)."""
    loss: float
    mean_reward: float
    groups_without_spread: int
    metrics: dict[str, float]
    """The trainer's metrics of the (last) forward_backward: KL, clip fraction, entropy, ..."""
    grad_norm: float
    parent_checkpoint_id: str = ""
    """The checkpoint the step's weights came from: runs sampled by it were on-policy."""
    off_policy_runs: int = 0
    """Runs (of those passed as Run objects) with a turn sampled by other weights than ``parent_checkpoint_id``:
    stale samples, whose importance ratios correct for the true sampler (each turn records its weights)."""
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    """Where the step's time went, in seconds: ``forward_backward_s`` and ``optim_step_s`` (the calls, as the
    client saw them), the trainer's ``optimizer_s``, ``save_s``, ``commit_s`` (the commit that moved HEAD) and
    ``upload_s`` (the objects written to the store while the fleet reloads), and ``weights_served_s`` (from the
    step's answer until the rollout service serves the new weights; absent when not waited for)."""

    durable: bool = False
    """The checkpoint was in the object store when the step answered (always, for a committed step: a trainer
    answers once it is durable, so an acknowledged step is never rolled back)."""
    has_state: bool = False
    """The checkpoint holds the full training state (the trainer saves it every few steps, see --state-every)."""

    @property
    def sampler_path(self) -> str:
        """The checkpoint whose weights sample (every step's)."""
        return self.checkpoint_id

    @property
    def state_path(self) -> str:
        """The checkpoint to resume training from exactly ("" when this step saved no training state)."""
        return self.checkpoint_id if self.has_state else ""


def off_policy(runs: Sequence[Run | str], checkpoint_id: str) -> int:
    """How many of the runs were (partly) sampled by other weights than ``checkpoint_id``."""
    return sum(
        1
        for run in runs
        if not isinstance(run, str) and any(turn.weight_version != checkpoint_id for turn in run.turns)
    )


class TrainingClient:
    """Advances the weights behind one model slug through TrainerService and CheckpointService.

    Runs (Run messages) and trace ids (strings, resolved from the trace store) are accepted interchangeably.
    """

    def __init__(self, model: str, *, client: Client | None = None) -> None:
        self.model = model
        self.client = client or connect()
        self._checked = False

    async def _check_model(self) -> None:
        """Loads the slug's training session (NOT_FOUND/MODEL_NOT_FOUND when the slug does not exist)."""
        if not self._checked:
            await self.client.get_trainer_info(model=self.model)
            self._checked = True

    async def available_losses(self) -> list[str]:
        return [loss.name for loss in (await self.client.list_losses())]

    async def forward_backward(
        self,
        runs: Sequence[Run | str],
        loss_fn: str = "importance_sampling",
        *,
        group_size: int = 0,
        loss_fn_config: dict[str, float] | None = None,
        **options: Any,
    ) -> ForwardBackwardResult:
        """Accumulates the gradient of a built-in loss on the runs (GRPO advantages per group)."""
        await self._check_model()
        report_groups_without_spread(runs)
        return await self.client.forward_backward(
            runs=runs,
            loss_fn=loss_fn,
            loss_fn_config=loss_fn_config,
            group_size=group_size,
            model=self.model,
            **options,
        )

    async def forward_backward_custom(
        self, runs: Sequence[Run | str], loss_fn: Callable[..., Any], *, group_size: int = 0
    ) -> tuple[float, dict[str, float]]:
        """Accumulates the gradient of ``loss_fn(datums, logprobs)`` (see :func:`forward_backward_custom`)."""
        await self._check_model()
        ids = [run for run in runs if isinstance(run, str)]
        by_id = dict(zip(ids, await self.client.get_runs(ids), strict=True)) if ids else {}
        resolved = [by_id[run] if isinstance(run, str) else run for run in runs]
        report_groups_without_spread(resolved)
        check_group_sizes(resolved, group_size)
        return await forward_backward_custom(self.client, resolved, loss_fn, model=self.model)

    async def _served(self, checkpoint_id: str, timings: dict[str, float]) -> None:
        """Returns once the rollout service serves ``checkpoint_id`` (when this client knows one)."""
        if self.client.has("rollout"):
            started = time.perf_counter()
            await self.client.get_serving_info(wait_for_checkpoint_id=checkpoint_id, model=self.model)
            timings["weights_served_s"] = time.perf_counter() - started

    async def optim_step(
        self, learning_rate: float, *, set_head: bool = True, wait_for_serving: bool = True, **adam: float
    ) -> StepResult:
        """AdamW step and checkpoint commit (HEAD moves when ``set_head``; then, with ``wait_for_serving``, this
        returns once the rollout service samples the new weights)."""
        await self._check_model()
        started = time.perf_counter()
        step = await self.client.optim_step(learning_rate, set_head=set_head, model=self.model, **adam)
        timings = {"optim_step_s": time.perf_counter() - started, **step.timings}
        if set_head and wait_for_serving:
            await self._served(step.checkpoint.checkpoint_id, timings)
        return StepResult(
            step.step,
            step.checkpoint.checkpoint_id,
            float("nan"),
            float("nan"),
            0,
            {},
            step.grad_norm,
            step.parent_checkpoint_id,
            0,
            timings,
            step.durable,
            step.has_state,
        )

    async def step(
        self,
        runs: Sequence[Run | str],
        *,
        learning_rate: float,
        group_size: int = 0,
        loss_fn: str = "importance_sampling",
        num_substeps: int = 1,
        set_head: bool = True,
        loss_fn_config: dict[str, float] | None = None,
        wait_for_serving: bool = True,
        **options: Any,
    ) -> StepResult:
        """forward_backward with a built-in loss, then optim_step: one node in the checkpoint tree.

        With ``set_head`` and ``wait_for_serving`` (the default) it returns only once the rollout service
        samples the new weights, so the next batch is on-policy; without, the next batch may be sampled by older
        weights, and the next step's ``off_policy_runs`` says how many were.
        """
        await self._check_model()
        flat = report_groups_without_spread(runs)
        timings: dict[str, float] = {}
        step, metrics = await self.client.train_step(
            runs,
            learning_rate,
            loss_fn=loss_fn,
            num_substeps=num_substeps,
            set_head=set_head,
            group_size=group_size,
            loss_fn_config=loss_fn_config,
            model=self.model,
            timings=timings,
            **options,
        )
        timings.update(step.timings)
        if set_head and wait_for_serving:
            await self._served(step.checkpoint.checkpoint_id, timings)
        last = metrics[-1]
        return StepResult(
            step=step.step,
            checkpoint_id=step.checkpoint.checkpoint_id,
            loss=sum(m.loss_sum for m in metrics),
            mean_reward=mean_reward(r for r in runs if not isinstance(r, str)),
            groups_without_spread=len(flat),
            metrics=dict(last.metrics),
            grad_norm=step.grad_norm,
            parent_checkpoint_id=step.parent_checkpoint_id,
            off_policy_runs=off_policy(runs, step.parent_checkpoint_id),
            timings=timings,
            durable=step.durable,
            has_state=step.has_state,
        )

    async def checkpoints(self) -> list[CheckpointSummary]:
        """The model's checkpoint tree, oldest first (head marked, promotion decisions attached)."""
        return await self.client.list_checkpoints(self.model)

    async def head(self) -> Head:
        return await self.client.get_head(self.model)

    async def set_head(self, checkpoint_id: str, *, expected: str = "") -> Head:
        """Moves HEAD (rollback or branch point); the rollout fleet reloads it, the next step extends from it."""
        return await self.client.set_head(self.model, checkpoint_id, expected_checkpoint_id=expected)
