"""Load harness for EnvService: N concurrent scripted-agent episodes through the real gRPC service.

Each episode (``yieldloop.envs.bench``): start, ``--calls`` tool calls, submit. In the same run, on the same
machine, it measures two references with the same message pattern:

- ``inprocess``: the workload driven straight into the episode host, without gRPC;
- ``echo``: a bare ``grpc.aio`` bidi server that echoes the very same request bytes;

and our EnvService three times: environment code in the service's process (``ours``), in worker processes
(``ours-workers``), and ``ours-processes``: ``--env-processes`` processes serving one port (SO_REUSEPORT), each
with its environment code in-process, the client's episodes spread over ``--env-connections`` connections.
Then the same episodes multiplexed over one StreamEpisodes stream per client
(``Client(multiplex_episodes=True)``, as RolloutService opens them): ``echo-multiplexed``, the echo server
answering each frame with an empty response frame (no episode work), and ``ours-multiplexed`` (in-process
environment code). Servers run in their own processes (loopback only) so their memory is measured alone.

Modes: ``saturation`` (no think time) and ``agent-pace`` (each agent waits 0.5-1.5 s before each call).

Usage::

    python loadtest/envbench.py --mode saturation [--episodes 2048] [--calls 8] [--out result.json]
    python loadtest/envbench.py --mode agent-pace
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import pathlib
import random
import signal
import statistics
import sys
import time
from typing import Any

import grpc

import yieldloop  # noqa: F401  (sets gRPC's fork handling before grpc loads)

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from scratch import scratch_dir

ECHO_SERVICE = "yieldloop.loadtest.Echo"
ECHO_METHOD = f"/{ECHO_SERVICE}/Stream"
RUNS = ("inprocess", "echo", "ours", "ours-workers", "ours-processes", "echo-multiplexed", "ours-multiplexed")
# What each run is compared with (per round): the echo of its own protocol, and the per-stream echo.
BASES = {
    "ours": ("echo", "inprocess"),
    "ours-workers": ("echo", "inprocess"),
    "ours-processes": ("echo", "inprocess"),
    "ours-multiplexed": ("echo-multiplexed", "echo", "inprocess"),
}


# Measuring -------------------------------------------------------------------------------------------


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of a process and its children (worker processes), from /proc."""

    def rss(p: int) -> int:
        try:
            for line in pathlib.Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except (FileNotFoundError, ProcessLookupError):
            pass
        return 0

    total = rss(pid)
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[1]) == pid:
            total += rss(int(stat.parent.name))
    return total


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its children so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):  # the process itself is one of them
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if stat.parent.name == str(pid) or int(fields[1]) == pid:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


class Stats:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.errors: collections.Counter[str] = collections.Counter()
        self.samples: dict[str, str] = {}
        self.episodes_ok = 0

    def record_error(self, exc: BaseException) -> None:
        code = getattr(exc, "code", None)
        if callable(code):  # a raw grpc error
            code = code().name
        reason = getattr(exc, "reason", "")
        kind = f"{code}/{reason}" if code else type(exc).__name__
        self.errors[kind] += 1
        self.samples.setdefault(kind, str(exc)[:300])


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# Servers in their own processes ------------------------------------------------------------------------


def _message_type() -> Any:
    from yieldloop.proto.env.v1 import env_service_pb2 as env_pb

    return env_pb.StreamEpisodeRequest


async def echo_server(ready_file: pathlib.Path) -> None:
    """A bare grpc.aio bidi server that echoes each message back (the baseline).

    It parses and re-serializes the same protobuf messages our EnvService receives, as any real
    service must, and does nothing else.
    """
    from yieldloop.transport import TransportConfig

    async def stream(request_iterator: Any, context: Any) -> Any:
        async for request in request_iterator:
            yield request

    from yieldloop.proto.env.v1 import env_service_pb2 as env_pb

    async def frames(request_iterator: Any, context: Any) -> Any:  # StreamEpisodes, no episode behind it
        empty = env_pb.StreamEpisodeResponse()
        async for request in request_iterator:
            yield env_pb.StreamEpisodesResponse(
                frames=[
                    env_pb.EpisodeResponseFrame(
                        tag=f.tag, closed=f.close, response=empty if f.HasField("request") else None
                    )
                    for f in request.frames
                ]
            )

    message = _message_type()
    method = grpc.stream_stream_rpc_method_handler(
        stream, request_deserializer=message.FromString, response_serializer=message.SerializeToString
    )
    multiplexed = grpc.stream_stream_rpc_method_handler(
        frames,
        request_deserializer=env_pb.StreamEpisodesRequest.FromString,
        response_serializer=env_pb.StreamEpisodesResponse.SerializeToString,
    )
    # The same transport settings as our services: the comparison is about what happens per message.
    server = grpc.aio.server(options=TransportConfig().server_options())
    handler = grpc.method_handlers_generic_handler(ECHO_SERVICE, {"Stream": method})
    # Where Client(multiplex_episodes=True) calls it.
    env_handler = grpc.method_handlers_generic_handler("yieldloop.env.v1.EnvService", {"StreamEpisodes": multiplexed})
    server.add_generic_rpc_handlers((handler, env_handler))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ready_file.write_text(json.dumps({"address": f"127.0.0.1:{port}"}))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(1)


class ServerProcess:
    def __init__(self, args: list[str], workdir: pathlib.Path, name: str) -> None:
        self.args, self.workdir, self.name = args, workdir, name
        self.process: asyncio.subprocess.Process | None = None
        self.address = ""

    async def __aenter__(self) -> ServerProcess:
        ready = self.workdir / f"{self.name}.ready"
        ready.unlink(missing_ok=True)
        log = open(self.workdir / f"{self.name}.log", "wb")
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            *self.args,
            "--ready-file",
            str(ready),
            stdout=log,
            stderr=log,
            stdin=asyncio.subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 120
        while not ready.exists():
            if self.process.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start; see {self.workdir / (self.name + '.log')}")
            await asyncio.sleep(0.05)
        self.address = json.loads(ready.read_text())["address"]
        return self

    @property
    def rss(self) -> int:
        return tree_rss_bytes(self.process.pid)

    async def __aexit__(self, *exc: object) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.process.wait(), 20)
        except TimeoutError:
            self.process.kill()


# Scripted agents ---------------------------------------------------------------------------------------


def request_payloads(calls: int) -> dict[str, Any]:
    """The StreamEpisodeRequests an agent sends, so the echo baseline moves the same messages."""
    from yieldloop.proto.common.v1 import common_pb2 as common_pb
    from yieldloop.proto.env.v1 import env_service_pb2 as env_pb

    task = common_pb.Task(env="bench", scenario="walk", args_json=json.dumps({"n": calls}))
    return {
        "start": env_pb.StreamEpisodeRequest(start=env_pb.StartEpisode(task=task)),
        "call": env_pb.StreamEpisodeRequest(
            call_tool=env_pb.CallTool(call_id="c", name="step", arguments_json='{"by": 1}')
        ),
        "submit": env_pb.StreamEpisodeRequest(submit=env_pb.SubmitAnswer(answer=str(calls))),
    }


async def think(pace: tuple[float, float] | None) -> None:
    if pace is not None:
        await asyncio.sleep(random.uniform(*pace))


async def our_agent(
    client: Any, calls: int, pace: tuple[float, float] | None, stats: Stats, graded: bool = True
) -> None:
    """One episode through the client (``graded=False``: against the echo, which grades nothing)."""
    from yieldloop.proto.common.v1 import common_pb2 as common_pb

    episode = client.episode(common_pb.Task(env="bench", scenario="walk", args_json=json.dumps({"n": calls})))
    try:
        await think(pace)
        await episode.start()
        for _ in range(calls):
            await think(pace)
            started = time.perf_counter()
            result = await episode.call_tool("step", '{"by": 1}')
            stats.latencies.append(time.perf_counter() - started)
            if result.is_error:
                stats.errors["tool_error"] += 1
        await think(pace)
        grade = await episode.submit(str(calls))
        if graded and grade.reward != 1.0:
            stats.errors["wrong_reward"] += 1
        else:
            stats.episodes_ok += 1
    except Exception as exc:  # counted by kind: the harness reports errors, it does not stop on them
        stats.record_error(exc)
    finally:
        await episode.close()


async def echo_agent(
    channel: Any, payloads: dict[str, Any], calls: int, pace: tuple[float, float] | None, stats: Stats
) -> None:
    message = _message_type()
    call = channel.stream_stream(
        ECHO_METHOD, request_serializer=message.SerializeToString, response_deserializer=message.FromString
    )()
    try:
        await think(pace)
        await call.write(payloads["start"])
        await call.read()
        for _ in range(calls):
            await think(pace)
            started = time.perf_counter()
            await call.write(payloads["call"])
            await call.read()
            stats.latencies.append(time.perf_counter() - started)
        await think(pace)
        await call.write(payloads["submit"])
        await call.read()
        await call.done_writing()
        if await call.code() != grpc.StatusCode.OK:
            raise RuntimeError(f"echo stream ended with {await call.code()}")
        stats.episodes_ok += 1
    except Exception as exc:
        stats.record_error(exc)
    finally:
        call.cancel()


async def inprocess_agent(host: Any, index: int, calls: int, pace: tuple[float, float] | None, stats: Stats) -> None:
    key = f"e{index}"
    try:
        await think(pace)
        await host.open("bench", "walk", {"n": calls}, key)
        for _ in range(calls):
            await think(pace)
            started = time.perf_counter()
            json.loads('{"by": 1}')  # the service parses arguments too
            await host.call_tool(key, "step", {"by": 1})
            stats.latencies.append(time.perf_counter() - started)
        await think(pace)
        grade = await host.submit(key, str(calls))
        stats.episodes_ok += grade.reward == 1.0
    except Exception as exc:
        stats.record_error(exc)
    finally:
        await host.close(key)


# Runs ----------------------------------------------------------------------------------------------------


async def run_agents(
    make_agent: Any, episodes: int, timeout_s: float, server: ServerProcess | None, stats: Stats
) -> dict:
    rss_before = server.rss if server else 0
    peak = rss_before

    async def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, server.rss)
            await asyncio.sleep(0.1)

    sampler = asyncio.create_task(sample()) if server else None
    server_cpu = tree_cpu_s(server.process.pid) if server else 0.0
    client_cpu = sum(os.times()[:2])
    started = time.perf_counter()
    tasks = [asyncio.create_task(make_agent(i)) for i in range(episodes)]
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    if pending:
        stats.errors["timeout"] += len(pending)
    wall = time.perf_counter() - started
    client_cpu = sum(os.times()[:2]) - client_cpu
    server_cpu = (tree_cpu_s(server.process.pid) - server_cpu) if server else 0.0
    if sampler:
        sampler.cancel()
        await asyncio.sleep(0.5)  # let the server finish tearing down
    rss_after = server.rss if server else 0
    result = {
        "episodes": episodes,
        "episodes_ok": stats.episodes_ok,
        "tool_calls": len(stats.latencies),
        "wall_s": round(wall, 3),
        "episodes_per_s": round(stats.episodes_ok / wall, 1),
        "tool_calls_per_s": round(len(stats.latencies) / wall, 1),
        "latency_ms": {
            q: round(percentile(stats.latencies, v) * 1000, 2) for q, v in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
        },
        "errors": dict(stats.errors),
        "error_samples": stats.samples,
        "num_errors": sum(stats.errors.values()),
        "client_cpu_us_per_call": round(client_cpu / max(len(stats.latencies), 1) * 1e6, 1),
        "client_cpu_us_per_episode": round(client_cpu / max(stats.episodes_ok, 1) * 1e6, 1),
    }
    if server:
        result["server_rss_mb"] = {
            k: round(v / 2**20, 1) for k, v in (("before", rss_before), ("peak", peak), ("after", rss_after))
        }
        result["server_cpu_us_per_call"] = round(server_cpu / max(len(stats.latencies), 1) * 1e6, 1)
        result["server_cpu_us_per_episode"] = round(server_cpu / max(stats.episodes_ok, 1) * 1e6, 1)
        result["server_rss_kb_per_live_episode"] = round((peak - rss_before) / episodes / 1024, 1)
    return result


def make_clients(
    address: str, episodes: int, streams_per_channel: int, multiplex: bool = False, connections: int = 1
) -> list[Any]:
    from yieldloop.client import Client
    from yieldloop.transport import TransportConfig

    count = max(1, math.ceil(episodes / streams_per_channel))
    transport = TransportConfig(env_connections=connections)
    return [Client(env=address, multiplex_episodes=multiplex, transport=transport) for _ in range(count)]


def rate_key(calls: int) -> str:
    """What runs are compared by: tool calls/s, or episodes/s when episodes make no tool calls."""
    return "tool_calls_per_s" if calls else "episodes_per_s"


def median_round(rounds: list[dict], key: str) -> dict:
    """The round with the median rate (its latencies come with it), with every round's rate."""
    ordered = sorted(rounds, key=lambda r: r[key])
    result = dict(ordered[(len(ordered) - 1) // 2])
    result["rounds_rate"] = [r[key] for r in rounds]
    result["num_errors"] = sum(r["num_errors"] for r in rounds)
    result["errors"] = dict(sum((collections.Counter(r["errors"]) for r in rounds), collections.Counter()))
    if "server_rss_mb" in rounds[0]:
        # Memory from the first round, when the server process was fresh: later rounds reuse the
        # arenas CPython kept, which would understate the growth per live episode.
        for key in ("server_rss_mb", "server_rss_kb_per_live_episode"):
            result[key] = rounds[0][key]
    return result


async def bench(args: argparse.Namespace) -> dict:
    """Runs every variant ``args.rounds`` times, interleaved, so a slower spell of this shared machine
    falls on all of them; ratios are per round (ours and echo back to back), then the median."""
    from yieldloop.transport import open_channel
    from yieldloop_server.config import EnvOptions, ServeOptions
    from yieldloop_server.env.inprocess import InProcessHost
    from yieldloop_server.env.loader import load_environment

    pace = (args.think_min, args.think_max) if args.mode == "agent-pace" else None
    workdir = scratch_dir("yl-envbench-")
    n_channels = max(1, math.ceil(args.episodes / args.streams_per_channel))

    host = InProcessHost([load_environment("yieldloop.envs.bench:env")])
    await host.start()

    async def inprocess() -> dict:
        stats = Stats()
        return await run_agents(
            lambda i: inprocess_agent(host, i, args.calls, pace, stats), args.episodes, args.timeout, None, stats
        )

    async def echo(server: ServerProcess) -> dict:
        channels = [open_channel(server.address) for _ in range(n_channels)]
        payloads, stats = request_payloads(args.calls), Stats()
        try:
            return await run_agents(
                lambda i: echo_agent(channels[i % len(channels)], payloads, args.calls, pace, stats),
                args.episodes,
                args.timeout,
                server,
                stats,
            )
        finally:
            for channel in channels:
                await channel.close()

    async def ours(server: ServerProcess, multiplex: bool = False, graded: bool = True, connections: int = 1) -> dict:
        clients = make_clients(server.address, args.episodes, args.streams_per_channel, multiplex, connections)
        stats = Stats()
        try:
            return await run_agents(
                lambda i: our_agent(clients[i % len(clients)], args.calls, pace, stats, graded),
                args.episodes,
                args.timeout,
                server,
                stats,
            )
        finally:
            for client in clients:
                await client.close()

    def our_server(name: str, workers: int, processes: int = 1) -> ServerProcess:
        options = ServeOptions(
            service="env",
            data_dir=workdir / name,
            auth=False,
            env=EnvOptions(specs=("yieldloop.envs.bench:env",), workers=workers, processes=processes),
        )
        return ServerProcess(["-m", "yieldloop.cli", *options.to_args()], workdir, name)

    rounds: dict[str, list[dict]] = {name: [] for name in RUNS}
    async with (
        ServerProcess([__file__, "echo-server"], workdir, "echo") as echo_server,
        our_server("ours", 0) as ours_server,
        our_server("ours-workers", args.env_workers) as workers_server,
        our_server("ours-processes", 0, args.env_processes) as processes_server,
    ):
        for _ in range(args.rounds):
            rounds["inprocess"].append(await inprocess())
            rounds["echo"].append(await echo(echo_server))
            rounds["ours"].append(await ours(ours_server))
            rounds["ours-workers"].append(await ours(workers_server))
            rounds["ours-processes"].append(await ours(processes_server, connections=args.env_connections))
            rounds["echo-multiplexed"].append(await ours(echo_server, multiplex=True, graded=False))
            rounds["ours-multiplexed"].append(await ours(ours_server, multiplex=True))

    results: dict[str, Any] = {
        "mode": args.mode,
        "episodes": args.episodes,
        "calls_per_episode": args.calls,
        "rounds": args.rounds,
    }
    key = rate_key(args.calls)
    results.update({name: median_round(runs, key) for name, runs in rounds.items()})
    for name, bases in BASES.items():
        for base in bases:
            per_round = [
                ours_run[key] / base_run[key] for ours_run, base_run in zip(rounds[name], rounds[base]) if base_run[key]
            ]
            results[name][f"rounds_vs_{base}"] = [round(r, 3) for r in per_round]
            results[name][f"rate_vs_{base}"] = round(statistics.median(per_round), 3) if per_round else None
    return results


def print_results(results: dict) -> None:
    per = "call" if results["calls_per_episode"] else "episode"
    print(
        f"mode={results['mode']} episodes={results['episodes']} calls/episode={results['calls_per_episode']} "
        f"rounds={results['rounds']} "
        f"(the median round of each run; ratios, of {per}s/s, are medians of per-round ratios)"
    )
    header = (
        f"{'run':<18}{'eps/s':>9}{'calls/s':>10}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}{'errors':>8}"
        f"{'RSS MB before/peak/after':>27}{'KB/ep':>8}{f'CPU us/{per} srv+cli':>24}"
        f"{'vs echo':>9}{'vs echo-mux':>12}{'vs inproc':>10}"
    )
    print(header)
    for name in RUNS:
        r = results[name]
        rss = r.get("server_rss_mb")
        rss_text = f"{rss['before']}/{rss['peak']}/{rss['after']}" if rss else "-"
        cpu = f"{r.get(f'server_cpu_us_per_{per}', 0):.0f}+{r[f'client_cpu_us_per_{per}']:.0f}"
        print(
            f"{name:<18}{r['episodes_per_s']:>9}{r['tool_calls_per_s']:>10}{r['latency_ms']['p50']:>9}"
            f"{r['latency_ms']['p95']:>9}{r['latency_ms']['p99']:>9}{r['num_errors']:>8}{rss_text:>27}"
            f"{r.get('server_rss_kb_per_live_episode', '-'):>8}{cpu:>24}"
            f"{str(r.get('rate_vs_echo', '-')):>9}{str(r.get('rate_vs_echo-multiplexed', '-')):>12}"
            f"{str(r.get('rate_vs_inprocess', '-')):>10}"
        )
    for name in RUNS:
        line = f"  {name}: {per}s/s by round {results[name]['rounds_rate']}"
        if "rounds_vs_echo" in results[name]:
            line += f", vs echo by round {results[name]['rounds_vs_echo']}"
        if "rounds_vs_echo-multiplexed" in results[name]:
            line += f", vs echo-multiplexed by round {results[name]['rounds_vs_echo-multiplexed']}"
        print(line)
    for name in RUNS:
        if results[name]["errors"]:
            print(f"errors in {name}: {results[name]['errors']} e.g. {results[name]['error_samples']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="bench", choices=("bench", "echo-server"))
    parser.add_argument("--mode", choices=("saturation", "agent-pace"), default="saturation")
    parser.add_argument("--episodes", type=int, default=2048)
    parser.add_argument("--calls", type=int, default=8, help="tool calls per episode")
    parser.add_argument("--think-min", type=float, default=0.5)
    parser.add_argument("--think-max", type=float, default=1.5)
    parser.add_argument("--env-workers", type=int, default=2, help="worker processes for the ours-workers run")
    parser.add_argument("--env-processes", type=int, default=2, help="server processes of the ours-processes run")
    parser.add_argument(
        "--env-connections",
        type=int,
        default=16,
        help="client connections of the ours-processes run (the kernel places each on a process)",
    )
    parser.add_argument("--streams-per-channel", type=int, default=2048, help="streams on one client channel")
    parser.add_argument("--timeout", type=float, default=300.0, help="bound on each run, seconds")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every run; medians reported")
    parser.add_argument("--out", type=pathlib.Path, help="write the results as JSON here")
    parser.add_argument("--ready-file", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    if args.command == "echo-server":
        run(echo_server(args.ready_file))
        return 0
    results = run(bench(args))
    print_results(results)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
