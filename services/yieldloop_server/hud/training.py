"""HUD's training contract on the front (``HUD_RL_URL``): ``/v1/models/{id}/train/`` losses, forward-backward,
forward, backward and optim-step, on TrainerService."""

from __future__ import annotations

import collections
import dataclasses
import json
import uuid
from typing import Any

from yieldloop.client import Client
from yieldloop.errors import InvalidArgumentError, NotFoundError, invalid_field
from yieldloop.transport import TransportConfig
from yieldloop.types import Datum, Run, RunStatus, Turn
from yieldloop_server.common.auth import current_principal
from yieldloop_server.hud.common import Contract, finite_metrics, floats, ints, number, only_fields

FORWARDS = 256
"""Forward passes kept for their backward (the oldest are dropped beyond this)."""


@dataclasses.dataclass
class _Forward:
    """A forward pass kept for its backward: the datums scored, for which model and team, and their runs'
    rewards."""

    model: str
    team: str
    datums: list[Datum]
    rewards: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _StepStats:
    """What a model's gradients since its last optimizer step were computed from (recorded with the step)."""

    loss_fn: str = ""
    num_traces: int = 0
    num_datums: int = 0
    num_tokens: int = 0
    rewards: list[float] = dataclasses.field(default_factory=list)

    def metadata(self, learning_rate: float) -> dict[str, Any]:
        summary: dict[str, Any] = {
            "loss_fn": self.loss_fn,
            "num_traces": self.num_traces,
            "num_datums": self.num_datums,
            "num_tokens": self.num_tokens,
            "learning_rate": learning_rate,
        }
        if self.rewards:
            summary["mean_reward"] = sum(self.rewards) / len(self.rewards)
            summary["reward_min"], summary["reward_max"] = min(self.rewards), max(self.rewards)
        return summary


class Training(Contract):
    """The training routes; forward passes are kept for their backward (the last :data:`FORWARDS`), and each
    model's gradient statistics until its optimizer step records them."""

    def __init__(self, client: Client, transport: TransportConfig, auth: bool) -> None:
        super().__init__(client, transport, auth)
        self._forwards: collections.OrderedDict[str, _Forward] = collections.OrderedDict()
        self._stats: dict[str, _StepStats] = {}

    def routes(self, handler: Any) -> list[Any]:
        from aiohttp import web

        base = "/v1/models/{model}/train"
        return [
            web.get(f"{base}/losses", handler(self._losses)),
            web.post(f"{base}/forward-backward", handler(self._forward_backward)),
            web.post(f"{base}/forward", handler(self._forward)),
            web.post(f"{base}/backward", handler(self._backward)),
            web.post(f"{base}/optim-step", handler(self._optim_step)),
        ]

    async def _losses(self, request: Any, body: dict, client: Client) -> dict[str, Any]:
        await client.get_model(request.match_info["model"])  # NOT_FOUND for an unknown model
        return {"losses": [spec.name for spec in (await client.list_losses())]}

    async def _runs(self, inputs: Any, group_size: Any, reward_scale: Any, client: Client) -> tuple[list[Run], int]:
        """The request's inputs as runs, in order (trace ids read from the trace store with the caller's key),
        grouped in contiguous slices of ``group_size`` (all one group without it), rewards scaled."""
        if not isinstance(inputs, list) or not inputs:
            raise invalid_field("inputs", "inputs must be a non-empty list of trace ids and trajectories")
        if group_size is not None and (
            isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1
        ):
            raise invalid_field("group_size", "group_size must be an integer >= 1")
        scale = number(1.0 if reward_scale is None else reward_scale, "reward_scale")
        size = group_size or len(inputs)
        if len(inputs) % size:
            raise InvalidArgumentError(
                f"{len(inputs)} inputs do not divide into groups of {size}",
                reason="GROUP_INCOMPLETE",
                field="group_size",
            )
        ids = [item for item in inputs if isinstance(item, str)]
        recorded = {run.trace_id: run for run in await client.get_runs(ids)} if ids else {}
        runs = []
        for i, item in enumerate(inputs):
            field = f"inputs[{i}]"
            if isinstance(item, str):
                run = dataclasses.replace(recorded[item])
            elif isinstance(item, dict):
                run = _payload_run(item, field)
            else:
                raise invalid_field(field, "each input is a trace id or a trajectory object")
            run.group_id = f"group-{i // size}"
            run.reward = run.reward * scale
            runs.append(run)
        return runs, size

    async def _forward_backward(self, request: Any, body: dict, client: Client) -> dict[str, Any]:
        only_fields(
            body,
            {"inputs", "loss_fn", "loss_fn_config", "group_size", "reward_scale", "num_substeps"},
            "a forward-backward",
        )
        model = request.match_info["model"]
        runs, size = await self._runs(body.get("inputs"), body.get("group_size"), body.get("reward_scale"), client)
        loss_fn = body.get("loss_fn", "importance_sampling")
        if not isinstance(loss_fn, str):
            raise invalid_field("loss_fn", "loss_fn must be a loss name (GET .../train/losses)")
        config = body.get("loss_fn_config") or {}
        if not isinstance(config, dict):
            raise invalid_field("loss_fn_config", "loss_fn_config must be an object of numbers")
        config = {k: number(v, f"loss_fn_config.{k}") for k, v in config.items()}
        substeps = body.get("num_substeps", 1)
        if isinstance(substeps, bool) or not isinstance(substeps, int) or substeps < 1:
            raise invalid_field("num_substeps", "num_substeps must be an integer >= 1")
        # As HUD documents it: the batch split for gradient accumulation (the same gradient, in passes that need less
        # memory). The split is at group boundaries, so advantages are normalised over whole groups: more substeps
        # than groups are as many passes as groups.
        groups = [runs[i : i + size] for i in range(0, len(runs), size)]
        substeps = min(substeps, len(groups))
        totals: collections.Counter[str] = collections.Counter()
        num_datums = 0
        for part in range(substeps):
            batch = [run for group in groups[part::substeps] for run in group]
            response = await client.forward_backward(
                runs=batch, loss_fn=loss_fn, loss_fn_config=config, group_size=size, model=model
            )
            num_datums += response.num_datums
            totals.update(
                {
                    "loss": response.loss_sum,
                    "num_action_tokens": response.num_action_tokens,
                    "num_groups": response.num_groups,
                    "num_groups_without_signal": response.num_groups_without_signal,
                }
            )
            for key, value in response.metrics.items():  # means over the batch: weighted by datums
                totals[key] += value * response.num_datums
        metrics = {k: v for k, v in totals.items()}
        for key in set(metrics) - {"loss", "num_action_tokens", "num_groups", "num_groups_without_signal"}:
            metrics[key] /= max(num_datums, 1)
        stats = self._stats.setdefault(model, _StepStats())
        stats.loss_fn = loss_fn
        stats.num_traces += len(runs)
        stats.num_datums += num_datums
        stats.num_tokens += int(totals["num_action_tokens"])
        stats.rewards += [run.reward for run in runs]
        return {"metrics": finite_metrics(metrics), "num_datums": num_datums}

    async def _forward(self, request: Any, body: dict, client: Client) -> dict[str, Any]:
        only_fields(body, {"inputs", "group_size", "reward_scale"}, "a forward")
        model = request.match_info["model"]
        runs, size = await self._runs(body.get("inputs"), body.get("group_size"), body.get("reward_scale"), client)
        scored = await client.forward_scored(runs=runs, model=model)
        forward_id = uuid.uuid4().hex
        self._forwards[forward_id] = _Forward(
            model, self.team(), [datum for datum, _ in scored], [run.reward for run in runs]
        )
        while len(self._forwards) > FORWARDS:
            self._forwards.popitem(last=False)
        grouped = body.get("group_size") is not None
        data = [
            {
                "reward": run.reward,
                "traj_idx": i,
                "group_idx": i // size if grouped else None,
                "logprobs": logprobs,
                "sampling_logprobs": list(datum.sampling_logprobs),
                "mask": list(datum.weights),
            }
            for i, (run, (datum, logprobs)) in enumerate(zip(runs, scored, strict=True))
        ]
        return {"forward_id": forward_id, "data": data}

    async def _backward(self, request: Any, body: dict, client: Client) -> dict[str, Any]:
        only_fields(body, {"forward_id", "weights", "metrics"}, "a backward")
        model = request.match_info["model"]
        forward_id = body.get("forward_id")
        if not isinstance(forward_id, str):
            raise invalid_field("forward_id", "forward_id must be the id a forward pass answered")
        forward = self._forwards.get(forward_id)
        if (
            forward is None
            or forward.model != model
            or (self.auth and forward.team != self.team() and not current_principal().is_admin)
        ):
            raise NotFoundError(
                "no forward pass with this forward_id for this model (each is used once, and the "
                f"last {FORWARDS} are kept)",
                reason="FORWARD_NOT_FOUND",
                field="forward_id",
            )
        weights = body.get("weights")
        if not isinstance(weights, list) or len(weights) != len(forward.datums):
            raise invalid_field(
                "weights", f"weights must have one list per datum of the forward pass ({len(forward.datums)})"
            )
        datums = []
        for d, (datum, row) in enumerate(zip(forward.datums, weights, strict=True)):
            row = floats(row, f"weights[{d}]")
            if len(row) != len(datum.target_tokens):
                raise invalid_field(
                    f"weights[{d}]", f"weights[{d}] has {len(row)} values for {len(datum.target_tokens)} tokens"
                )
            datums.append(dataclasses.replace(datum, weights=row))
        metrics = body.get("metrics") or {}
        if not isinstance(metrics, dict):
            raise invalid_field("metrics", "metrics must be an object of numbers")
        response = await client.backward(datums, model=model)
        del self._forwards[forward_id]
        stats = self._stats.setdefault(model, _StepStats())  # a custom loss's step records what it trained on too
        stats.loss_fn = "custom"
        stats.num_traces += len(forward.rewards)
        stats.num_datums += response.num_datums
        stats.num_tokens += response.num_tokens
        stats.rewards += forward.rewards
        return {
            "metrics": finite_metrics({**metrics, "num_tokens": response.num_tokens}),
            "num_datums": response.num_datums,
        }

    async def _optim_step(self, request: Any, body: dict, client: Client) -> dict[str, Any]:
        only_fields(body, {"learning_rate", "beta1", "beta2", "eps", "weight_decay"}, "an optimizer step")
        model = request.match_info["model"]
        adam = {
            "beta1": number(body.get("beta1", 0.9), "beta1", above=0.0),
            "beta2": number(body.get("beta2", 0.95), "beta2", above=0.0),
            "eps": number(body.get("eps", 1e-8), "eps", above=0.0),
            "weight_decay": number(body.get("weight_decay", 0.0), "weight_decay", minimum=0.0),
        }
        learning_rate = number(body.get("learning_rate"), "learning_rate", above=0.0)
        stats = self._stats.get(model, _StepStats())
        response = await client.optim_step(
            learning_rate,
            model=model,
            set_head=True,
            metadata_json=json.dumps({"hud": stats.metadata(learning_rate)}),
            **adam,
        )
        self._stats.pop(model, None)
        checkpoint_id = response.checkpoint.checkpoint_id
        # The SDK samples the model right after: answer once the rollout service serves the new weights.
        await client.get_serving_info(wait_for_checkpoint_id=checkpoint_id, model=model)
        path = f"yieldloop://models/{model}/checkpoints/{checkpoint_id}"
        return {
            "step": int(response.step),
            "checkpoint_id": checkpoint_id,
            "sampler_path": f"{path}/sampler",
            "state_path": f"{path}/state" if response.has_state else "",
            "model": model,
        }


def _payload_run(item: dict[str, Any], field: str) -> Run:
    """An inline trajectory (the SDK's ``TrajectoryPayload``) as a run: one turn per sample."""
    only_fields(item, {"samples", "reward", "trace_id"}, field)
    samples = item.get("samples")
    if not isinstance(samples, list) or not samples:
        raise invalid_field(f"{field}.samples", "a trajectory needs at least one sample")
    turns = []
    for s, sample in enumerate(samples):
        where = f"{field}.samples[{s}]"
        if not isinstance(sample, dict):
            raise invalid_field(where, "a sample is an object")
        only_fields(sample, {"prompt_token_ids", "prompt_chunks", "output_token_ids", "output_logprobs"}, where)
        if sample.get("prompt_token_ids") is None:
            raise invalid_field(
                f"{where}.prompt_token_ids",
                "these models take text prompts: prompt_token_ids is required (prompt_chunks carry images)",
            )
        tokens = ints(sample.get("output_token_ids"), f"{where}.output_token_ids")
        logprobs = floats(sample.get("output_logprobs") or [0.0] * len(tokens), f"{where}.output_logprobs")
        if len(logprobs) != len(tokens):
            raise invalid_field(f"{where}.output_logprobs", f"{len(logprobs)} logprobs for {len(tokens)} tokens")
        turns.append(
            Turn(
                prompt_token_ids=ints(sample["prompt_token_ids"], f"{where}.prompt_token_ids"),
                completion_token_ids=tokens,
                completion_logprobs=logprobs,
            )
        )
    trace_id = item.get("trace_id") if isinstance(item.get("trace_id"), str) else ""
    return Run(
        turns=turns, reward=number(item.get("reward"), f"{field}.reward"), trace_id=trace_id, status=RunStatus.GRADED
    )
