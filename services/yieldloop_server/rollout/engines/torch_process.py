"""The torch engine in a process of its own (the engine-core split vLLM makes for the same reason).

A server that decodes in its own process shares one interpreter lock between the engine's worker thread and
everything its event loop does: every gRPC message written, every episode stepped. With a small model each
decode step is mostly Python, so the two take turns on one core however many the machine has, and each
slows the other (measured: decode steps ~40% slower while 64 gRPC streams are served). ``TorchProcessEngine``
runs :class:`TorchEngine` in a child process and speaks to it over a pipe: requests, cancellations and
weight/adapter loads go down, one message per decode step of deltas comes up. The server's process keeps the
tokenizer (chat rendering, validation) and the event loop; the child keeps the model.

The child is started with ``spawn`` (no inherited threads or CUDA state) and exits when the pipe closes, so
a server killed with -9 leaves no engine behind. A child that dies fails the requests it held with
UNAVAILABLE/ENGINE_ERROR (retryable); the next call starts a new child with the weights and adapters the dead
one served, then goes on (a new child that cannot load them is not retried for REVIVE_BACKOFF_S: calls fail
with the death's error meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import pathlib
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from yieldloop.errors import UnavailableError
from yieldloop_server.rollout.engines.base import (
    REVIVE_BACKOFF_S,
    Engine,
    SamplingConfig,
    TokenDelta,
    folder_signature,
)
from yieldloop_server.rollout.engines.torch_engine import LoopSink, Sink, TorchEngine, drain

log = logging.getLogger(__name__)


class TorchProcessEngine(Engine):
    """:class:`TorchEngine` (same arguments) decoding in a child process; the same behaviour and errors."""

    name = "torch"

    def __init__(self, threads: int = 0, **options: Any) -> None:
        """``threads``: torch intra-op threads in the child (0: this process's torch setting, less the core the
        server's event loop keeps)."""
        import torch

        if not threads:
            threads = min(torch.get_num_threads(), max(1, (os.cpu_count() or 2) - 1))
        self._child_args = (threads, logging.getLogger().getEffectiveLevel(), options)
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._adapters: dict[str, tuple[str, str]] = {}
        """Adapter name -> (folder, version), as loaded (a new child loads them again)."""
        self._folder = ""
        self._version = ""
        self._limits = (0, 0)
        self._signature: Any = None
        self._dead: BaseException | None = None
        self._closing = False
        self._revive_lock = asyncio.Lock()
        self._revive_after = 0.0
        self.revivals = 0
        """Children started in place of dead ones."""
        self._spawn()

    def _spawn(self) -> None:
        """Starts the child process and the thread reading its pipe."""
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_child_main, args=(child, *self._child_args), name="yieldloop-torch-engine", daemon=True
        )
        self._process.start()
        child.close()
        self._reader = threading.Thread(
            target=self._read, args=(self._conn, self._process), name="torch-engine-reader", daemon=True
        )
        self._reader.start()

    @property
    def weight_version(self) -> str:
        return self._version

    @property
    def vocab_size(self) -> int:
        return self._limits[0]

    @property
    def max_model_len(self) -> int:
        return self._limits[1]

    def _send(self, message: tuple, reviving: bool = False) -> None:
        if self._dead is not None and not reviving:
            raise self._dead
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, EOFError) as exc:
            gone = UnavailableError(
                f"the torch engine process is gone ({exc}; exit code {self._process.exitcode})", reason="ENGINE_ERROR"
            )
            if not reviving and self._dead is None:
                # A pipe that broke is a child lost, whether or not its process has exited yet (is_alive can lag
                # behind): the next call starts a new one instead of writing to this pipe again.
                self._dead = gone
            raise gone from None

    async def _call(self, method: str, *args: Any, reviving: bool = False) -> Any:
        if not reviving:
            await self.revive()
        loop = asyncio.get_running_loop()
        call_id = next(self._ids)
        future = loop.create_future()
        self._calls[call_id] = (loop, future)
        try:
            self._send(("call", call_id, method, args), reviving)
            return await future
        finally:
            self._calls.pop(call_id, None)

    def is_down(self) -> bool:
        return not self._closing and (self._dead is not None or not self._process.is_alive())

    async def revive(self) -> None:
        """When the child died: a new one, given the weights and adapters the dead one served (one revival
        however many calls wait for it). Raises the death's error when the new child cannot take them."""
        if not self.is_down():
            return
        async with self._revive_lock:
            if not self.is_down():
                return  # revived while this call waited
            # Dead, though its reader may not have seen the pipe close yet.
            dead = self._dead or UnavailableError(
                f"the torch engine process exited (code {self._process.exitcode})", reason="ENGINE_ERROR"
            )
            if time.monotonic() < self._revive_after:
                raise dead
            log.warning("%s: starting a new torch engine process with weights %s", dead, self._version or "(none)")
            await asyncio.to_thread(self._stop_child)
            try:
                self._spawn()
                if self._folder:
                    await self._call("load_weights", self._folder, self._version, reviving=True)
                for name, (folder, version) in self._adapters.items():
                    await self._call("load_adapter", name, folder, version, reviving=True)
            except BaseException as exc:
                self._revive_after = time.monotonic() + REVIVE_BACKOFF_S
                log.error("the new torch engine process could not load %s: %s", self._version, exc)
                await asyncio.to_thread(self._stop_child)
                self._dead = dead
                raise dead from exc
            self._dead = None
            self.revivals += 1

    def _stop_child(self) -> None:
        """Ends the child (asked, then killed; at once when it cannot be asked) and waits for its reader thread."""
        asked = False
        with contextlib.suppress(OSError, EOFError):
            with self._send_lock:
                self._conn.send(("close",))
            asked = True
        self._process.join(10 if asked else 0)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._conn.close()
        self._reader.join(10)

    async def load_weights(self, folder: pathlib.Path, version: str) -> None:
        signature = await asyncio.to_thread(folder_signature, folder)
        tokenizer = (
            None
            if signature is not None and signature == self._signature
            else asyncio.create_task(asyncio.to_thread(_tokenizer_and_code, folder))
        )
        try:
            facts = await self._call("load_weights", str(folder), version)
        finally:
            loaded = await tokenizer if tokenizer is not None else None
        if loaded is not None:
            self.tokenizer, self._signature = loaded, signature
        self._limits = (facts["vocab_size"], facts["max_model_len"])
        self._folder, self._version = str(folder), version
        self.weight_loads += 1

    async def load_adapter(self, name: str, folder: pathlib.Path, version: str) -> None:
        await self._call("load_adapter", name, str(folder), version)
        self._adapters[name] = (str(folder), version)

    async def unload_adapter(self, name: str) -> None:
        await self._call("unload_adapter", name)
        self._adapters.pop(name, None)

    def adapter_version(self, name: str) -> str:
        return self._adapters[name][1] if name in self._adapters else ""

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingConfig, adapter: str = ""
    ) -> AsyncIterator[TokenDelta]:
        self.validate_request(prompt_ids, sampling, adapter)
        request_id = 0
        finished = False
        try:
            for attempt in range(2):  # a child that died between the check and the send: once more, on a new one
                await self.revive()
                request_id = next(self._ids)
                out: asyncio.Queue = asyncio.Queue()
                self._streams[request_id] = (asyncio.get_running_loop(), out)
                try:
                    self._send(("generate", request_id, list(prompt_ids), sampling, adapter))
                    break
                except UnavailableError:
                    self._streams.pop(request_id, None)
                    if attempt:
                        raise
            async for delta in drain(out):
                finished = delta.finished
                yield delta
        finally:
            if self._streams.pop(request_id, None) is not None and not finished:
                try:
                    self._send(("cancel", request_id))
                except UnavailableError:
                    pass

    def num_unfinished(self) -> int:
        return len(self._streams)

    async def close(self) -> None:
        self._closing = True
        async with self._revive_lock:  # not beside a revival's new child
            await asyncio.to_thread(self._stop_child)

    def _read(self, conn: Any, process: Any) -> None:
        """The reader thread of one child: hands deltas to their streams' loops (one wake-up per loop per
        message) and replies to their calls; fails everything once that child is gone."""
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "deltas":
                by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
                for request_id, item in message[1]:
                    stream = self._streams.get(request_id)
                    if stream is not None:
                        by_loop.setdefault(stream[0], []).append((stream[1], item))
                for loop, items in by_loop.items():
                    LoopSink.of(loop).deliver(items)
            else:  # ("reply", call id, error, result)
                _, call_id, error, result = message
                entry = self._calls.get(call_id)
                if entry is not None:
                    _settle_soon(entry[0], entry[1], error, result)
        self._dead = UnavailableError(
            f"the torch engine process exited (code {process.exitcode})", reason="ENGINE_ERROR"
        )
        for loop, out in list(self._streams.values()):
            LoopSink.of(loop).deliver([(out, self._dead)])
        for loop, future in list(self._calls.values()):
            _settle_soon(loop, future, self._dead, None)


def _tokenizer_and_code(folder: pathlib.Path) -> Any:
    """The folder's tokenizer, for this process; the model's code imported too, so that a torch engine in a
    thread of this process (the rollout service's candidate evaluations) loads such a model without it."""
    from yieldloop_server.common.hf import import_model_code, load_tokenizer

    tokenizer = load_tokenizer(folder)
    import_model_code(folder)
    return tokenizer


def _settle_soon(
    loop: asyncio.AbstractEventLoop, future: asyncio.Future, error: BaseException | None, result: Any
) -> None:
    """Settles a call's future on its loop (from the reader thread)."""

    def settle() -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    with contextlib.suppress(RuntimeError):  # that loop is closed: nobody is waiting
        loop.call_soon_threadsafe(settle)


# The child process ---------------------------------------------------------------------------------------------


class _PipeSink(Sink):
    """The child's requests: one pipe message per decode step carries every request's items."""

    def __init__(self, send: Any) -> None:
        self.send = send
        self.requests: dict[int, Any] = {}
        """The requests not finished yet, by id (for cancellations)."""
        self.lock = threading.Lock()
        """Held while a request is queued and recorded, so that its end cannot be delivered in between."""

    def deliver(self, items: list[tuple[Any, TokenDelta | BaseException]]) -> None:
        with self.lock:
            for request_id, item in items:
                if isinstance(item, BaseException) or item.finished:
                    self.requests.pop(request_id, None)
        self.send(("deltas", items))


def _child_main(conn: Any, threads: int, log_level: int, options: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(threads)
    logging.basicConfig(level=log_level)  # the server's level (spawn starts with logging unconfigured)
    asyncio.run(_Child(conn, options).serve())


class _Child:
    def __init__(self, conn: Any, options: dict[str, Any]) -> None:
        self.conn = conn
        self.engine = TorchEngine(**options)
        self.send_lock = threading.Lock()
        self.sink = _PipeSink(self.send)
        self.tasks: set[asyncio.Task] = set()
        self.done = asyncio.Event()

    def send(self, message: tuple) -> None:
        try:
            with self.send_lock:
                self.conn.send(message)
        except (OSError, EOFError):  # the server is gone: _on_readable sees the pipe close and stops
            pass

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(self.conn.fileno(), self._on_readable)
        try:
            await self.done.wait()
        finally:
            loop.remove_reader(self.conn.fileno())
            for request in list(self.sink.requests.values()):
                request.cancelled = True
            await self.engine.close()

    def _on_readable(self) -> None:
        try:
            while self.conn.poll():
                self._handle(self.conn.recv())
        except (EOFError, OSError):
            self.done.set()

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "generate":
            _, request_id, prompt_ids, sampling, adapter = message
            with self.sink.lock:
                self.sink.requests[request_id] = self.engine.submit(
                    prompt_ids, sampling, adapter, self.sink, request_id
                )
        elif kind == "cancel":
            with self.sink.lock:
                request = self.sink.requests.pop(message[1], None)
            if request is not None:
                request.cancelled = True
        elif kind == "call":
            task = asyncio.ensure_future(self._call(*message[1:]))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        elif kind == "close":
            self.done.set()

    async def _call(self, call_id: int, method: str, args: tuple) -> None:
        engine = self.engine
        try:
            if method == "load_weights":
                await engine.load_weights(pathlib.Path(args[0]), args[1])
                result: Any = {"vocab_size": engine.vocab_size, "max_model_len": engine.max_model_len}
            elif method == "load_adapter":
                result = await engine.load_adapter(args[0], pathlib.Path(args[1]), args[2])
            elif method == "unload_adapter":
                result = await engine.unload_adapter(args[0])
            else:
                raise ValueError(f"unknown engine call {method!r}")
        except Exception as exc:
            self.send(("reply", call_id, exc, None))
        else:
            self.send(("reply", call_id, None, result))
