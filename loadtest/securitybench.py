"""What auth and tracing cost: EnvService saturation (2048 episodes) and Generate at 64 streams, each under four
settings measured in one run, interleaved round by round:

- ``off``: no auth, no tracing (``--no-auth``, no OTEL variables);
- ``auth``: API keys checked on every call (the default);
- ``auth+trace100``: auth, and every call and episode traced (``OTEL_TRACES_SAMPLER=always_on``), spans exported
  by OTLP to a sink in its own process;
- ``auth+trace1``: auth, and 1% of traces sampled (``parentbased_traceidratio``, 0.01): what a production fleet
  runs.

EnvService runs in its own process per setting (``yieldloop serve env``); Generate is served from this
process by one torch engine behind one gRPC server per setting (the sampler is switched between settings).
Ratios are calls/s (tokens/s) of each setting over ``off`` in the same round, median over rounds. Goal: auth
costs <= 3%, tracing at 1% <= 5%.

    python loadtest/securitybench.py [--rounds 5] [--episodes 2048] [--out securitybench.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import envbench
import generatebench
from scratch import scratch_dir

SETTINGS = ("off", "auth", "auth+trace100", "auth+trace1")
SAMPLERS = {"auth+trace100": ("always_on", ""), "auth+trace1": ("parentbased_traceidratio", "0.01")}


async def otlp_sink(ready_file: pathlib.Path) -> None:
    """An OTLP TraceService that accepts and drops every span (a collector that keeps up)."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Sink(trace_service_pb2_grpc.TraceServiceServicer):
        async def Export(self, request, context):
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Sink(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ready_file.write_text(json.dumps({"address": f"127.0.0.1:{port}"}))
    await server.wait_for_termination()


def otel_environment(setting: str, sink: str) -> dict[str, str]:
    if setting not in SAMPLERS:
        return {}
    sampler, arg = SAMPLERS[setting]
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{sink}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_TRACES_SAMPLER": sampler,
        "OTEL_TRACES_SAMPLER_ARG": arg,
        "OTEL_METRICS_EXPORTER": "none",
    }


def rotated(round_no: int) -> tuple[str, ...]:
    """The settings in a different order each round (no setting always runs first, or right after another)."""
    shift = round_no % len(SETTINGS)
    return SETTINGS[shift:] + SETTINGS[:shift]


async def env_round(servers: dict, keys: dict, args: argparse.Namespace, round_no: int) -> dict[str, float]:
    out = {}
    for setting in rotated(round_no):
        from yieldloop.client import Client

        clients = [Client(env=servers[setting].address, api_key=keys[setting])]
        stats = envbench.Stats()
        try:
            result = await envbench.run_agents(
                lambda i: envbench.our_agent(clients[0], args.calls, None, stats),
                args.episodes,
                args.timeout,
                servers[setting],
                stats,
            )
        finally:
            await clients[0].close()
        if result["num_errors"]:
            raise RuntimeError(f"{setting}: {result['errors']} {result['error_samples']}")
        out[setting] = result["tool_calls_per_s"]
    return out


async def generate_round(clients: dict, prompt: list[int], args: argparse.Namespace, round_no: int) -> dict[str, float]:
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBasedTraceIdRatio

    out = {}
    for setting in rotated(round_no):
        if setting in SAMPLERS:  # the in-process server's sampler for this setting
            from yieldloop_server.common import telemetry

            telemetry.tracer().sampler = {"auth+trace100": ALWAYS_ON, "auth+trace1": ParentBasedTraceIdRatio(0.01)}[
                setting
            ]
        started = time.perf_counter()
        tokens = await generatebench._grpc(clients[setting], [prompt] * args.streams, args.streams, args.max_tokens, [])
        out[setting] = tokens / (time.perf_counter() - started)
    return out


async def bench(args: argparse.Namespace) -> dict:
    from yieldloop.client import Client
    from yieldloop.transport import TransportConfig
    from yieldloop_server.common import telemetry
    from yieldloop_server.common.auth import Authenticator, KeyStore
    from yieldloop_server.config import EnvOptions, RolloutOptions, ServeOptions
    from yieldloop_server.rollout.engines import create_engine
    from yieldloop_server.rollout.server import serve_engine
    from yieldloop_server.stack import ensure_stack_keys
    from yieldloop_server.store import open_store

    workdir = scratch_dir("yl-securitybench-")
    store = open_store(str(workdir / "store"))
    admin, _ = ensure_stack_keys(store, workdir)
    sink = envbench.ServerProcess([__file__, "otlp-sink"], workdir, "sink")
    await sink.__aenter__()
    servers: dict[str, envbench.ServerProcess] = {}
    keys = {setting: "" if setting == "off" else admin for setting in SETTINGS}
    try:
        for setting in SETTINGS:  # each EnvService in its own process, with its own environment
            options = ServeOptions(
                service="env",
                data_dir=workdir,
                auth=setting != "off",
                env=EnvOptions(specs=("yieldloop.envs.bench:env",), workers=0),
            )
            saved = dict(os.environ)
            os.environ.update(otel_environment(setting, sink.address))
            try:
                servers[setting] = envbench.ServerProcess(
                    ["-m", "yieldloop.cli", *options.to_args()], workdir, setting.replace("+", "-")
                )
                await servers[setting].__aenter__()
            finally:
                os.environ.clear()
                os.environ.update(saved)

        # Generate: one engine, four servers in this process (tracing installed once, its sampler switched).
        os.environ.update(otel_environment("auth+trace100", sink.address))
        telemetry.configure("rollout")
        folder = generatebench.make_model("tiny", workdir / "model")
        engine = create_engine("torch")
        await engine.load_weights(folder, "bench")
        authenticated = (Authenticator(KeyStore(store)),)
        transports = {
            "off": TransportConfig(),
            "auth": TransportConfig(server_interceptors=authenticated),
            "auth+trace100": TransportConfig(server_interceptors=(telemetry.Tracing(), *authenticated)),
            "auth+trace1": TransportConfig(server_interceptors=(telemetry.Tracing(), *authenticated)),
        }
        interval = RolloutOptions.stream_interval_ms / 1000  # the rollout service's default
        generate_servers = {
            s: await serve_engine("bench", engine, stream_interval_s=interval, transport=transports[s])
            for s in SETTINGS
        }
        clients = {s: Client(rollout=generate_servers[s].address, api_key=keys[s], timeout=600) for s in SETTINGS}
        prompt = engine.render_chat([{"role": "user", "content": "Write the letter a over and over."}])
        for client in clients.values():
            await generatebench._grpc(client, [prompt] * 2, 2, 4, [])  # warm up

        env_rounds, generate_rounds = [], []
        for round_no in range(args.rounds):
            env_rounds.append(await env_round(servers, keys, args, round_no))
            generate_rounds.append(await generate_round(clients, prompt, args, round_no))
            print(
                f"round {round_no + 1}: env calls/s {env_rounds[-1]}; generate tok/s "
                f"{ {k: round(v) for k, v in generate_rounds[-1].items()} }",
                flush=True,
            )
        for client in clients.values():
            await client.close()
        for server in generate_servers.values():
            await server.stop(1)
        await engine.close()
    finally:
        for server in servers.values():
            await server.__aexit__(None, None, None)
        await sink.__aexit__(None, None, None)

    def summary(rounds: list[dict[str, float]]) -> dict:
        return {
            setting: {
                "median": round(statistics.median(r[setting] for r in rounds), 1),
                "ratio_to_off": round(statistics.median(r[setting] / r["off"] for r in rounds), 3),
                "rounds": [round(r[setting], 1) for r in rounds],
            }
            for setting in SETTINGS
        }

    return {
        "episodes": args.episodes,
        "calls": args.calls,
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "envservice_calls_per_s": summary(env_rounds),
        "generate_tokens_per_s": summary(generate_rounds),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="bench", choices=("bench", "otlp-sink"))
    parser.add_argument("--episodes", type=int, default=2048)
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--streams", type=int, default=64, help="concurrent Generate streams")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("securitybench.json"))
    parser.add_argument("--ready-file", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.command == "otlp-sink":
        asyncio.run(otlp_sink(args.ready_file))
        return 0
    results = asyncio.run(bench(args))
    for name in ("envservice_calls_per_s", "generate_tokens_per_s"):
        print(name)
        for setting, row in results[name].items():
            print(f"  {setting:14} {row['median']:10.1f}  x{row['ratio_to_off']:.3f} of off  rounds {row['rounds']}")
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
