"""A pool of worker processes running environment code.

Each worker is a spawned process with its own event loop and an
:class:`~.inprocess.InProcessHost`; the service talks to it over a socket pair
with length-prefixed pickled ``(request_id, op, args)`` messages, through
asyncio streams on both sides, so a busy peer never blocks an event loop. Episodes go to the least-loaded worker.
A worker that dies (crash, ``os._exit``, a kill) or stops answering its
heartbeat fails only its own episodes, with UNAVAILABLE / WORKER_DIED (a
retryable status), and is replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import pickle
import socket
import time
from typing import Any

from yieldloop.environment import FinalCompletion, Grade, Prompt
from yieldloop.episode import protocol_error
from yieldloop.errors import UnavailableError, YieldloopError, as_yieldloop_error, error_from_wire
from yieldloop_server.common import telemetry
from yieldloop_server.env.host import EnvInfo, EpisodeHost

log = logging.getLogger(__name__)
_SPAWN = multiprocessing.get_context("spawn")  # never fork a process that runs gRPC threads


def _frame(message: Any) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return len(data).to_bytes(4, "big") + data


class _Outbox:
    """Frames for one peer, written together once per turn of the event loop: the frames of a burst (a rollout's
    episodes starting at once) leave in one write, a system call for all of them instead of one each. Buffered:
    a busy peer never blocks the loop."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self._frames: list[bytes] = []

    def put(self, message: Any) -> None:
        if not self._frames:
            asyncio.get_running_loop().call_soon(self.flush)
        self._frames.append(_frame(message))

    def flush(self) -> None:
        if self._frames:
            frames, self._frames = self._frames, []
            if not self.writer.is_closing():
                self.writer.write(b"".join(frames))


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    """The next message; asyncio.IncompleteReadError when the peer is gone."""
    size = int.from_bytes(await reader.readexactly(4), "big")
    return pickle.loads(await reader.readexactly(size))


def worker_main(sock: socket.socket, env_specs: tuple[str, ...]) -> None:
    """Entry point of a worker process."""
    from yieldloop_server.common import telemetry

    telemetry.configure("env-worker")
    try:
        try:
            import uvloop

            uvloop.run(_serve_worker(sock, env_specs))
        except ImportError:
            asyncio.run(_serve_worker(sock, env_specs))
    finally:
        telemetry.shutdown()


async def _serve_worker(sock: socket.socket, env_specs: tuple[str, ...]) -> None:
    from yieldloop_server.env.inprocess import InProcessHost
    from yieldloop_server.env.loader import load_environment

    reader, writer = await asyncio.open_unix_connection(sock=sock)
    try:
        host = InProcessHost([load_environment(spec) for spec in env_specs])
        await host.start()
    except Exception as err:  # said to the service (which reports it) before this process goes
        writer.write(_frame(("error", as_yieldloop_error(err).to_wire())))
        await writer.drain()
        await close_stream(writer)
        return
    writer.write(_frame(("ready", host.envs)))
    replies = _Outbox(writer)
    in_flight: dict[str, set[asyncio.Task]] = {}
    tasks: set[asyncio.Task] = set()

    async def handle(request_id: int, op: str, args: tuple, carrier: dict[str, str]) -> None:
        if op == "close":  # stop whatever this episode still runs before its teardown
            for task in in_flight.pop(args[0], set()):
                task.cancel()
        try:
            if op == "ping":
                result = None
            else:
                with telemetry.attached(carrier), telemetry.span(f"env-worker {op}"):
                    result = await getattr(host, op)(*args)
            reply = (request_id, True, result)
        except asyncio.CancelledError:
            return
        except Exception as err:  # report it to the service, keep the worker serving
            if not isinstance(err, YieldloopError):
                log.exception("worker op %s failed", op)
            reply = (request_id, False, as_yieldloop_error(err).to_wire())
        replies.put(reply)
        if op == "submit":  # the episode ended with its grade (sent first): its teardown, unasked and uncancelled
            in_flight.get(args[0], set()).discard(asyncio.current_task())
            try:
                with telemetry.attached(carrier), telemetry.span("env-worker close"):
                    await host.close(args[0])
            except Exception:  # deliberate: a failed teardown is logged, the worker keeps serving
                log.exception("teardown of episode %s failed", args[0])

    while True:
        try:
            message = await _read_frame(reader)
        except asyncio.IncompleteReadError:
            break  # the service went away
        if message is None:
            break
        request_id, op, args, carrier = message
        task = asyncio.create_task(handle(request_id, op, args, carrier))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        if op in ("open", "call_tool", "submit"):
            episode_tasks = in_flight.setdefault(args[0], set())
            episode_tasks.add(task)
            task.add_done_callback(episode_tasks.discard)
    await host.stop()
    replies.flush()
    await close_stream(writer)


async def close_stream(writer: asyncio.StreamWriter) -> None:
    """Closes a stream transport built on a Python socket, now rather than at garbage collection.

    Under uvloop such a transport and its socket object both hold the fd; if a
    collection finalises the socket first, the transport closes the same fd
    number again later, possibly someone else's file by then (uvloop #763).
    Closing the transport explicitly detaches the socket first.
    """
    writer.close()
    with contextlib.suppress(OSError, ConnectionError):
        await writer.wait_closed()


@dataclasses.dataclass(eq=False)
class _Worker:
    index: int
    process: Any
    writer: asyncio.StreamWriter
    outbox: _Outbox
    reader_task: asyncio.Task | None = None
    pending: dict[int, asyncio.Future] = dataclasses.field(default_factory=dict)
    episodes: set[str] = dataclasses.field(default_factory=set)
    last_pong: float = dataclasses.field(default_factory=time.monotonic)
    alive: bool = True


class WorkerPoolHost(EpisodeHost):
    """Episodes spread over ``num_workers`` processes.

    Args:
        env_specs: Environments each worker loads (``module:attr`` or ``file.py:attr``).
        num_workers: Pool size.
        hang_timeout_s: A worker silent for this long is killed and replaced.
        ready_timeout_s: How long a new worker may take to load the environments.
    """

    def __init__(
        self, env_specs: tuple[str, ...], num_workers: int, hang_timeout_s: float = 10.0, ready_timeout_s: float = 120.0
    ) -> None:
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        self.env_specs = tuple(env_specs)
        self.num_workers = num_workers
        self.hang_timeout_s = hang_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.envs: dict[str, EnvInfo] = {}
        self.workers: list[_Worker | None] = [None] * num_workers
        self.num_replaced = 0
        self._episode_worker: dict[str, _Worker] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._worker_ready = asyncio.Event()
        self._background: set[asyncio.Task] = set()

    # Lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.gather(*(self._spawn(i) for i in range(self.num_workers)))
        self._keep(self._watchdog())

    def _keep(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _spawn(self, index: int) -> None:
        parent, child = socket.socketpair()
        process = _SPAWN.Process(
            target=worker_main, args=(child, self.env_specs), daemon=True, name=f"env-worker-{index}"
        )
        await asyncio.to_thread(process.start)
        child.close()
        reader, writer = await asyncio.open_unix_connection(sock=parent)
        try:
            kind, payload = await asyncio.wait_for(_read_frame(reader), self.ready_timeout_s)
        except (asyncio.IncompleteReadError, TimeoutError) as err:
            await asyncio.to_thread(process.join, 2)  # its traceback reaches env.log before it is killed
            process.kill()
            writer.close()
            raise RuntimeError(f"environment worker {index} failed to start ({err!r}); see env.log") from None
        if kind == "error":
            await asyncio.to_thread(process.join, 5)
            writer.close()
            raise error_from_wire(payload)
        self.envs = payload
        worker = _Worker(index, process, writer, _Outbox(writer))
        worker.reader_task = asyncio.get_running_loop().create_task(self._read_replies(worker, reader))
        asyncio.get_running_loop().add_reader(process.sentinel, self._on_death, worker, "the process exited")
        self.workers[index] = worker
        self._worker_ready.set()
        log.info("environment worker %d ready (pid %d)", index, process.pid)

    async def stop(self) -> None:
        self._stopping = True
        for task in list(self._background):
            task.cancel()
        for worker in self.workers:
            if worker is not None and worker.alive:
                self._detach(worker)
                worker.outbox.put(None)
                worker.outbox.flush()
                with contextlib.suppress(OSError):
                    await worker.writer.drain()
        for worker in self.workers:
            if worker is not None:
                await asyncio.to_thread(worker.process.join, 5)
                if worker.process.is_alive():
                    worker.process.kill()
                await close_stream(worker.writer)

    # Messaging ---------------------------------------------------------------------------

    async def _read_replies(self, worker: _Worker, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                request_id, ok, payload = await _read_frame(reader)
            except (asyncio.IncompleteReadError, OSError):
                self._on_death(worker, "its connection closed")
                return
            future = worker.pending.pop(request_id, None)
            if future is not None and not future.done():
                future.set_result((ok, payload))

    async def _request(self, worker: _Worker, op: str, *args: Any) -> Any:
        if not worker.alive:
            raise UnavailableError(f"environment worker {worker.index} died", reason="WORKER_DIED")
        request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        worker.pending[request_id] = future
        try:
            # The caller's trace context travels with the request (the worker's spans are its children).
            worker.outbox.put((request_id, op, args, telemetry.inject()))
            ok, payload = await future
        finally:
            worker.pending.pop(request_id, None)
        if ok:
            return payload
        raise error_from_wire(payload)

    # Failure handling ------------------------------------------------------------------------

    def _detach(self, worker: _Worker) -> None:
        asyncio.get_running_loop().remove_reader(worker.process.sentinel)
        if worker.reader_task is not None and worker.reader_task is not asyncio.current_task():
            worker.reader_task.cancel()

    def _on_death(self, worker: _Worker, why: str) -> None:
        if not worker.alive:
            return
        worker.alive = False
        self._detach(worker)
        worker.writer.close()
        if worker.process.is_alive():
            worker.process.kill()
        log.error("environment worker %d died (%s); failing its %d episode(s)", worker.index, why, len(worker.episodes))
        error = UnavailableError(f"environment worker {worker.index} died ({why})", reason="WORKER_DIED")
        for future in worker.pending.values():
            if not future.done():
                future.set_exception(error)
        worker.pending.clear()
        if self.workers[worker.index] is worker:
            self.workers[worker.index] = None
        if not any(w is not None and w.alive for w in self.workers):
            self._worker_ready.clear()
        if not self._stopping:
            self.num_replaced += 1
            self._keep(self._spawn(worker.index))

    async def _watchdog(self) -> None:
        interval = min(1.0, self.hang_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for worker in list(self.workers):
                if worker is None or not worker.alive:
                    continue
                if now - worker.last_pong > self.hang_timeout_s:
                    self._on_death(worker, f"no heartbeat for {self.hang_timeout_s}s")
                else:
                    self._keep(self._ping(worker))

    async def _ping(self, worker: _Worker) -> None:
        with contextlib.suppress(UnavailableError):
            await self._request(worker, "ping")
            worker.last_pong = time.monotonic()

    # Episodes ----------------------------------------------------------------------------------

    async def _pick_worker(self) -> _Worker:
        alive = [w for w in self.workers if w is not None and w.alive]
        if not alive:
            try:
                await asyncio.wait_for(self._worker_ready.wait(), self.ready_timeout_s)
            except TimeoutError:
                raise UnavailableError("no environment worker is available", reason="WORKER_DIED") from None
            alive = [w for w in self.workers if w is not None and w.alive]
        return min(alive, key=lambda w: len(w.episodes))

    def _worker_of(self, episode_id: str) -> _Worker:
        worker = self._episode_worker.get(episode_id)
        if worker is None:
            raise protocol_error(f"no live episode {episode_id!r}")
        return worker

    async def open(self, env: str, scenario: str, args: dict[str, Any], episode_id: str) -> Prompt:
        if episode_id in self._episode_worker:
            raise protocol_error("the episode was already started")  # one episode per id
        worker = await self._pick_worker()
        self._episode_worker[episode_id] = worker
        worker.episodes.add(episode_id)
        try:
            return await self._request(worker, "open", env, scenario, args, episode_id)
        except YieldloopError:
            self._forget(episode_id)  # the worker closed it already (or is gone)
            raise
        except BaseException:  # cancelled or timed out: the worker may still open it, so close it there
            self._forget(episode_id)
            self._keep(self._close_on(worker, episode_id))
            raise

    async def call_tool(self, episode_id: str, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        return await self._request(self._worker_of(episode_id), "call_tool", episode_id, name, arguments)

    async def submit(self, episode_id: str, answer: str, completion: FinalCompletion | None = None) -> Grade:
        worker = self._worker_of(episode_id)
        try:
            return await self._request(worker, "submit", episode_id, answer, completion)
        except YieldloopError:
            raise  # answered (or the worker is gone): the worker tears it down itself
        except BaseException:  # cancelled or timed out while grading: stop it there and tear it down
            self._keep(self._close_on(worker, episode_id))
            raise
        finally:
            self._forget(episode_id)  # the worker tears it down after the grade: no close request

    def _forget(self, episode_id: str) -> _Worker | None:
        worker = self._episode_worker.pop(episode_id, None)
        if worker is not None:
            worker.episodes.discard(episode_id)
        return worker

    async def close(self, episode_id: str) -> None:
        worker = self._forget(episode_id)
        if worker is not None:
            await self._close_on(worker, episode_id)

    async def _close_on(self, worker: _Worker, episode_id: str) -> None:
        """Teardown in the worker; a dead worker took the episode with it."""
        if worker.alive:
            with contextlib.suppress(UnavailableError):
                await self._request(worker, "close", episode_id)

    def is_open(self, episode_id: str) -> bool:
        return episode_id in self._episode_worker

    @property
    def num_live_episodes(self) -> int:
        return len(self._episode_worker)
