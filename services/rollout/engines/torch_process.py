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
UNAVAILABLE/ENGINE_ERROR (retryable), and every later call the same way.
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
from collections.abc import AsyncIterator, Sequence
from typing import Any

from yieldloop.errors import UnavailableError
from yieldloop_server.rollout.engines.base import Engine, SamplingConfig, TokenDelta
from yieldloop_server.rollout.engines.torch_engine import LoopSink, Sink, TorchEngine, drain, folder_signature


class TorchProcessEngine(Engine):
    """:class:`TorchEngine` (same arguments) decoding in a child process; the same behaviour and errors."""

    name = "torch"

    def __init__(self, threads: int = 0, **options: Any) -> None:
        """``threads``: torch intra-op threads in the child (0: this process's torch setting, less the core the
        server's event loop keeps)."""
        import torch

        if not threads:
            threads = min(torch.get_num_threads(), max(1, (os.cpu_count() or 2) - 1))
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_child_main,
                                        args=(child, threads, logging.getLogger().getEffectiveLevel(), options),
                                        name="yieldloop-torch-engine", daemon=True)
        self._process.start()
        child.close()
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._adapters: dict[str, str] = {}
        self._version = ""
        self._limits = (0, 0)
        self._signature: Any = None
        self._dead: BaseException | None = None
        self._reader = threading.Thread(target=self._read, name="torch-engine-reader", daemon=True)
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

    def _send(self, message: tuple) -> None:
        if self._dead is not None:
            raise self._dead
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, EOFError) as exc:
            raise UnavailableError(f"the torch engine process is gone: {exc}", reason="ENGINE_ERROR") from None

    async def _call(self, method: str, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        call_id = next(self._ids)
        future = loop.create_future()
        self._calls[call_id] = (loop, future)
        try:
            self._send(("call", call_id, method, args))
            return await future
        finally:
            self._calls.pop(call_id, None)

    async def load_weights(self, folder: pathlib.Path, version: str) -> None:
        signature = await asyncio.to_thread(folder_signature, folder)
        tokenizer = None if signature is not None and signature == self._signature else \
            asyncio.create_task(asyncio.to_thread(_tokenizer_and_code, folder))
        try:
            facts = await self._call("load_weights", str(folder), version)
        finally:
            loaded = await tokenizer if tokenizer is not None else None
        if loaded is not None:
            self.tokenizer, self._signature = loaded, signature
        self._limits = (facts["vocab_size"], facts["max_model_len"])
        self._version = version
        self.weight_loads += 1

    async def load_adapter(self, name: str, folder: pathlib.Path, version: str) -> None:
        await self._call("load_adapter", name, str(folder), version)
        self._adapters[name] = version

    async def unload_adapter(self, name: str) -> None:
        await self._call("unload_adapter", name)
        self._adapters.pop(name, None)

    def adapter_version(self, name: str) -> str:
        return self._adapters.get(name, "")

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingConfig, adapter: str = ""
    ) -> AsyncIterator[TokenDelta]:
        self.validate_request(prompt_ids, sampling, adapter)
        request_id = next(self._ids)
        out: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), out)
        finished = False
        try:
            self._send(("generate", request_id, list(prompt_ids), sampling, adapter))
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
        try:
            self._send(("close",))
        except UnavailableError:
            pass
        await asyncio.to_thread(self._process.join, 10)
        if self._process.is_alive():
            self._process.kill()
            await asyncio.to_thread(self._process.join, 5)
        self._conn.close()

    def _read(self) -> None:
        """The reader thread: hands deltas to their streams' loops (one wake-up per loop per message) and
        replies to their calls; fails everything once the child is gone."""
        while True:
            try:
                message = self._conn.recv()
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
        self._dead = UnavailableError(f"the torch engine process exited (code {self._process.exitcode})",
                                      reason="ENGINE_ERROR")
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


def _settle_soon(loop: asyncio.AbstractEventLoop, future: asyncio.Future, error: BaseException | None,
                 result: Any) -> None:
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
                self.sink.requests[request_id] = self.engine.submit(prompt_ids, sampling, adapter, self.sink,
                                                                    request_id)
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
