"""The HUD front: the HTTP contracts of HUD's cloud, served by a stack, so scripts written with the unmodified
HUD SDK (``pip install hud``) train on yieldloop by setting environment variables.

The SDK reaches its cloud through base URLs; this one server answers all of them (``yieldloop up`` writes the
values to ``DATA_DIR/run/hud.env``):

- ``HUD_API_URL``: the model catalog (``GET /v2/models``, ``/v2/models/resolve``), a model's checkpoint tree
  (``GET /v2/models/{id}/checkpoints``), its head (``PUT /v2/models/{id}/head``), forks
  (``POST /v2/models/fork``), and the SDK's job and trace reports (``POST /v2/trace/job/{id}/enter``,
  ``/v2/trace/{id}/enter``, ``/v2/trace/{id}/exit``), which record the runs in the stack's trace store;
- ``HUD_RL_URL``: training, ``/v1/models/{id}/train/`` ``losses``, ``forward-backward``, ``forward``,
  ``backward``, ``optim-step``, on TrainerService;
- ``HUD_GATEWAY_URL`` (``.../v1``): ``/v1/chat/completions`` and ``/v1/models``, forwarded to RolloutService's
  OpenAI-compatible endpoint; an answer to a request carrying ``Trace-Id`` is kept as that trace's next sample
  (prompt ids, sampled ids, logprobs, weight version) until the trace exits and is recorded as a run;
- ``HUD_TELEMETRY_URL`` (``.../v3/api``): the SDK's span uploads, kept in the store beside the runs.

A model's id in these contracts is its slug. Every request needs a yieldloop API key (``Authorization: Bearer``,
the SDK's ``HUD_API_KEY``), checked here by the same interceptor as every service, then forwarded with each call
this front makes, so the services apply the key's role and its team's ownership exactly as to any client.
Replies have exactly the fields the SDK's models declare (it validates them strictly); errors are typed
(:mod:`yieldloop_server.common.http`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import datetime
import json
import logging
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

from yieldloop.client import Client
from yieldloop.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
    YieldloopError,
    as_yieldloop_error,
    check_text,
    invalid_field,
)
from yieldloop.transport import DEFAULT_TRANSPORT, TransportConfig
from yieldloop.types import Datum, JobInfo, ModelInfo, Run, RunStatus, TaskRef, Turn
from yieldloop_server.common.auth import current_principal, presented_key, require_run
from yieldloop_server.common.http import (
    BodyTimeout,
    HttpServer,
    error_response,
    json_object,
    read_json,
    timeout_response,
)
from yieldloop_server.store import ObjectStore
from yieldloop_server.store.traces import named_trace

log = logging.getLogger(__name__)

PENDING_TRACES = 10_000
"""Traces whose samples are kept until they exit (the oldest are dropped beyond this, with a warning)."""
PENDING_TTL_S = 6 * 3600.0
FORWARDS = 256
"""Forward passes kept for their backward (the oldest are dropped beyond this)."""
AGENT_TYPE = "openai_compatible"
"""The SDK agent that samples yieldloop models (through the gateway's chat completions)."""


def _iso(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat()


def _number(value: Any, field: str, *, minimum: float | None = None, above: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid_field(field, f"{field} must be a finite number")
    if minimum is not None and value < minimum or above is not None and value <= above:
        bound = f">= {minimum:g}" if minimum is not None else f"> {above:g}"
        raise invalid_field(field, f"{field} must be {bound}")
    return float(value)


def _fields(body: dict[str, Any], allowed: set[str], what: str) -> None:
    """The SDK's request models forbid unknown fields; so does this front (a misspelled knob is not ignored)."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise invalid_field(unknown[0], f"{what} has no field {unknown[0]!r} (fields: {', '.join(sorted(allowed))})")


def _ints(value: Any, field: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise invalid_field(field, f"{field} must be a list of token ids")
    return value


def _floats(value: Any, field: str) -> list[float]:
    if not isinstance(value, list) or not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in value
    ):
        raise invalid_field(field, f"{field} must be a list of finite numbers")
    return [float(x) for x in value]


def _finite_metrics(values: dict[str, float]) -> dict[str, float]:
    """Metrics as the SDK reads them: every value a finite float (its models have no nulls)."""
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)}


_UNKNOWN = object()
"""A trace id's owner not looked up yet."""


@dataclasses.dataclass
class _Trace:
    """A trace the SDK opened: who, under which job and group, and the samples the gateway saw for it."""

    team: str
    job_id: str = ""
    group_id: str = ""
    task_slug: str = ""
    model: str = ""
    samples: list[Turn] = dataclasses.field(default_factory=list)
    opened: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass
class _Forward:
    """A forward pass kept for its backward: the datums scored, for which model and team."""

    model: str
    team: str
    datums: list[Datum]


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


class HudFront(HttpServer):
    """The HUD SDK's base URLs on one port; see the module's docstring.

    Args:
        client: Calls CheckpointService, TrainerService and RolloutService (with the service key; each request
            forwards its caller's key instead).
        store: The stack's object store (runs and jobs are recorded in its trace store).
    """

    def __init__(
        self,
        client: Client,
        store: ObjectStore,
        host: str = "127.0.0.1",
        port: int = 0,
        transport: TransportConfig = DEFAULT_TRANSPORT,
        auth: bool = True,
    ) -> None:
        super().__init__(host, port, transport)
        self.client = client
        self.store = store
        self.auth = auth
        self.gateway_url = ""
        """RolloutService's OpenAI-compatible base URL (found at start)."""
        self._pending: collections.OrderedDict[str, _Trace] = collections.OrderedDict()
        self._forwards: collections.OrderedDict[str, _Forward] = collections.OrderedDict()
        self._stats: dict[str, _StepStats] = {}
        self._exited: collections.OrderedDict[str, tuple[str, int]] = collections.OrderedDict()
        """Traces recorded lately (their team and sample count): a repeated exit report is answered, not recorded
        twice (older ones are found in the trace store)."""
        self._session: Any = None

    async def start(self) -> str:
        import aiohttp

        info = await self.client.get_serving_info()
        self.gateway_url = info.openai_base_url
        ssl: Any = None
        if self.gateway_url.startswith("https") and self.transport.tls_ca:
            import ssl as ssl_module

            ssl = ssl_module.create_default_context(cafile=self.transport.tls_ca)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=ssl, limit=0), timeout=aiohttp.ClientTimeout(total=None, sock_connect=30)
        )
        return await super().start()

    async def stop(self) -> None:
        await super().stop()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def routes(self) -> list[Any]:
        from aiohttp import web

        h = self._handler
        return [
            web.get("/v2/models", h(self._list_models)),
            web.get("/v2/models/resolve", h(self._resolve_model)),
            web.post("/v2/models/fork", h(self._fork)),
            web.get("/v2/models/{model}", h(self._get_model)),
            web.get("/v2/models/{model}/checkpoints", h(self._checkpoints)),
            web.put("/v2/models/{model}/head", h(self._set_head)),
            web.get("/v1/models/{model}/train/losses", h(self._losses)),
            web.post("/v1/models/{model}/train/forward-backward", h(self._forward_backward)),
            web.post("/v1/models/{model}/train/forward", h(self._forward)),
            web.post("/v1/models/{model}/train/backward", h(self._backward)),
            web.post("/v1/models/{model}/train/optim-step", h(self._optim_step)),
            web.post("/v2/trace/job/{job_id}/enter", h(self._job_enter)),
            web.post("/v2/trace/{trace_id}/enter", h(self._trace_enter)),
            web.post("/v2/trace/{trace_id}/exit", h(self._trace_exit)),
            web.post("/v3/api/trace/{trace_id}/telemetry-upload", h(self._telemetry)),
            web.post("/v1/chat/completions", self._chat),
            web.get("/v1/models", self._gateway_models),
        ]

    # Plumbing -------------------------------------------------------------------------------------------

    def _handler(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A route: its JSON body read (POST/PUT), the caller's client built, the reply as JSON, errors typed."""
        from aiohttp import web

        async def handle(request: Any) -> Any:
            try:
                body = (
                    json_object(await read_json(request, self.transport.http_body_timeout_s))
                    if request.method in ("POST", "PUT") and request.can_read_body
                    else {}
                )
                reply = await fn(request, body, self._caller(request))
            except BodyTimeout as err:
                return timeout_response(err)
            except Exception as err:  # the request's boundary: a typed answer, the front keeps serving
                if not isinstance(err, YieldloopError):
                    log.exception("unexpected error in %s %s", request.method, request.path)
                return error_response(as_yieldloop_error(err))
            return web.json_response(reply)

        return handle

    def _caller(self, request: Any) -> Client:
        """The client acting for this request: the caller's own key on every call."""
        return self.client.with_api_key(presented_key_of(request)) if self.auth else self.client

    def _team(self) -> str:
        return current_principal().team if self.auth else ""

    # Catalog and checkpoints ------------------------------------------------------------------------------

    @staticmethod
    def _entry(info: ModelInfo) -> dict[str, Any]:
        return {
            "id": info.slug,
            "name": info.slug,
            "model_name": info.slug,
            "sdk_agent_type": AGENT_TYPE,
            "is_trainable": info.trainable,
            "provider": {"name": "yieldloop"},
            "created_at": _iso(info.created_time) if info.created_time else None,
        }

    async def _models(self, client: Client) -> list[ModelInfo]:

        return sorted(await client.list_models(), key=lambda m: m.slug)

    async def _list_models(self, request: Any, body: dict, client: Client) -> dict[str, Any]:
        query = request.query
        try:
            limit = int(query.get("limit", 100))
            offset = int(query.get("offset", 0))
        except ValueError:
            raise invalid_field("limit", "limit and offset must be integers") from None
        if not 1 <= limit <= 1000 or offset < 0:
            raise invalid_field("limit", "limit must be in [1, 1000] and offset >= 0")
        models = await self._models(client)  # the ones this key may see
        return {"items": [self._entry(m) for m in models[offset : offset + limit]], "total": len(models)}

    async def _resolve_model(self, request: Any, body: dict, client: Client) -> dict[str, Any]:
        name = request.query.get("model", "")
        for info in await self._models(client):
            if info.slug.lower() == name.lower():
                return self._entry(info)
        raise NotFoundError(f"no model {name!r}", reason="MODEL_NOT_FOUND", field="model")

    async def _get_model(self, request: Any, body: dict, client: Client) -> dict[str, Any]:
        return self._entry(await client.get_model(request.match_info["model"]))

    async def _fork(self, request: Any, body: dict, client: Client) -> dict[str, Any]:
        _fields(body, {"source_model_id", "name"}, "a fork")
        source, name = body.get("source_model_id"), body.get("name")
        if not isinstance(source, str) or not source or not isinstance(name, str) or not name:
            raise invalid_field("name", "a fork needs source_model_id and name (strings)")
        await client.fork_model(source, name)  # ALREADY_EXISTS (409) when the name is taken
        return self._entry(await client.get_model(name))

    async def _checkpoints(self, request: Any, body: dict, client: Client) -> list[dict[str, Any]]:
        rows = []
        for summary in await client.list_checkpoints(request.match_info["model"]):
            metadata = json.loads(summary.metadata_json or "{}")
            stats = metadata.get("hud", {}) if isinstance(metadata.get("hud"), dict) else {}
            numbers = {**{k: v for k, v in metadata.items() if k != "hud"}, **stats}
            row: dict[str, Any] = {
                "id": summary.checkpoint_id,
                "name": summary.checkpoint_id,
                "checkpoint_name": summary.checkpoint_id,
                "prev_model_checkpoint_id": summary.parent_checkpoint_id or None,
                "is_active": summary.is_head,
                "created_at": _iso(summary.created_time),
                "metrics": _finite_metrics({k: v for k, v in numbers.items() if not isinstance(v, bool)}),
            }
            for key, kind in (
                ("num_traces", int),
                ("num_datums", int),
                ("num_tokens", int),
                ("mean_reward", float),
                ("learning_rate", float),
                ("loss_fn", str),
            ):
                if isinstance(stats.get(key), (int, float, str)) and not isinstance(stats.get(key), bool):
                    row[key] = kind(stats[key])
            rows.append(row)
        return rows

    async def _set_head(self, request: Any, body: dict, client: Client) -> dict[str, Any]:
        _fields(body, {"checkpoint_id"}, "a head move")
        checkpoint_id = body.get("checkpoint_id")
        if not isinstance(checkpoint_id, str) or not checkpoint_id:
            raise invalid_field("checkpoint_id", "checkpoint_id must be a checkpoint of the model")
        model = request.match_info["model"]
        head = await client.set_head(model, checkpoint_id)
        await client.get_serving_info(wait_for_checkpoint_id=checkpoint_id, model=model)  # served before the answer
        return {"model": model, "checkpoint_id": head.checkpoint_id}

    # Training -------------------------------------------------------------------------------------------

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
        scale = _number(1.0 if reward_scale is None else reward_scale, "reward_scale")
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
        _fields(
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
        config = {k: _number(v, f"loss_fn_config.{k}") for k, v in config.items()}
        substeps = body.get("num_substeps", 1)
        if isinstance(substeps, bool) or not isinstance(substeps, int) or not 1 <= substeps <= len(runs) // size:
            raise invalid_field("num_substeps", "num_substeps must be an integer from 1 to the number of groups")
        # Substeps split the batch at group boundaries into passes that accumulate the same gradient in less memory.
        groups = [runs[i : i + size] for i in range(0, len(runs), size)]
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
        return {"metrics": _finite_metrics(metrics), "num_datums": num_datums}

    async def _forward(self, request: Any, body: dict, client: Client) -> dict[str, Any]:
        _fields(body, {"inputs", "group_size", "reward_scale"}, "a forward")
        model = request.match_info["model"]
        runs, size = await self._runs(body.get("inputs"), body.get("group_size"), body.get("reward_scale"), client)
        scored = await client.forward_scored(runs=runs, model=model)
        forward_id = uuid.uuid4().hex
        self._forwards[forward_id] = _Forward(model, self._team(), [datum for datum, _ in scored])
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
        _fields(body, {"forward_id", "weights", "metrics"}, "a backward")
        model = request.match_info["model"]
        forward_id = body.get("forward_id")
        if not isinstance(forward_id, str):
            raise invalid_field("forward_id", "forward_id must be the id a forward pass answered")
        forward = self._forwards.get(forward_id)
        if (
            forward is None
            or forward.model != model
            or (self.auth and forward.team != self._team() and not current_principal().is_admin)
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
            row = _floats(row, f"weights[{d}]")
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
        return {
            "metrics": _finite_metrics({**metrics, "num_tokens": response.num_tokens}),
            "num_datums": response.num_datums,
        }

    async def _optim_step(self, request: Any, body: dict, client: Client) -> dict[str, Any]:
        _fields(body, {"learning_rate", "beta1", "beta2", "eps", "weight_decay"}, "an optimizer step")
        model = request.match_info["model"]
        adam = {
            "beta1": _number(body.get("beta1", 0.9), "beta1", above=0.0),
            "beta2": _number(body.get("beta2", 0.95), "beta2", above=0.0),
            "eps": _number(body.get("eps", 1e-8), "eps", above=0.0),
            "weight_decay": _number(body.get("weight_decay", 0.0), "weight_decay", minimum=0.0),
        }
        learning_rate = _number(body.get("learning_rate"), "learning_rate", above=0.0)
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

    # Jobs, traces and the gateway --------------------------------------------------------------------------

    async def _job_enter(self, request: Any, body: dict, client: Client) -> dict[str, Any]:
        job_id = request.match_info["job_id"]
        group = body.get("group")
        name = check_text(body["name"], "name") if isinstance(body.get("name"), str) else ""
        await self._job(
            client,
            job_id,
            "",
            name=name,
            group_size=group if isinstance(group, int) and not isinstance(group, bool) else 0,
            metadata_json=json.dumps({"source": "hud", "taskset_id": body.get("taskset_id")}),
        )
        return {"job_id": job_id}

    @staticmethod
    async def _job(client: Client, job_id: str, model: str, **record: Any) -> JobInfo:
        """The job, recorded for the caller's team unless it exists (RolloutService's RecordRuns, with no runs);
        JOB_NOT_OWNED when another team's."""
        return await client.record_runs([], job_id, model=model, **record)

    async def _owner(self, trace_id: str, client: Client) -> tuple[str, int] | None:
        """The team a trace id belongs to and its recorded sample count (-1 while open): its open trace's, its
        recorded run's (exited here lately, or recorded by RolloutService: a HUD trace or a rollout's run; another
        team's is RUN_NOT_OWNED there); None when nobody used it."""
        trace = self._pending.get(trace_id)
        if trace is not None:
            return trace.team, -1
        exited = self._exited.get(trace_id)
        if exited is not None:
            return exited
        try:
            [run] = await client.get_runs([trace_id])
        except NotFoundError:
            return None
        return run.team, len(run.turns)

    def _require(self, team: str, trace_id: str) -> None:
        if self.auth:
            require_run(team, trace_id)

    async def _trace(self, trace_id: str, client: Client, owner: tuple[str, int] | None | object = _UNKNOWN) -> _Trace:
        """The open trace ``trace_id`` of the caller's team, opened now when nobody used the id. Trace ids are
        owned like runs: another team's (open or recorded) is RUN_NOT_OWNED, and a recorded one is never
        opened again (TRACE_ALREADY_RECORDED), so nothing is stored under an id that is not the caller's. ``owner``:
        what :meth:`_owner` answered for it just before (not asked again)."""
        if not named_trace(trace_id):
            raise invalid_field("trace_id", "a trace id is 32 lowercase hex digits (the SDK's uuid4().hex)")
        trace = self._pending.get(trace_id)
        if trace is None:
            if owner is _UNKNOWN:
                owner = await self._owner(trace_id, client)
            if owner is not None and owner[1] >= 0:
                self._require(owner[0], trace_id)
                raise FailedPreconditionError(
                    f"trace {trace_id} was exited and recorded: a new trace needs a new id",
                    reason="TRACE_ALREADY_RECORDED",
                    field="trace_id",
                )
            trace = self._pending.get(trace_id)  # opened meanwhile by a request of the same trace
            if trace is None:
                trace = self._pending[trace_id] = _Trace(self._team())
                self._evict()
                return trace
        self._require(trace.team, trace_id)
        return trace

    def _evict(self) -> None:
        now = time.monotonic()
        while self._pending:
            trace_id, oldest = next(iter(self._pending.items()))
            if len(self._pending) <= PENDING_TRACES and now - oldest.opened < PENDING_TTL_S:
                break
            log.warning("trace %s never exited; its %d samples are dropped", trace_id, len(oldest.samples))
            del self._pending[trace_id]

    async def _trace_enter(self, request: Any, body: dict, client: Client) -> dict[str, Any]:
        trace = await self._trace(request.match_info["trace_id"], client)
        for key in ("job_id", "group_id", "task_slug", "model"):
            if isinstance(body.get(key), str):
                setattr(trace, key, body[key])
        return {"trace_id": request.match_info["trace_id"]}

    async def _trace_exit(self, request: Any, body: dict, client: Client) -> dict[str, Any]:
        trace_id = request.match_info["trace_id"]
        if not named_trace(trace_id):
            raise invalid_field("trace_id", "a trace id is 32 lowercase hex digits (the SDK's uuid4().hex)")
        owner = await self._owner(trace_id, client)
        if owner is not None and owner[1] >= 0:  # the SDK repeats a report it did not hear answered: recorded once
            self._require(owner[0], trace_id)
            return {"trace_id": trace_id, "num_samples": owner[1]}
        trace = await self._trace(trace_id, client, owner)
        reward = _number(body.get("reward") or 0.0, "reward")
        error = body.get("error") if isinstance(body.get("error"), str) else ""
        info = {key: body[key] for key in ("status", "stop_reason", "evaluation_result", "metadata") if key in body}
        run = Run(
            task=TaskRef(scenario=trace.task_slug),
            group_id=trace.group_id,
            turns=trace.samples,
            reward=reward,
            info_json=json.dumps(info, default=str),
            status=RunStatus.INFRA_ERROR if error else RunStatus.GRADED,
            error=error,
            model=trace.model,
            trace_id=trace_id,
            team=trace.team,
        )
        await client.record_runs([run], trace.job_id, model=trace.model)  # durable before the answer
        self._pending.pop(trace_id, None)
        self._exited[trace_id] = (trace.team, len(run.turns))
        while len(self._exited) > PENDING_TRACES:
            self._exited.popitem(last=False)
        return {"trace_id": trace_id, "num_samples": len(run.turns)}

    async def _telemetry(self, request: Any, body: dict, client: Client) -> dict[str, Any]:
        trace_id = request.match_info["trace_id"]
        if not named_trace(trace_id):
            raise invalid_field("trace_id", "a trace id is 32 lowercase hex digits")
        spans = body.get("telemetry")
        if not isinstance(spans, list):
            raise invalid_field("telemetry", "telemetry must be a list of spans")
        owner = await self._owner(trace_id, client)
        if owner is None:
            await self._trace(trace_id, client, owner)  # nobody's yet: the caller's from now on
        else:
            self._require(owner[0], trace_id)
        key = f"hud/telemetry/{trace_id}/{time.time_ns():020d}-{uuid.uuid4().hex[:6]}.json"
        record = json.dumps({"team": self._team(), "spans": spans}, default=str).encode()
        await asyncio.to_thread(self.store.put_bytes, key, record)
        return {"accepted": len(spans)}

    async def _gateway_models(self, request: Any) -> Any:
        return await self._forward_http(request, "GET", "/models", None)

    async def _chat(self, request: Any) -> Any:
        """Chat completions, forwarded to the rollout's endpoint; with ``Trace-Id`` the answer's tokens become
        the trace's next sample."""
        try:
            body = json_object(await read_json(request, self.transport.http_body_timeout_s))
            trace_id = request.headers.get("Trace-Id", "")
            trace = await self._trace(trace_id, self._caller(request)) if trace_id else None
        except BodyTimeout as err:
            return timeout_response(err)
        except YieldloopError as err:
            return error_response(err)
        return await self._forward_http(request, "POST", "/chat/completions", body, trace)

    async def _forward_http(self, request: Any, method: str, path: str, body: Any, trace: _Trace | None = None) -> Any:
        """Forwards to RolloutService's OpenAI-compatible endpoint; when it cannot be reached, its address is asked
        again (GetServingInfo) and the request tried once more."""
        from aiohttp import ClientConnectorError, ClientError

        if not self.gateway_url:
            return error_response(
                UnavailableError(
                    "the rollout service serves no HTTP endpoint (--http-port -1)", reason="GATEWAY_UNAVAILABLE"
                )
            )
        key = presented_key_of(request)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if "traceparent" in request.headers:
            headers["traceparent"] = request.headers["traceparent"]
        for attempt in range(2):
            try:
                return await self._forward_once(request, method, path, body, headers, trace)
            except ClientConnectorError as err:
                failure = err
                if attempt == 0:  # the endpoint moved (a rollout service restarted elsewhere): ask again
                    with contextlib.suppress(YieldloopError):
                        self.gateway_url = (await self.client.get_serving_info()).openai_base_url or self.gateway_url
            except ClientError as err:
                failure = err
                break
        return error_response(
            UnavailableError(f"the rollout service's endpoint did not answer: {failure}", reason="GATEWAY_UNAVAILABLE")
        )

    async def _forward_once(
        self, request: Any, method: str, path: str, body: Any, headers: dict[str, str], trace: _Trace | None
    ) -> Any:
        from aiohttp import web

        async with self._session.request(method, self.gateway_url + path, json=body, headers=headers) as upstream:
            if body and body.get("stream"):  # streamed through as it comes (not recorded as a sample)
                response = web.StreamResponse(
                    status=upstream.status,
                    headers={"Content-Type": upstream.headers.get("Content-Type", "text/event-stream")},
                )
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                return response
            data = await upstream.read()
            status = upstream.status
        if trace is not None and status == 200:
            trace.samples.append(_sample(json.loads(data)))
            if body.get("model") and not trace.model:
                trace.model = body["model"]
        return web.Response(body=data, status=status, content_type="application/json")


def hud_settings(base_url: str, api_key: str, ca_file: str = "") -> dict[str, str]:
    """The HUD SDK's settings that point it at the front at ``base_url``: its four base URLs (the telemetry one
    too, or the SDK would upload its spans to HUD's cloud) and the key it sends (``none`` for a stack without
    auth; the SDK needs one), plus the stack's CA for https."""
    settings = {
        "HUD_API_URL": base_url,
        "HUD_RL_URL": base_url,
        "HUD_GATEWAY_URL": f"{base_url}/v1",
        "HUD_TELEMETRY_URL": f"{base_url}/v3/api",
        "HUD_API_KEY": api_key or "none",
    }
    if ca_file:
        settings["SSL_CERT_FILE"] = ca_file
    return settings


def presented_key_of(request: Any) -> str:
    from yieldloop.transport import CallInfo

    return presented_key(
        CallInfo(method="", metadata=tuple((k.lower(), v) for k, v in request.headers.items()), protocol="http")
    )


def _sample(answer: dict[str, Any]) -> Turn:
    """The turn one chat completion sampled: the prompt ids, the sampled ids and their logprobs."""
    choice = answer["choices"][0]
    content = (choice.get("logprobs") or {}).get("content") or []
    return Turn(
        prompt_token_ids=list(choice.get("prompt_token_ids") or answer.get("prompt_token_ids") or []),
        completion_token_ids=list(choice.get("token_ids") or []),
        completion_logprobs=[float(item["logprob"]) for item in content],
        weight_version=choice.get("weight_version", ""),
        completion_text=(choice.get("message") or {}).get("content") or "",
    )


def _payload_run(item: dict[str, Any], field: str) -> Run:
    """An inline trajectory (the SDK's ``TrajectoryPayload``) as a run: one turn per sample."""
    _fields(item, {"samples", "reward", "trace_id"}, field)
    samples = item.get("samples")
    if not isinstance(samples, list) or not samples:
        raise invalid_field(f"{field}.samples", "a trajectory needs at least one sample")
    turns = []
    for s, sample in enumerate(samples):
        where = f"{field}.samples[{s}]"
        if not isinstance(sample, dict):
            raise invalid_field(where, "a sample is an object")
        _fields(sample, {"prompt_token_ids", "prompt_chunks", "output_token_ids", "output_logprobs"}, where)
        if sample.get("prompt_token_ids") is None:
            raise invalid_field(
                f"{where}.prompt_token_ids",
                "these models take text prompts: prompt_token_ids is required (prompt_chunks carry images)",
            )
        tokens = _ints(sample.get("output_token_ids"), f"{where}.output_token_ids")
        logprobs = _floats(sample.get("output_logprobs") or [0.0] * len(tokens), f"{where}.output_logprobs")
        if len(logprobs) != len(tokens):
            raise invalid_field(f"{where}.output_logprobs", f"{len(logprobs)} logprobs for {len(tokens)} tokens")
        turns.append(
            Turn(
                prompt_token_ids=_ints(sample["prompt_token_ids"], f"{where}.prompt_token_ids"),
                completion_token_ids=tokens,
                completion_logprobs=logprobs,
            )
        )
    trace_id = item.get("trace_id") if isinstance(item.get("trace_id"), str) else ""
    return Run(
        turns=turns, reward=_number(item.get("reward"), f"{field}.reward"), trace_id=trace_id, status=RunStatus.GRADED
    )
