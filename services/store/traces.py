"""The trace store: every Run a rollout produced, by trace id, and the jobs that group them.

Layout in the object store:

- ``traces/<trace_id>.pb``: the serialized Run, written once;
- ``jobs/<job_id>/job.json``: the job (model, name, group size, created time, metadata);
- ``jobs/<job_id>/runs/<ns>-<trace_id>``: an empty marker per run, ``<ns>`` the
  recording time, so listing them gives the job's runs in the order recorded.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
import uuid
from collections.abc import Callable

from yieldloop.errors import NotFoundError
from yieldloop.types import JobInfo, Run
from yieldloop_server.store.base import ObjectNotFound, ObjectStore, PreconditionFailed, check_name as _check


def new_job_id() -> str:
    """A sortable job id: ``job-<UTC time>-<random>``."""
    return time.strftime("job-%Y%m%d-%H%M%S-", time.gmtime()) + uuid.uuid4().hex[:6]


class TraceStore:
    """Runs and jobs over an object store.

    Args:
        store: Where they live.
        encode, decode: A run to bytes and back (the wiring passes the wire encoding,
            :func:`yieldloop.convert.run_to_bytes` / ``run_from_bytes``: this module stays free of protobuf).
    """

    def __init__(self, store: ObjectStore, encode: Callable[[Run], bytes], decode: Callable[[bytes], Run]) -> None:
        self.store = store
        self.encode = encode
        self.decode = decode

    def create_job(self, job: JobInfo) -> JobInfo:
        """Records a new job (a fresh id when ``job.job_id`` is empty) and returns it."""
        job.job_id = _check(job.job_id or new_job_id(), "job_id")
        job.created_time = job.created_time or time.time()
        record = dataclasses.asdict(job)
        del record["num_runs"]
        try:
            self.store.put_bytes(f"jobs/{job.job_id}/job.json", json.dumps(record).encode(), if_none_match=True)
        except PreconditionFailed:  # recorded already (e.g. the implicit job of an earlier rollout)
            pass
        return job

    def ensure_job(self, job_id: str, model: str) -> None:
        """Records ``job_id`` as a job of ``model`` unless it exists (rollouts name their job freely)."""
        if self.store.stat(f"jobs/{_check(job_id, 'job_id')}/job.json") is None:
            self.create_job(JobInfo(job_id=job_id, model=model, name=job_id))

    def _read_job(self, job_id: str) -> JobInfo:
        try:
            data, _ = self.store.get_bytes(f"jobs/{_check(job_id, 'job_id')}/job.json")
        except ObjectNotFound:
            raise NotFoundError(f"no job {job_id!r}", reason="JOB_NOT_FOUND") from None
        return JobInfo(**json.loads(data))

    def get_job(self, job_id: str) -> JobInfo:
        job = self._read_job(job_id)
        job.num_runs = len(self.job_runs(job_id))
        return job

    def list_jobs(self) -> list[JobInfo]:
        """Every job with its run count (one listing of ``jobs/``), oldest first."""
        runs: collections.Counter[str] = collections.Counter()
        recorded = []
        for key in self.store.list("jobs/"):
            job_id, _, rest = key[len("jobs/"):].partition("/")
            if rest == "job.json":
                recorded.append(job_id)
            elif rest.startswith("runs/"):
                runs[job_id] += 1
        jobs = [self._read_job(job_id) for job_id in recorded]
        for job in jobs:
            job.num_runs = runs[job.job_id]
        return sorted(jobs, key=lambda job: (job.created_time, job.job_id))

    def put(self, run: Run, job_id: str = "default") -> str:
        """Persists ``run`` under a new trace id (set on the run) and returns the id."""
        _check(job_id, "job_id")
        run.trace_id = uuid.uuid4().hex
        self.store.put_bytes(f"traces/{run.trace_id}.pb", self.encode(run), if_none_match=True)
        self.store.put_bytes(f"jobs/{job_id}/runs/{time.time_ns():020d}-{run.trace_id}", b"")
        return run.trace_id

    def get(self, trace_id: str) -> Run:
        _check(trace_id, "trace_id")
        try:
            data, _ = self.store.get_bytes(f"traces/{trace_id}.pb")
        except ObjectNotFound:
            raise NotFoundError(f"no run with trace id {trace_id!r}", reason="TRACE_NOT_FOUND") from None
        return self.decode(data)

    def job_runs(self, job_id: str) -> list[str]:
        """Trace ids of a job's runs, in the order they were recorded."""
        prefix = f"jobs/{_check(job_id, 'job_id')}/runs/"
        return [key[len(prefix):].rsplit("-", 1)[-1] for key in sorted(self.store.list(prefix))]
