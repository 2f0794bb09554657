"""The trace store: every Run a rollout produced, by trace id, and the jobs that group them.

Runs are recorded in batches, one object per batch (a segment), so that making many runs durable costs one
write, not one per run. Layout in the object store:

- ``traces/<segment>.seg``: a batch of serialized Runs, written once. Every trace id of the batch starts with
  the segment's first 16 hex digits, its prefix (``<prefix><16 hex>``). Runs recorded with no trace id get one
  here, and the segment is the prefix alone (a run is found with one read); runs that carry theirs (a rollout
  names each episode's trace before it starts: its OpenTelemetry trace) share their request's prefix, and the
  segment is ``<prefix>.<8 hex>``, stored as ``traces/<prefix>/<8 hex>.seg`` (a run is found by listing
  ``traces/<prefix>/``). The object is a 4-byte big-endian header length, a JSON header
  ``{"runs": [[trace_id, length], ...]}``, then the runs;
- ``jobs/<job_id>/job.json``: the job (model, name, group size, created time, metadata);
- ``jobs/<job_id>/runs/<ns>-<segment>-<count>``: an empty marker per segment, ``<ns>`` the recording time,
  so listing them gives the job's runs in the order recorded (and how many, without reading them).

Stores written before segments hold ``traces/<trace_id>.pb`` (one run) and ``jobs/<job_id>/runs/<ns>-<trace_id>``
markers; both are still read.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import struct
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Protocol

from yieldloop.errors import NotFoundError
from yieldloop.types import JobInfo, Run
from yieldloop_server.store.base import ObjectNotFound, ObjectStore, PreconditionFailed
from yieldloop_server.store.base import check_name as _check

SEGMENT_ID_CHARS = 16
CACHE_BYTES = 64 << 20
MAX_LISTED_PREFIXES = 4096
"""Requests whose batch listings are kept (a few segment names each)."""
"""Recently read segments kept in memory (they never change): the runs of one batch are read together."""


def parse_marker(name: str) -> tuple[str, int]:
    """(segment, run count) of a job's marker ``<ns>-<segment>-<count>``; (trace id, 1) of an older one."""
    parts = name.split("-")
    return (parts[1], int(parts[2])) if len(parts) == 3 else (parts[-1], 1)


def _segment_key(segment: str) -> str:
    prefix, _, batch = segment.partition(".")
    return f"traces/{prefix}/{batch}.seg" if batch else f"traces/{segment}.seg"


def named_trace(trace_id: str) -> bool:
    """Whether ``trace_id`` is one of this store's kind (32 lowercase hex digits: also an OpenTelemetry trace id)."""
    return len(trace_id) == 2 * SEGMENT_ID_CHARS and all(c in "0123456789abcdef" for c in trace_id)


def encode_segment(runs: Sequence[tuple[str, bytes]]) -> bytes:
    header = json.dumps({"runs": [[trace_id, len(data)] for trace_id, data in runs]}).encode()
    return b"".join([struct.pack(">I", len(header)), header, *(data for _, data in runs)])


def decode_segment(blob: bytes) -> dict[str, bytes]:
    """trace id -> serialized run, in recording order."""
    (size,) = struct.unpack_from(">I", blob)
    offset = 4 + size
    runs = {}
    for trace_id, length in json.loads(blob[4:offset])["runs"]:
        runs[trace_id] = blob[offset : offset + length]
        offset += length
    return runs


def new_job_id() -> str:
    """A sortable job id: ``job-<UTC time>-<random>``."""
    return time.strftime("job-%Y%m%d-%H%M%S-", time.gmtime()) + uuid.uuid4().hex[:6]


class RunReader(Protocol):
    """What a reader of recorded runs gets (the trainer: runs named by trace id); RolloutService owns the records
    (it writes them, checks who may, and answers GetRuns/RecordRuns for everyone else)."""

    def get(self, trace_id: str) -> Run: ...


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
        self._segments: collections.OrderedDict[str, tuple[dict[str, bytes], int]] = collections.OrderedDict()
        self._cached_bytes = 0
        self._batches: collections.OrderedDict[str, list[str]] = collections.OrderedDict()
        """Trace-id prefix -> its batches' segments, as last listed."""
        self._lock = threading.Lock()

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

    def ensure_job(
        self, job_id: str, model: str, team: str = "", *, name: str = "", group_size: int = 0, metadata_json: str = ""
    ) -> JobInfo:
        """The job ``job_id``, recorded as a job of ``model`` by ``team`` unless it exists (rollouts name their
        job freely). A job opened before its model was known (the HUD SDK's ``Job.start``) takes the model of its
        first recorded run."""
        try:
            job = self._read_job(job_id)
        except NotFoundError:
            pass
        else:
            if model and not job.model:
                data, etag = self.store.get_bytes(f"jobs/{job_id}/job.json")
                record = {**json.loads(data), "model": model}
                with contextlib.suppress(PreconditionFailed):  # another run named it meanwhile: either is right
                    self.store.put_bytes(f"jobs/{job_id}/job.json", json.dumps(record).encode(), if_match=etag)
                job = self._read_job(job_id)
            return job
        self.create_job(
            JobInfo(
                job_id=job_id,
                model=model,
                name=name or job_id,
                team=team,
                group_size=group_size,
                metadata_json=metadata_json,
            )
        )
        return self._read_job(job_id)

    def _read_job(self, job_id: str) -> JobInfo:
        try:
            data, _ = self.store.get_bytes(f"jobs/{_check(job_id, 'job_id')}/job.json")
        except ObjectNotFound:
            raise NotFoundError(f"no job {job_id!r}", reason="JOB_NOT_FOUND") from None
        return JobInfo(**json.loads(data))

    def get_job(self, job_id: str) -> JobInfo:
        job = self._read_job(job_id)
        job.num_runs = sum(count for _, count in self._markers(job_id))
        return job

    def list_jobs(self) -> list[JobInfo]:
        """Every job with its run count (one listing of ``jobs/``), oldest first."""
        runs: collections.Counter[str] = collections.Counter()
        recorded = []
        for key in self.store.list("jobs/"):
            job_id, _, rest = key[len("jobs/") :].partition("/")
            if rest == "job.json":
                recorded.append(job_id)
            elif rest.startswith("runs/"):
                runs[job_id] += parse_marker(rest[len("runs/") :])[1]
        jobs = [self._read_job(job_id) for job_id in recorded]
        for job in jobs:
            job.num_runs = runs[job.job_id]
        return sorted(jobs, key=lambda job: (job.created_time, job.job_id))

    def put(self, run: Run, job_id: str = "default") -> str:
        """Persists ``run`` under a new trace id (set on the run) and returns the id."""
        return self.put_many([run], job_id)[0]

    def put_many(self, runs: Sequence[Run], job_id: str = "default") -> list[str]:
        """Persists ``runs`` (one write per trace-id prefix, usually one, then the job's marker each) under their
        trace ids, or new ones (set on the runs) for runs without; returns the ids. Once this returns, every one
        of them is durable."""
        _check(job_id, "job_id")
        by_prefix: dict[str, list[Run]] = {}
        fresh = uuid.uuid4().hex[:SEGMENT_ID_CHARS]
        for run in runs:
            if not named_trace(run.trace_id):
                run.trace_id = fresh + uuid.uuid4().hex[SEGMENT_ID_CHARS:]
            by_prefix.setdefault(run.trace_id[:SEGMENT_ID_CHARS], []).append(run)
        for prefix, batch in by_prefix.items():
            segment = prefix if prefix == fresh else f"{prefix}.{uuid.uuid4().hex[:8]}"
            self.store.put_bytes(
                _segment_key(segment), encode_segment([(r.trace_id, self.encode(r)) for r in batch]), if_none_match=True
            )
            self.store.put_bytes(f"jobs/{job_id}/runs/{time.time_ns():020d}-{segment}-{len(batch)}", b"")
        return [run.trace_id for run in runs]

    def _segment(self, segment: str) -> dict[str, bytes] | None:
        with self._lock:
            if segment in self._segments:
                self._segments.move_to_end(segment)
                return self._segments[segment][0]
        try:
            blob, _ = self.store.get_bytes(_segment_key(segment))
        except ObjectNotFound:
            return None
        runs = decode_segment(blob)
        with self._lock:
            if segment not in self._segments:
                self._segments[segment] = runs, len(blob)
                self._cached_bytes += len(blob)
            while self._cached_bytes > CACHE_BYTES and len(self._segments) > 1:
                _, (_, size) = self._segments.popitem(last=False)
                self._cached_bytes -= size
        return runs

    def get(self, trace_id: str) -> Run:
        _check(trace_id, "trace_id")
        found = self._find(trace_id) if named_trace(trace_id) else None
        if found is not None:
            return self.decode(found)
        try:  # recorded one run per object, before segments
            data, _ = self.store.get_bytes(f"traces/{trace_id}.pb")
        except ObjectNotFound:
            raise NotFoundError(f"no run with trace id {trace_id!r}", reason="TRACE_NOT_FOUND") from None
        return self.decode(data)

    def recorded(self, trace_ids: Sequence[str]) -> list[str]:
        """Which of ``trace_ids`` have a recorded run."""
        found = []
        for trace_id in trace_ids:
            try:
                self.get(trace_id)
            except NotFoundError:
                continue
            found.append(trace_id)
        return found

    def _find(self, trace_id: str) -> bytes | None:
        """A run's bytes from its segment. The batches of its prefix listed before are tried first (the runs of
        one request are read together: one listing, each segment read once); the prefix is listed again only for
        a run in none of them; a prefix with no batches is a segment of its own (runs recorded without ids)."""
        prefix = trace_id[:SEGMENT_ID_CHARS]
        with self._lock:
            known = self._batches.get(prefix, [])
        for segment in known:
            runs = self._segment(segment)
            if runs is not None and trace_id in runs:
                return runs[trace_id]
        listed = [
            f"{prefix}.{key.rsplit('/', 1)[1].removesuffix('.seg')}" for key in self.store.list(f"traces/{prefix}/")
        ]
        with self._lock:
            self._batches[prefix] = listed
            self._batches.move_to_end(prefix)
            while len(self._batches) > MAX_LISTED_PREFIXES:
                self._batches.popitem(last=False)
        for segment in (s for s in listed if s not in known) if listed else [prefix]:
            runs = self._segment(segment)
            if runs is not None and trace_id in runs:
                return runs[trace_id]
        return None

    def _markers(self, job_id: str) -> list[tuple[str, int]]:
        """(segment or old-style trace id, run count) of each marker of a job, in recording order."""
        prefix = f"jobs/{_check(job_id, 'job_id')}/runs/"
        return [parse_marker(key[len(prefix) :]) for key in sorted(self.store.list(prefix))]

    def job_runs(self, job_id: str) -> list[str]:
        """Trace ids of a job's runs, in the order they were recorded."""
        ids = []
        for name, _ in self._markers(job_id):
            if len(name) == SEGMENT_ID_CHARS or "." in name:
                runs = self._segment(name)
                ids += list(runs) if runs is not None else []
            else:
                ids.append(name)
        return ids
