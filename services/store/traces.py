"""The trace store: every Run a rollout produced, by trace id, in the object store.

Layout: ``traces/<trace_id>.pb`` (the serialized Run, written once) and
``jobs/<job_id>/runs/<trace_id>`` (an empty marker listing a job's runs).
"""

from __future__ import annotations

import uuid

from yieldloop.common.v1 import common_pb2 as common_pb
from yieldloop.errors import NotFoundError
from yieldloop.services.store.base import ObjectNotFound, ObjectStore, check_name as _check


class TraceStore:
    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    def put(self, run: common_pb.Run, job_id: str = "default") -> str:
        """Persists ``run`` under a new trace id (set on the run) and returns the id."""
        _check(job_id, "job_id")
        run.trace_id = uuid.uuid4().hex
        self.store.put_bytes(f"traces/{run.trace_id}.pb", run.SerializeToString(), if_none_match=True)
        self.store.put_bytes(f"jobs/{job_id}/runs/{run.trace_id}", b"")
        return run.trace_id

    def get(self, trace_id: str) -> common_pb.Run:
        _check(trace_id, "trace_id")
        try:
            data, _ = self.store.get_bytes(f"traces/{trace_id}.pb")
        except ObjectNotFound:
            raise NotFoundError(f"no run with trace id {trace_id!r}", reason="TRACE_NOT_FOUND") from None
        return common_pb.Run.FromString(data)

    def job_runs(self, job_id: str) -> list[str]:
        """Trace ids of a job's runs."""
        prefix = f"jobs/{_check(job_id, 'job_id')}/runs/"
        return [key[len(prefix):] for key in self.store.list(prefix)]
