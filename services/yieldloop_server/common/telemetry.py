"""OpenTelemetry in every service: traces configured by the standard variables, off at no cost when unset.

- :func:`configure` installs the SDK once per process when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, or ``OTEL_TRACES_EXPORTER``) is set: a ``TracerProvider`` whose sampler
  comes from ``OTEL_TRACES_SAMPLER``/``OTEL_TRACES_SAMPLER_ARG`` and whose spans go to the OTLP exporter (its
  own variables: endpoint, headers, ``OTEL_EXPORTER_OTLP_INSECURE``, ...). ``service.name`` is
  ``OTEL_SERVICE_NAME`` or ``yieldloop-<service>``. Unset, nothing is installed: no interceptor, no span.
- :class:`Tracing` is the transport's server interceptor: one SERVER span per gRPC call and HTTP request, a child
  of the caller's context (W3C ``traceparent`` in the metadata or headers). It wraps the handler as what it is,
  so handlers written with ``context.read()/write()`` keep working (the stock aio server interceptor breaks
  them), and refusals and ``abort_with_status`` set the span's status (:func:`record_error`).
- Clients get a CLIENT span per call that ends with the call, and ``traceparent`` in its metadata
  (:func:`client_interceptors`).
- One episode is one trace whose id is the Run's ``trace_id`` (:func:`episode_span`); its root span's id is the
  trace id's last 16 hex digits, so a training step links to the traces of the runs it trained on knowing only
  their trace ids (:func:`run_link`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import os
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from yieldloop.transport import CallInfo

_enabled = False
_ending: set[asyncio.Task] = set()
_preset: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("yieldloop_trace_ids", default=None)


def wanted() -> bool:
    """Whether the environment asks for traces."""
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "")
    if exporter == "none":
        return False
    return bool(
        exporter
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


RECORD_SPANS_VARIABLE = "YIELDLOOP_RECORD_SPANS"
"""Set to a store URL: every process of the stack records the spans of episode traces there (``--record-spans``;
the env worker processes inherit it)."""


def configure(service: str) -> bool:
    """Installs the tracer provider once per process when the environment asks for traces, or for spans
    recorded in the store (:data:`RECORD_SPANS_VARIABLE`); returns whether tracing is on."""
    global _enabled
    record_url = os.environ.get(RECORD_SPANS_VARIABLE, "")
    if _enabled or not (wanted() or record_url):
        return _enabled
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    resource = Resource.create(
        {"service.name": os.environ.get("OTEL_SERVICE_NAME") or f"yieldloop-{service}", "yieldloop.service": service}
    )
    from opentelemetry.sdk.trace.sampling import _get_from_env_or_default

    provider = TracerProvider(
        resource=resource, id_generator=_run_ids(), sampler=_marking_runs(_get_from_env_or_default())
    )
    if record_url:
        from yieldloop_server.store import open_store

        # Written within a second: `yieldloop trace` right after an eval finds them.
        provider.add_span_processor(
            BatchSpanProcessor(_store_exporter(open_store(record_url), service), schedule_delay_millis=1000)
        )
    exporters = os.environ.get("OTEL_TRACES_EXPORTER", "otlp" if wanted() else "none")
    for name in (e.strip() for e in exporters.split(",")):
        if name == "otlp":
            protocol = os.environ.get(
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
            )
            if protocol.startswith("http"):
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            else:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)
    _enabled = True
    return True


RUN_STATE = ("yl", "run")
"""The tracestate entry an episode's root span starts its trace with; every span of the trace, in every process,
inherits it (W3C tracestate), so a recorder keeps the spans of episodes and nothing else."""


def _marking_runs(sampler: Any) -> Any:
    """``sampler`` (from OTEL_TRACES_SAMPLER), whose sampled episode roots carry :data:`RUN_STATE`."""
    from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
    from opentelemetry.trace import TraceState, get_current_span

    class MarkRuns(Sampler):
        def should_sample(
            self,
            parent_context: Any,
            trace_id: int,
            name: str,
            kind: Any = None,
            attributes: Any = None,
            links: Any = None,
            trace_state: Any = None,
        ) -> SamplingResult:
            result = sampler.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)
            parent = get_current_span(parent_context).get_span_context()
            if name == "episode" and not parent.is_valid and result.decision == Decision.RECORD_AND_SAMPLE:
                state = (result.trace_state or TraceState()).add(*RUN_STATE)
                return SamplingResult(result.decision, result.attributes, state)
            return result

        def get_description(self) -> str:
            return f"MarkRuns({sampler.get_description()})"

    return MarkRuns()


def _store_exporter(store: Any, service: str) -> Any:
    """A span exporter writing the spans of episode traces to the store, one object per trace prefix and batch
    (``spans/<trace id's first 16 hex>/<service>-<8 hex>.json``), where :func:`read_spans` finds them."""
    import json
    import logging
    import uuid

    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class StoreSpans(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            by_prefix: dict[str, list[dict]] = {}
            for span in spans:
                context = span.get_span_context()
                if context.trace_state.get(RUN_STATE[0]) != RUN_STATE[1]:
                    continue
                trace_id = f"{context.trace_id:032x}"
                by_prefix.setdefault(trace_id[:16], []).append(
                    {
                        "trace_id": trace_id,
                        "span_id": f"{context.span_id:016x}",
                        "parent_span_id": f"{span.parent.span_id:016x}" if span.parent else "",
                        "name": span.name,
                        "service": service,
                        "start_ns": span.start_time,
                        "end_ns": span.end_time,
                        "status": span.status.status_code.name,
                        "error": span.status.description or "",
                        "attributes": {
                            k: v if isinstance(v, (str, int, float, bool)) else str(v)
                            for k, v in (span.attributes or {}).items()
                        },
                    }
                )
            try:
                for prefix, records in by_prefix.items():
                    store.put_bytes(
                        f"spans/{prefix}/{service}-{uuid.uuid4().hex[:8]}.json", json.dumps(records).encode()
                    )
            except Exception:
                logging.getLogger(__name__).warning("recording spans in the store failed", exc_info=True)
                return SpanExportResult.FAILURE
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            pass

    return StoreSpans()


def read_spans(store: Any, trace_id: str) -> list[dict]:
    """The recorded spans of one trace (every service's), oldest first; [] when none were recorded."""
    import json

    spans = []
    for key in store.list(f"spans/{trace_id[:16]}/"):
        with contextlib.suppress(Exception):
            spans += [s for s in json.loads(store.get_bytes(key)[0]) if s.get("trace_id") == trace_id]
    return sorted(spans, key=lambda s: s["start_ns"])


def shutdown() -> None:
    """Flushes and stops the exporters (spans and metrics still queued are sent)."""
    if _enabled:
        from opentelemetry import trace

        with contextlib.suppress(Exception):
            trace.get_tracer_provider().shutdown()
    if _meter is not None:
        from opentelemetry import metrics

        with contextlib.suppress(Exception):
            metrics.get_meter_provider().shutdown()


_tracer: Any = None


def tracer() -> Any:
    """This process's tracer (made once: a tracer per span would cost every call)."""
    global _tracer
    if _tracer is None:
        from opentelemetry import trace

        _tracer = trace.get_tracer("yieldloop")
    return _tracer


def _run_ids() -> Any:
    """The SDK's random ids, except where :func:`episode_span` preset the next root span's (trace id, span id)
    (those are random too: a run's trace id is a uuid4)."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class RunIds(RandomIdGenerator):
        def generate_trace_id(self) -> int:
            preset = _preset.get()
            return preset[0] if preset else super().generate_trace_id()

        def generate_span_id(self) -> int:
            preset = _preset.get()
            if preset:
                _preset.set(None)  # only the root span of the episode
                return preset[1]
            return super().generate_span_id()

    return RunIds()


def ids_of(trace_id: str) -> tuple[int, int] | None:
    """(trace id, root span id) of a run's 32-hex-digit trace id; None for another kind of id."""
    if len(trace_id) != 32:
        return None
    try:
        return int(trace_id, 16), int(trace_id[16:], 16) or 1
    except ValueError:
        return None


_quiet: contextvars.ContextVar[bool] = contextvars.ContextVar("yieldloop_unsampled", default=False)
"""Set for the whole of a call or an episode whose trace the sampler dropped: one lookup then answers
:func:`_unsampled_parent` for each of its spans (the generic answer costs microseconds per tool call)."""


def _unsampled_parent(parent: Any = None) -> bool:
    """Whether the current (or ``parent``) context is a trace the sampler dropped: its children are dropped too
    (parent-based sampling), so they are not even made (a span per tool call costs every call otherwise)."""
    if parent is None and _quiet.get():
        return True
    from opentelemetry import trace

    context = trace.get_current_span(parent).get_span_context()
    return context.is_valid and not context.trace_flags.sampled


def span(name: str, attributes: dict[str, Any] | None = None, **options: Any) -> contextlib.AbstractContextManager[Any]:
    """A span (a do-nothing context, entered as None, when tracing is off or the trace is not sampled)."""
    if not _enabled or _unsampled_parent():
        return _NOTHING
    return tracer().start_as_current_span(name, attributes=attributes, **options)


class _Nothing:
    """A context manager that does nothing (cheaper than an empty generator-based one)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


_NOTHING = _Nothing()


def tool_call(tool: str, metric: str) -> contextlib.AbstractContextManager[Any]:
    """A ``tool <name>`` span and a latency sample in ``metric`` for one tool call; when neither would be recorded
    (tracing off or the trace not sampled, metrics off), a do-nothing context: tool calls are the messages a
    loaded EnvService handles thousands of per second."""
    if (not _enabled or _unsampled_parent()) and _meter is None:
        return _NOTHING
    return _tool_call(tool, metric)


@contextlib.contextmanager
def _tool_call(tool: str, metric: str) -> Iterator[None]:
    with span(f"tool {tool}", {"yieldloop.tool": tool}), timed(metric, {"tool": tool}, "tool call latency"):
        yield


@contextlib.contextmanager
def episode_span(trace_id: str, attributes: dict[str, Any]) -> Iterator[Any]:
    """The root span of an episode's own trace (its id is the run's ``trace_id``), linked to the span that
    asked for it (StreamRollouts)."""
    if not _enabled:
        yield None
        return
    from opentelemetry import context, trace

    parent = trace.get_current_span().get_span_context()
    links = [trace.Link(parent)] if parent.is_valid else []
    ids = ids_of(trace_id)
    token = _preset.set(ids) if ids else None
    try:
        with tracer().start_as_current_span(
            "episode", context=context.Context(), links=links, attributes=attributes
        ) as current:
            if token is not None:
                _preset.reset(token)
                token = None
            quiet = _quiet.set(not current.is_recording())  # the episode's own sampling, not its caller's
            try:
                yield current
            finally:
                _quiet.reset(quiet)
    finally:
        if token is not None:
            _preset.reset(token)


def run_links(trace_ids: Sequence[str]) -> list[Any]:
    """Links to the episode traces of runs (a training step's spans point to what they trained on)."""
    if not _enabled:
        return []
    from opentelemetry import trace

    links = []
    for trace_id in dict.fromkeys(trace_ids):
        ids = ids_of(trace_id)
        if ids:
            links.append(
                trace.Link(
                    trace.SpanContext(
                        ids[0], ids[1], is_remote=True, trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED)
                    )
                )
            )
    return links


def record_error(code: str, reason: str, message: str) -> None:
    """Marks the current span failed with a gRPC status (the servicer boundary calls it before aborting)."""
    if not _enabled:
        return
    from opentelemetry import trace

    current = trace.get_current_span()
    current.set_status(trace.Status(trace.StatusCode.ERROR, f"{code}/{reason}: {message}"[:500]))
    current.set_attribute("rpc.grpc.status_code", code)
    current.set_attribute("yieldloop.error.reason", reason)


def inject() -> dict[str, str]:
    """The current context as W3C headers (to carry through a pipe or a queue)."""
    if not _enabled:
        return {}
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


@contextlib.contextmanager
def attached(carrier: dict[str, str] | None) -> Iterator[None]:
    """Runs the block in the context ``carrier`` carries (from :func:`inject`)."""
    if not _enabled or not carrier:
        yield
        return
    from opentelemetry import context, propagate

    token = context.attach(propagate.extract(carrier))
    try:
        yield
    finally:
        context.detach(token)


def in_context(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` bound to the current context (``run_in_executor`` would drop it in the worker thread)."""
    return functools.partial(contextvars.copy_context().run, fn)


def client_interceptors() -> list[Any]:
    """Client interceptors, one per call kind: a CLIENT span per call, ``traceparent`` in its metadata; [] when
    off. The span ends when the call does (its done callback), whatever the caller does with the responses:
    opentelemetry-instrumentation-grpc's aio client spans of a stream whose caller stops reading early and
    cancels (Generate, WatchHead, StreamEpisode after the grade) never end, so the server side's parent would
    never be exported."""
    if not _enabled:
        return []
    import grpc
    from opentelemetry import propagate, trace

    def start(details: grpc.aio.ClientCallDetails) -> tuple[Any, grpc.aio.ClientCallDetails]:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        service, _, name = method.strip("/").partition("/")
        span = tracer().start_span(
            f"{service}/{name}",
            kind=trace.SpanKind.CLIENT,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
        )
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        metadata = grpc.aio.Metadata(*tuple(details.metadata or ()), *carrier.items())
        return span, grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )

    def end_with(span: Any, call: Any) -> None:
        async def finish(finished: Any) -> None:
            try:
                code = await finished.code()
            except BaseException:
                code = grpc.StatusCode.CANCELLED
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
                span.set_status(trace.Status(trace.StatusCode.ERROR, code.name))
            span.end()

        def done(finished: Any) -> None:  # grpc.aio's code() is a coroutine: read it in a task
            task = asyncio.get_running_loop().create_task(finish(finished))
            _ending.add(task)
            task.add_done_callback(_ending.discard)

        call.add_done_callback(done)

    async def intercept(continuation: Any, details: Any, request: Any) -> Any:
        span, details = start(details)
        try:
            call = await continuation(details, request)
        except BaseException:
            span.end()
            raise
        end_with(span, call)
        return call

    class UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
        intercept_unary_unary = staticmethod(intercept)

    class UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
        intercept_unary_stream = staticmethod(intercept)

    class StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
        intercept_stream_unary = staticmethod(intercept)

    class StreamStream(grpc.aio.StreamStreamClientInterceptor):
        intercept_stream_stream = staticmethod(intercept)

    return [UnaryUnary(), UnaryStream(), StreamUnary(), StreamStream()]


class _MetadataGetter:
    def get(self, carrier: Sequence[tuple[str, str]], key: str) -> list[str] | None:
        values = [value for name, value in carrier if name == key]
        return values or None

    def keys(self, carrier: Sequence[tuple[str, str]]) -> list[str]:
        return [name for name, _ in carrier]


class Tracing:
    """The transport interceptor: a SERVER span around every call (health checks excepted)."""

    @contextlib.asynccontextmanager
    async def intercept(self, call: CallInfo) -> AsyncIterator[None]:
        from opentelemetry import propagate

        from yieldloop_server.common.auth import OPEN_METHODS

        if call.method.startswith(OPEN_METHODS):  # probes: no span
            yield
            return

        parent = propagate.extract(call.metadata, getter=_MetadataGetter())
        if call.protocol == "grpc":
            service, _, method = call.method.strip("/").partition("/")
            name, attributes = (
                f"{service}/{method}",
                {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method},
            )
        else:
            verb, _, path = call.method.partition(" ")
            name, attributes = call.method, {"http.request.method": verb, "url.path": path}
        with _server_span(parent, name, attributes) as current:
            try:
                yield
            except BaseException as exc:
                if current is not None:
                    _record_failure(current, exc)
                raise


def _record_failure(current: Any, exc: BaseException) -> None:
    from opentelemetry import trace

    from yieldloop.errors import YieldloopError

    if isinstance(exc, YieldloopError):
        record_error(exc.code, exc.reason, exc.message)
    elif isinstance(exc, (GeneratorExit, asyncio.CancelledError)):
        current.set_attribute("yieldloop.cancelled", True)  # the caller went away: not a failure
    elif current.status.is_unset:
        current.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))


@contextlib.contextmanager
def _server_span(parent: Any, name: str, attributes: dict[str, Any]) -> Iterator[Any]:
    """A SERVER span under ``parent`` (a caller's extracted context); when the caller's trace is not sampled, its
    context carried with no span (None). Spans made inside are quiet when this one does not record."""
    from opentelemetry import context, trace

    if _unsampled_parent(parent):
        token, quiet = context.attach(parent), _quiet.set(True)
        try:
            yield None
        finally:
            _quiet.reset(quiet)
            context.detach(token)
        return
    with tracer().start_as_current_span(
        name,
        context=parent,
        kind=trace.SpanKind.SERVER,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as current:
        quiet = _quiet.set(not current.is_recording())
        try:
            yield current
        finally:
            _quiet.reset(quiet)


@contextlib.contextmanager
def continued(carrier: dict[str, str], name: str, attributes: dict[str, Any] | None = None) -> Iterator[Any]:
    """A SERVER span for work that arrived inside a shared stream (one episode of StreamEpisodes), under the
    context its caller sent with it (``carrier``: W3C headers; none: a trace of its own), not the stream's.
    None when tracing is off or the caller's trace is not sampled."""
    if not _enabled:
        yield None
        return
    from opentelemetry import propagate

    with _server_span(propagate.extract(carrier), name, attributes or {}) as current:
        yield current


# Metrics ---------------------------------------------------------------------------------------------------

_meter: Any = None
_instruments: dict[str, Any] = {}
metrics_address = ""
"""``host:port`` of this process's Prometheus endpoint ("" when none)."""


def configure_metrics(service: str, host: str = "127.0.0.1", prometheus_port: int = 0) -> bool:
    """Installs a meter provider when ``OTEL_METRICS_EXPORTER`` names exporters (``otlp``, ``prometheus``,
    ``console``; default ``otlp`` when an OTLP endpoint is set): OTLP pushes every ``OTEL_METRIC_EXPORT_INTERVAL``
    ms, ``prometheus`` serves ``/metrics`` for scraping on ``prometheus_port`` (0: a free one; see
    :data:`metrics_address`). Returns whether metrics are on."""
    global _meter, metrics_address
    if _meter is not None:
        return True
    default = (
        "otlp"
        if (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"))
        else "none"
    )
    names = [n.strip() for n in os.environ.get("OTEL_METRICS_EXPORTER", default).split(",") if n.strip()]
    names = [n for n in names if n != "none"]
    if not names or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource

    readers: list[Any] = []
    for name in names:
        if name == "otlp":
            protocol = os.environ.get(
                "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
            )
            if protocol.startswith("http"):
                from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
            else:
                from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        elif name == "prometheus":
            import prometheus_client
            from opentelemetry.exporter.prometheus import PrometheusMetricReader

            readers.append(PrometheusMetricReader())
            server, _ = prometheus_client.start_http_server(prometheus_port, addr=host)
            metrics_address = f"{host}:{server.server_port}"
        elif name == "console":
            readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter()))
    resource = Resource.create(
        {"service.name": os.environ.get("OTEL_SERVICE_NAME") or f"yieldloop-{service}", "yieldloop.service": service}
    )
    provider = MeterProvider(resource=resource, metric_readers=readers)
    metrics.set_meter_provider(provider)
    _meter = provider.get_meter("yieldloop")
    return True


def _instrument(kind: str, name: str, unit: str, description: str) -> Any:
    instrument = _instruments.get(name)
    if instrument is None:
        instrument = _instruments[name] = getattr(_meter, f"create_{kind}")(name, unit=unit, description=description)
    return instrument


def _measurer(kind: str, method: str, doc: str) -> Callable[..., None]:
    def measure(
        name: str, value: float, attributes: dict[str, Any] | None = None, *, unit: str = "1", description: str = ""
    ) -> None:
        if _meter is not None:
            getattr(_instrument(kind, name, unit, description), method)(value, attributes)

    measure.__doc__ = doc + " (a no-op without metrics)."
    return measure


count = _measurer("counter", "add", "Adds to a counter")
gauge_delta = _measurer("up_down_counter", "add", "Moves an up-down counter (things in flight)")
record = _measurer("histogram", "record", "Records a value >= 0 in a histogram (latencies, sizes)")
set_gauge = _measurer(
    "gauge",
    "set",
    "Sets a gauge to its latest value (losses, rewards: values that may be negative, which histograms drop)",
)


def observe(name: str, read: Callable[[], float], *, unit: str = "1", description: str = "") -> None:
    """A gauge read when metrics are collected (queue depths)."""
    if _meter is None:
        return
    from opentelemetry.metrics import Observation

    _meter.create_observable_gauge(
        name, callbacks=[lambda options: [Observation(read())]], unit=unit, description=description
    )


def in_flight(
    name: str, attributes: dict[str, Any] | None = None, description: str = ""
) -> contextlib.AbstractContextManager[None]:
    """Counts the block as in flight while it runs (a do-nothing context when metrics are off)."""
    if _meter is None:
        return _NOTHING
    return _in_flight(name, attributes, description)


@contextlib.contextmanager
def _in_flight(name: str, attributes: dict[str, Any] | None, description: str) -> Iterator[None]:
    gauge_delta(name, 1, attributes, description=description)
    try:
        yield
    finally:
        gauge_delta(name, -1, attributes, description=description)


@contextlib.contextmanager
def timed(name: str, attributes: dict[str, Any] | None = None, description: str = "") -> Iterator[None]:
    """Records the block's duration in seconds."""
    if _meter is None:
        yield
        return
    import time

    started = time.perf_counter()
    try:
        yield
    finally:
        record(name, time.perf_counter() - started, attributes, unit="s", description=description)
