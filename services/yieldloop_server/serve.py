"""Runs one service in this process until SIGTERM/SIGINT (``yieldloop serve <service>``)."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import importlib
import json
import logging
import os
import pathlib
import signal

from yieldloop.transport import TransportConfig
from yieldloop_server.common import telemetry, write_file_atomically
from yieldloop_server.common.auth import SERVICE_TEAM, Authenticator, KeyStore, split_key
from yieldloop_server.common.service import Service
from yieldloop_server.config import ServeOptions
from yieldloop_server.store import ObjectStore

log = logging.getLogger(__name__)


def secured_transport(opts: ServeOptions, store: ObjectStore) -> tuple[TransportConfig, KeyStore | None]:
    """The service's transport with auth, and the key store it checks keys against: its servers check every
    call's key (:class:`Authenticator`), and its clients call the other services with the service key.
    Unchanged (and no key store) with ``--no-auth``, which is said loudly."""
    if not opts.auth:
        log.warning(
            "%s: AUTH IS OFF (--no-auth): anyone who reaches %s:%s may call every RPC, train and move the "
            "head of any model and read every run",
            opts.service,
            opts.host,
            opts.port or "its port",
        )
        return opts.transport, None
    keys = KeyStore(store)
    # A deployment hands its keys in from Secrets (made with `yieldloop keys mint`): registered here when new.
    admin_key = os.environ.get("YIELDLOOP_ADMIN_KEY", "")
    if admin_key and keys.check(admin_key) is None:
        keys.adopt(admin_key, SERVICE_TEAM, "admin", name="the deployment's admin key (YIELDLOOP_ADMIN_KEY)")
    service_key = opts.service_key or os.environ.get("YIELDLOOP_SERVICE_KEY", "")
    if service_key and keys.check(service_key) is None and split_key(service_key) is not None:
        keys.adopt(service_key, SERVICE_TEAM, "service", name="the deployment's service key (YIELDLOOP_SERVICE_KEY)")
    if not service_key or keys.check(service_key) is None:
        _, service_key = keys.create(SERVICE_TEAM, "service", name=f"{opts.service} service (made at its start)")
    return dataclasses.replace(
        opts.transport,
        api_key=service_key,
        server_interceptors=(Authenticator(keys), *opts.transport.server_interceptors),
    ), keys


def traced_transport(service: str, transport: TransportConfig, record_spans_url: str = "") -> TransportConfig:
    """The transport with OpenTelemetry when the environment asks for it (OTEL_EXPORTER_OTLP_ENDPOINT, ...):
    a span around every call served, outermost (refusals are traced too), and traceparent on every call made."""
    if record_spans_url:  # read by configure, here and in the env's worker processes
        os.environ[telemetry.RECORD_SPANS_VARIABLE] = record_spans_url
    if not telemetry.configure(service):
        return transport
    return dataclasses.replace(
        transport,
        server_interceptors=(telemetry.Tracing(), *transport.server_interceptors),
        client_interceptors=(*telemetry.client_interceptors(), *transport.client_interceptors),
        trace_context=telemetry.inject,
    )


def _use_torch_threads(opts: ServeOptions) -> None:
    if opts.torch_threads:
        import torch

        torch.set_num_threads(opts.torch_threads)


SERVICES = {
    "checkpoint": "yieldloop_server.checkpoint.server",
    "env": "yieldloop_server.env.server",
    "trainer": "yieldloop_server.trainer.server",
    "rollout": "yieldloop_server.rollout.server",
    "hud": "yieldloop_server.hud.server",
}
"""Each service's wiring module: its ``build(options, store, transport, keys) -> Service`` reads its own options
(``options.<service>``) and the stack's shared ones (imported when that service is run: a process imports only
its own service)."""


async def build_service(opts: ServeOptions) -> Service:
    """Builds one service (not started) with the transport every service gets: auth (unless ``--no-auth``),
    tracing when the environment asks for it, metrics."""
    from yieldloop_server.store import open_store

    if opts.service not in SERVICES:
        raise ValueError(f"unknown service {opts.service!r}")
    _use_torch_threads(opts)
    store = open_store(opts.store_url)
    transport, keys = await asyncio.to_thread(secured_transport, opts, store)
    opts = dataclasses.replace(
        opts, transport=traced_transport(opts.service, transport, opts.store_url if opts.record_spans else "")
    )
    telemetry.configure_metrics(opts.service, opts.host, opts.metrics_port)
    return await importlib.import_module(SERVICES[opts.service]).build(opts, store, opts.transport, keys)


def settle_heap() -> None:
    """The garbage collector's policy of a started service's process. Thousands of live streams make the
    collector's default pace (a gen-0 pass every 700 allocations, full passes over every live object) a measurable
    share of each message, and a full pass over a process that imported torch and transformers (vLLM: ~1M objects)
    stops it for 0.3-0.6 s: what start-up made (modules, the loaded model) is frozen out of the collector's passes,
    and it collects less often."""
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)


async def serve(opts: ServeOptions) -> None:
    """Starts the service, writes the ready file, and stops gracefully on SIGTERM/SIGINT. A trainer rank > 0 that
    torchrun started serves nothing: it follows rank 0 (the TrainerService) until rank 0 stops."""
    if opts.service == "trainer":
        from yieldloop_server.trainer import distributed, server

        placed = distributed.launched()
        if placed is not None and placed[0] > 0:
            _use_torch_threads(opts)
            await server.follow(opts, placed[0], placed[1])
            return
    service = await build_service(opts)
    address = await service.start()
    settle_heap()
    if opts.ready_file is not None:
        write_ready_file(
            opts.ready_file,
            address,
            tls=bool(opts.transport.tls_cert),
            metrics=telemetry.metrics_address,
            **service.ports,
        )
    print(f"yieldloop {opts.service} serving on {address}", flush=True)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    log.info("stopping %s", opts.service)
    await service.stop(opts.grace_s)
    await asyncio.to_thread(telemetry.shutdown)  # the spans still queued are sent


def write_ready_file(path: pathlib.Path, address: str, tls: bool = False, metrics: str = "", **ports: int) -> None:
    """Atomically records a started service's address (whether it speaks TLS, where it serves metrics, the other
    ports it serves, and the OpenAI base URL when it serves one), with the process that serves them."""
    from yieldloop.stackdir import me

    urls = {}
    if ports.get("http_port"):
        urls["openai_base_url"] = f"{'https' if tls else 'http'}://{address.rsplit(':', 1)[0]}:{ports['http_port']}/v1"
    record = {"address": address, **me(), "tls": tls, "metrics": metrics, **ports, **urls}
    write_file_atomically(path, json.dumps(record))
