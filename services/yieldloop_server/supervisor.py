"""A service process under supervision: ``yieldloop serve <service>`` started, watched, and started again on the same
address whenever it dies (``yieldloop up``'s services, an EnvService's other processes)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import re
import signal
import sys
import time

from yieldloop.errors import UnavailableError
from yieldloop.retry import Backoff
from yieldloop_server.config import ServeOptions

log = logging.getLogger(__name__)


def _exit_with_parent() -> None:
    """In a child before it runs: SIGTERM when its parent dies (Linux's PR_SET_PDEATHSIG), so it never outlives the
    process that supervises it (a parent killed with -9 runs no cleanup)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


class ServiceFailedError(UnavailableError):
    """A service process exited before it served (UNAVAILABLE, SERVICE_FAILED): its message is the last error its
    log shows, in one line."""


_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Exit|Interrupt)\b.*)$")
_TYPED = re.compile(r"^\w+Error: [A-Z_]+/[A-Z_]+: (.*?)(?: \(field \w+\))?$")
"""A yieldloop error's line: its message is what to show (its code and reason are the class's)."""


def last_error(log_path: pathlib.Path, offset: int = 0) -> str:
    """The last exception line a process wrote to ``log_path`` after ``offset`` (a traceback's final line, without
    the exception's module), else its last line."""
    try:
        with open(log_path, "rb") as file:
            file.seek(offset)
            lines = [line.strip() for line in file.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    for line in reversed(lines):
        match = _ERROR_LINE.match(line)
        if match:
            typed = _TYPED.match(match.group(1))
            return typed.group(1) if typed else match.group(1)
    return lines[-1] if lines else "it wrote nothing"


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1]) if address else 0


def pinned(options: ServeOptions, ready: dict) -> ServeOptions:
    """``options`` with every port the started process chose bound again by its restarts (its service port, the
    rollout's OpenAI endpoint, the metrics endpoint), so everything a stack published keeps its address."""
    options = dataclasses.replace(options, port=_port(ready["address"]))
    if ready.get("http_port") and options.rollout.http_port == 0:
        options = dataclasses.replace(
            options, rollout=dataclasses.replace(options.rollout, http_port=int(ready["http_port"]))
        )
    if ready.get("metrics") and options.metrics_port == 0:
        options = dataclasses.replace(options, metrics_port=_port(ready["metrics"]))
    return options


class ServiceProcess:
    """One ``yieldloop serve <service>`` process, restarted on the same address whenever it dies.

    A service that crashes (kill -9, out of memory) comes back where its callers expect it, after a wait from
    the one retry policy (:class:`yieldloop.retry.Backoff`); nothing it held is lost, because every service
    keeps its durable state in the store (a trainer's uncommitted gradients are gone, and its callers hear
    UNAVAILABLE; a retried OptimStep with its idempotency key finds a step that had committed).
    """

    def __init__(
        self,
        options: ServeOptions,
        logs_dir: pathlib.Path,
        ready_timeout_s: float = 300.0,
        backoff: Backoff = Backoff(initial_s=0.5, max_s=30.0),
        service_key: str = "",
        name: str = "",
        exit_with_parent: bool = False,
    ) -> None:
        self.options = options
        self.service_key = service_key
        """Handed to the process in its environment (never on its command line)."""
        self.service = name or options.service
        self.log_path = logs_dir / f"{self.service}.log"
        self.exit_with_parent = exit_with_parent
        """The process gets SIGTERM when this one dies, however it dies (Linux's parent-death signal)."""
        self.ready_timeout_s = ready_timeout_s
        self.backoff = backoff
        self.address = ""
        self.process: asyncio.subprocess.Process | None = None
        self.restarts = 0
        """How many times the process was started again after it died."""
        self._watcher: asyncio.Task[None] | None = None
        self._stopping = False

    async def _spawn(self) -> None:
        ready_file = self.options.ready_file
        assert ready_file is not None
        ready_file.unlink(missing_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log_file:
            self.process = process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "yieldloop.cli",
                *self.options.to_args(),
                stdout=log_file,
                stderr=log_file,
                stdin=asyncio.subprocess.DEVNULL,
                env={**os.environ, "YIELDLOOP_SERVICE_KEY": self.service_key} if self.service_key else None,
                preexec_fn=_exit_with_parent if self.exit_with_parent else None,
            )
        deadline = time.monotonic() + self.ready_timeout_s
        while not ready_file.exists():
            if process.returncode is not None:
                raise ServiceFailedError(
                    f"{self.service} failed to start: {last_error(self.log_path, log_start)} (log: {self.log_path})",
                    reason="SERVICE_FAILED",
                )
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):  # not left running beside the next attempt
                    process.kill()
                await process.wait()
                raise ServiceFailedError(
                    f"{self.service} not ready after {self.ready_timeout_s:g}s; its log ends: "
                    f"{last_error(self.log_path, log_start)} (log: {self.log_path})",
                    reason="SERVICE_FAILED",
                )
            await asyncio.sleep(0.1)
        ready = json.loads(ready_file.read_text())
        self.address = ready["address"]
        self.options = pinned(self.options, ready)

    async def start(self) -> str:
        """Starts the process and its supervision; returns its address once it serves."""
        await self._spawn()
        self._watcher = asyncio.create_task(self._supervise())
        return self.address

    async def _supervise(self) -> None:
        attempt = 0
        while not self._stopping:
            assert self.process is not None
            code = await self.process.wait()
            while not self._stopping:
                log.warning("%s exited with %s; starting it again on %s", self.service, code, self.address)
                await asyncio.sleep(self.backoff.delay(attempt))
                attempt += 1
                if self._stopping:
                    return
                try:
                    await self._spawn()
                except (ServiceFailedError, OSError) as err:
                    log.warning("restarting %s failed: %s", self.service, err)
                    continue
                self.restarts += 1
                attempt = 0
                break

    async def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM (graceful stop), then SIGKILL if the process is still alive after ``timeout_s``."""
        self._stopping = True
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        process = self.process
        if process is None:
            return
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
