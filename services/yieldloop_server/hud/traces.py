"""HUD's job and trace reports on the front (``HUD_API_URL``, ``HUD_TELEMETRY_URL``): a trace opened by the SDK
collects the samples the gateway saw for it until it exits, then is recorded as a run through RolloutService
(RecordRuns); span uploads are kept in the store."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import time
import uuid
from typing import Any

from yieldloop.client import Client
from yieldloop.errors import FailedPreconditionError, NotFoundError, check_text, invalid_field
from yieldloop.transport import TransportConfig
from yieldloop.types import JobInfo, Run, RunStatus, TaskRef, Turn
from yieldloop_server.common.auth import require_run
from yieldloop_server.hud.common import Contract, number
from yieldloop_server.store import ObjectStore
from yieldloop_server.store.traces import named_trace

log = logging.getLogger(__name__)

PENDING_TRACES = 10_000
"""Traces whose samples are kept until they exit (the oldest are dropped beyond this, with a warning)."""
PENDING_TTL_S = 6 * 3600.0


_UNKNOWN = object()
"""A trace id's owner not looked up yet."""


@dataclasses.dataclass
class OpenTrace:
    """A trace the SDK opened: who, under which job and group, and the samples the gateway saw for it."""

    team: str
    job_id: str = ""
    group_id: str = ""
    task_slug: str = ""
    model: str = ""
    prompt: str = ""
    """The first request's prompt: the text of its last user message (``trace`` and ``export`` show it)."""
    samples: list[Turn] = dataclasses.field(default_factory=list)
    opened: float = dataclasses.field(default_factory=time.monotonic)


class Traces(Contract):
    """``POST /v2/trace/job/{id}/enter``, ``/v2/trace/{id}/enter``, ``/v2/trace/{id}/exit``,
    ``/v3/api/trace/{id}/telemetry-upload``. Trace ids are owned like runs: another team's is RUN_NOT_OWNED."""

    def __init__(self, client: Client, transport: TransportConfig, auth: bool, store: ObjectStore) -> None:
        super().__init__(client, transport, auth)
        self.store = store
        self._pending: collections.OrderedDict[str, OpenTrace] = collections.OrderedDict()
        self._exited: collections.OrderedDict[str, tuple[str, int]] = collections.OrderedDict()
        """Traces recorded lately (their team and sample count): a repeated exit report is answered, not recorded
        twice (older ones are found through RolloutService)."""

    def routes(self, handler: Any) -> list[Any]:
        from aiohttp import web

        return [
            web.post("/v2/trace/job/{job_id}/enter", handler(self._job_enter)),
            web.post("/v2/trace/{trace_id}/enter", handler(self._trace_enter)),
            web.post("/v2/trace/{trace_id}/exit", handler(self._trace_exit)),
            web.post("/v3/api/trace/{trace_id}/telemetry-upload", handler(self._telemetry)),
        ]

    async def _job_enter(self, request: Any, body: dict, client: Client) -> dict[str, Any]:
        job_id = request.match_info["job_id"]
        group = body.get("group")
        group = group if isinstance(group, int) and not isinstance(group, bool) else 0
        if not 0 <= group < 2**31:
            raise invalid_field("group", "group must be an integer in [0, 2^31)")
        name = check_text(body["name"], "name") if isinstance(body.get("name"), str) else ""
        await self._job(
            client,
            job_id,
            "",
            name=name,
            group_size=group,
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

    async def trace(
        self, trace_id: str, client: Client, owner: tuple[str, int] | None | object = _UNKNOWN
    ) -> OpenTrace:
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
                trace = self._pending[trace_id] = OpenTrace(self.team())
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
        trace = await self.trace(request.match_info["trace_id"], client)
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
        trace = await self.trace(trace_id, client, owner)
        reward = number(body.get("reward") or 0.0, "reward")
        error = body.get("error") if isinstance(body.get("error"), str) else ""
        info = {key: body[key] for key in ("status", "stop_reason", "evaluation_result", "metadata") if key in body}
        run = Run(
            task=TaskRef(scenario=trace.task_slug),
            group_id=trace.group_id,
            prompt=trace.prompt,
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
            await self.trace(trace_id, client, owner)  # nobody's yet: the caller's from now on
        else:
            self._require(owner[0], trace_id)
        key = f"hud/telemetry/{trace_id}/{time.time_ns():020d}-{uuid.uuid4().hex[:6]}.json"
        record = json.dumps({"team": self.team(), "spans": spans}, default=str).encode()
        await asyncio.to_thread(self.store.put_bytes, key, record)
        return {"accepted": len(spans)}
