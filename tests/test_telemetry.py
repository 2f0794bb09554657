"""OpenTelemetry across the services (issue 16): one `eval` through `yieldloop up`'s processes, spans received by
a test OTLP receiver (a grpc.aio TraceService server)."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import pathlib
import re
import subprocess
import sys
import urllib.request

import grpc
import pytest_asyncio
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from yieldloop.training import connect
from yieldloop_server.stack import ProcessStack, StackConfig


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []  # (service.name, span)

    async def Export(self, request, context):
        for resource_spans in request.resource_spans:
            attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                self.spans += [(attributes.get("service.name", ""), span) for span in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest_asyncio.fixture
async def receiver():
    server = grpc.aio.server()
    received = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(received, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield received, port
    await server.stop(0)


async def test_one_eval_is_one_trace_per_episode_across_processes(
    receiver, tmp_path: pathlib.Path, monkeypatch
) -> None:
    received, port = receiver
    otel = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
        "OTEL_METRICS_EXPORTER": "prometheus",
    }
    for name, value in otel.items():
        monkeypatch.setenv(name, value)  # the stack's processes inherit them
    stack = ProcessStack(StackConfig(data_dir=tmp_path, record_spans=True))
    await stack.start()
    try:
        env = {**os.environ, "YIELDLOOP_DATA_DIR": str(tmp_path), "COLUMNS": "250"}
        done = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                "-m",
                "yieldloop.cli",
                "eval",
                "yieldloop.envs.letters:heldout_tasks",
                "tiny",
                "--group",
                "2",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        job_id = re.search(r"job (\S+): \d+ runs", done.stdout).group(1)
        async with connect(tmp_path, timeout=120) as client:
            runs = [run async for run in client.job_runs(job_id)]
            await client.forward_backward(runs=[run.trace_id for run in runs])
            step = await client.optim_step(learning_rate=1e-4)
            await client.get_serving_info(wait_for_checkpoint_id=step.checkpoint.checkpoint_id)
        # --record-spans: `yieldloop trace ID` shows where the episode's time went, every service's spans.
        await asyncio.sleep(1.0)  # the batch span processors export every 200 ms here
        shown = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "yieldloop.cli", "trace", runs[0].trace_id],
            capture_output=True,
            text=True,
            env=env,
        )
        assert shown.returncode == 0, shown.stderr
        timeline = shown.stdout[shown.stdout.index("spans (") :]
        for name in (
            "episode [rollout]",
            "generate [rollout]",
            "EnvService/StreamEpisodes [env]",
            "grade [env]",
            "env-worker submit [env-worker]",
        ):
            assert name in timeline, timeline
        scraped = {}  # each service's Prometheus endpoint (its address in the ready file)
        for service in ("env", "trainer", "rollout"):
            address = json.loads((tmp_path / "run" / f"{service}.json").read_text())["metrics"]
            scraped[service] = await asyncio.to_thread(
                lambda a=address: urllib.request.urlopen(f"http://{a}/metrics", timeout=10).read().decode()
            )
    finally:
        await stack.stop()  # each service flushes its spans as it stops
    by_trace: dict[str, list] = collections.defaultdict(list)
    for service, span in received.spans:
        by_trace[span.trace_id.hex()].append((service, span))
    services = {service for service, _ in received.spans}
    assert {
        "yieldloop-checkpoint",
        "yieldloop-env",
        "yieldloop-trainer",
        "yieldloop-rollout",
        "yieldloop-env-worker",
    } <= services, services
    stream = [s for _, s in received.spans if s.name.endswith("RolloutService/StreamRollouts")]
    assert stream
    for run in runs:
        spans = by_trace[run.trace_id]  # the Run's trace id is its episode's trace
        names = {s.name for _, s in spans}
        assert {"episode", "generate", "yieldloop.env.v1.EnvService/StreamEpisodes", "grade"} <= names, names
        ids = {s.span_id for _, s in spans}
        root = [s for _, s in spans if s.name == "episode"][0]
        assert root.span_id.hex() == run.trace_id[16:] and not root.parent_span_id
        assert any(link.span_id in {s.span_id for s in stream} for link in root.links)  # -> StreamRollouts
        for service, span in spans:  # every other span has its parent in the same trace, across processes
            if span is not root:
                assert span.parent_span_id in ids, (service, span.name)
        assert {service for service, _ in spans} >= {"yieldloop-rollout", "yieldloop-env", "yieldloop-env-worker"}
    trained = [s for service, s in received.spans if service == "yieldloop-trainer" and s.name == "forward_backward"]
    linked = {link.trace_id.hex() for span in trained for link in span.links}
    assert {run.trace_id for run in runs} <= linked
    stepped = [s for service, s in received.spans if service == "yieldloop-trainer" and s.name == "optim_step"]
    assert {run.trace_id for run in runs} <= {link.trace_id.hex() for span in stepped for link in span.links}
    commits = [s for _, s in received.spans if s.name == "checkpoint.commit"]
    assert any(a.value.string_value == step.checkpoint.checkpoint_id for s in commits for a in s.attributes)
    reloads = [s for service, s in received.spans if service == "yieldloop-rollout" and s.name == "weights.reload"]
    assert any(a.value.string_value == step.checkpoint.checkpoint_id for s in reloads for a in s.attributes)
    # Metrics, scraped by Prometheus's text format.
    for service, names in {
        "env": ["yieldloop_env_episodes", "yieldloop_env_tool_call_duration"],
        "rollout": [
            "yieldloop_rollout_episodes",
            "yieldloop_rollout_tokens",
            "yieldloop_engine_queue_depth",
            "yieldloop_rollout_reload_duration",
        ],
        "trainer": ["yieldloop_train_loss", "yieldloop_train_kl", "yieldloop_train_reward"],
    }.items():
        for name in names:
            assert name in scraped[service] or service == "env" and "tool_call" in name, (service, name)


def test_the_timeline_nests_spans_under_their_parents() -> None:
    from yieldloop.cli import span_timeline
    from yieldloop.proto.rollout.v1 import rollout_service_pb2 as pb

    spans = [
        pb.TraceSpan(
            span_id="a",
            name="episode",
            service="rollout",
            start_time_unix_nano=0,
            end_time_unix_nano=100_000_000,
            status="UNSET",
        ),
        pb.TraceSpan(
            span_id="b",
            parent_span_id="a",
            name="generate",
            service="rollout",
            start_time_unix_nano=10_000_000,
            end_time_unix_nano=60_000_000,
            status="UNSET",
        ),
        pb.TraceSpan(
            span_id="c",
            parent_span_id="a",
            name="grade",
            service="env",
            start_time_unix_nano=60_000_000,
            end_time_unix_nano=100_000_000,
            status="ERROR",
            error="boom",
        ),
    ]
    lines = span_timeline(spans, width=10).splitlines()
    assert lines[0] == "spans (3, 100.0 ms):"
    assert lines[1].endswith("|##########| episode [rollout]")
    assert "10.0 ms" in lines[2] and "50.0 ms" in lines[2] and lines[2].endswith("| #####    |   generate [rollout]")
    assert lines[3].endswith("grade [env]  ERROR: boom") and "|      ####|" in lines[3]
