"""The trace store: runs recorded in batches (one segment object per batch), found by trace id with one read,
listed per job in recording order; stores written one run per object before segments still read."""

from __future__ import annotations

import time

import pytest

from yieldloop.convert import run_from_bytes, run_to_bytes
from yieldloop.errors import NotFoundError
from yieldloop.types import JobInfo, Run
from yieldloop_server.store.fs import FsStore
from yieldloop_server.store.traces import TraceStore


def runs(n: int, tag: str) -> list[Run]:
    return [Run(group_id=f"{tag}-{i}", reward=float(i), answer=f"{tag}{i}") for i in range(n)]


class CountingStore(FsStore):
    def __init__(self, root) -> None:
        super().__init__(root)
        self.puts = 0
        self.gets = 0

    def put_bytes(self, key, data, **kw):
        self.puts += 1
        return super().put_bytes(key, data, **kw)

    def get_bytes(self, key):
        self.gets += 1
        return super().get_bytes(key)

    def list(self, prefix):
        self.lists = getattr(self, "lists", 0) + 1
        return super().list(prefix)


def test_a_batch_is_one_segment_and_each_run_is_found_by_its_trace_id(tmp_path) -> None:
    store = CountingStore(tmp_path)
    traces = TraceStore(store, run_to_bytes, run_from_bytes)
    traces.create_job(JobInfo(job_id="j", model="tiny"))
    store.puts = 0
    first, second = runs(64, "a"), runs(3, "b")
    ids = traces.put_many(first, "j") + traces.put_many(second, "j")
    assert store.puts == 4, "two writes per batch (the segment, the job's marker), not two per run"
    assert len(set(ids)) == 67 and all(run.trace_id == i for run, i in zip(first + second, ids))
    assert traces.job_runs("j") == ids
    assert traces.get_job("j").num_runs == 67 and traces.list_jobs()[0].num_runs == 67

    fresh = TraceStore(store, run_to_bytes, run_from_bytes)  # another process: nothing cached
    store.gets = 0
    assert [fresh.get(i).answer for i in ids] == [r.answer for r in first + second]
    assert store.gets == 2, "the runs of one batch are read together"
    with pytest.raises(NotFoundError):
        fresh.get(ids[0][:16] + "0" * 16)
    with pytest.raises(NotFoundError):
        fresh.get("f" * 32)


def test_runs_recorded_before_segments_are_still_read(tmp_path) -> None:
    store = FsStore(tmp_path)
    old = Run(group_id="g", reward=1.0, answer="old", trace_id="ab" * 16)
    store.put_bytes(f"traces/{old.trace_id}.pb", run_to_bytes(old))
    store.put_bytes("jobs/j/job.json", b'{"job_id": "j", "model": "tiny", "name": "j"}')
    store.put_bytes(f"jobs/j/runs/{time.time_ns():020d}-{old.trace_id}", b"")
    traces = TraceStore(store, run_to_bytes, run_from_bytes)
    new = traces.put_many(runs(2, "n"), "j")
    assert traces.job_runs("j") == [old.trace_id, *new]
    assert traces.get(old.trace_id).answer == "old" and traces.get_job("j").num_runs == 3


def test_runs_that_carry_their_trace_ids_keep_them_and_are_read_with_one_listing(tmp_path) -> None:
    """A rollout names each episode's trace before it starts (its request's prefix + 16 random digits): the store
    keeps those ids, one segment per batch under the prefix; a reader lists the prefix once and reads each batch
    once, however many of the request's runs it looks up."""
    store = CountingStore(tmp_path)
    prefix = "0123456789abcdef"
    first, second = runs(3, "a"), runs(2, "b")
    for i, run in enumerate(first + second):
        run.trace_id = f"{prefix}{i:016x}"
    writer = TraceStore(store, run_to_bytes, run_from_bytes)
    writer.put_many(first, "j")
    writer.put_many(second, "j")
    assert [r.trace_id for r in first + second] == [f"{prefix}{i:016x}" for i in range(5)]
    assert len(list(store.list(f"traces/{prefix}/"))) == 2
    reader = TraceStore(store, run_to_bytes, run_from_bytes)
    store.gets = store.lists = 0
    assert [reader.get(r.trace_id).answer for r in first + second] == ["a0", "a1", "a2", "b0", "b1"]
    assert store.lists <= 2 and store.gets == 2  # a second listing at most (a run not in the first batch read)
    assert [reader.get(r.trace_id).answer for r in first + second] == ["a0", "a1", "a2", "b0", "b1"]
    assert store.gets == 2  # all cached
    assert sorted(reader.job_runs("j")) == sorted(r.trace_id for r in first + second)
    with pytest.raises(NotFoundError):
        reader.get(prefix + "f" * 16)
