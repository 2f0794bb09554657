"""The one definition of every service option: dataclasses with a docstring per field.

Each service's own options are one dataclass (``CheckpointOptions``, ``EnvOptions``, ``TrainerOptions``,
``RolloutOptions``); ``StackConfig`` is what a stack serves: what the services share (data directory, store,
model, device, host, transport) and each service's options. ``ServeOptions`` adds what places one service
process (its service, port, the addresses of the services it calls). The command line
(``yieldloop serve|up|demo``), ``yieldloop up``'s child processes, the in-process stack of the tests and the
benchmarks all derive from these classes: flags are made from the fields (name, type, default, docstring)
by :func:`add_arguments` and read back by :func:`from_arguments`, and :meth:`ServeOptions.to_args` writes
the flags that give a set of options.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import pathlib
from typing import Any, Literal, get_args, get_origin, get_type_hints

from yieldloop.client import SERVICES  # noqa: F401  (re-exported: the stack's start order)
from yieldloop.transport import TransportConfig

DEFAULT_ENV_SPEC = "yieldloop.envs.letters:env"


@dataclasses.dataclass
class CheckpointOptions:
    """CheckpointService's own options."""

    keep_last: int = 0
    """Checkpoint retention: keep the last K plus every checkpoint that was ever head (0: all)."""
    import_roots: tuple[str, ...] = dataclasses.field(default=(), metadata={"flag": "--import-roots"})
    """Folders on this machine under which admin keys may import models by path (ImportModel; the stack's own
    data directory and store never). Everyone else uploads a folder (UploadModel)."""
    max_upload_gb: float = 500.0
    """The largest model folder an upload may declare, in GB."""


@dataclasses.dataclass
class EnvOptions:
    """EnvService's own options."""

    specs: tuple[str, ...] = dataclasses.field(default=(DEFAULT_ENV_SPEC,), metadata={"flag": "--env-spec"})
    """Environments EnvService loads: module:attr or file.py:attr (repeatable)."""
    workers: int = dataclasses.field(default=2, metadata={"flag": "--env-workers"})
    """EnvService worker processes running environment code (0: in the service's own process)."""
    processes: int = dataclasses.field(default=1, metadata={"flag": "--env-processes"})
    """EnvService processes serving its one port: this one and N-1 it starts (and starts again when one dies),
    bound with SO_REUSEPORT so the kernel spreads connections over them; each has its own --env-workers. For
    hosts with cores to spare: clients spread episodes over connections (--env-connections N)."""
    share_port: bool = dataclasses.field(default=False, metadata={"flag": "--env-share-port"})
    """Bind a port other EnvService processes serve too (how --env-processes starts the others; for processes
    started by hand, give it to each). Without it, binding a port in use fails."""


@dataclasses.dataclass
class TrainerOptions:
    """TrainerService's own options."""

    dtype: Literal["auto", "float32", "bfloat16"] = dataclasses.field(
        default="auto", metadata={"flag": "--trainer-dtype"}
    )
    """Trainer weights dtype (auto: bfloat16 on CUDA, float32 elsewhere)."""
    nproc: int = 1
    """Trainer ranks, data parallel (gloo on CPU, NCCL on CUDA, one GPU per rank)."""
    max_models: int = dataclasses.field(default=2, metadata={"flag": "--trainer-max-models"})
    """Models the trainer keeps loaded at once, one session each (1 when nproc > 1)."""
    compile: bool = dataclasses.field(default=False, metadata={"flag": "--trainer-compile"})
    """torch.compile the trained model (worth it on a GPU: fused norms, rotary and activations; each new batch
    shape compiles first)."""
    shard: Literal["none", "fsdp", "hsdp"] = dataclasses.field(default="none", metadata={"flag": "--trainer-shard"})
    """fsdp: every weight, gradient and AdamW moment sharded over the --nproc ranks (or torchrun's), FSDP2,
    each decoder layer's weights gathered only while it computes, gradients reduced in fp32.
    The training state is written by every rank at once (torch.distributed.checkpoint) and resumes on any number
    of ranks. hsdp: sharded within each node (--trainer-shard-group ranks), replicated across nodes (one gradient
    all-reduce between nodes per step). none: every rank holds the whole model (data parallel)."""
    shard_group: int = dataclasses.field(default=0, metadata={"flag": "--trainer-shard-group"})
    """hsdp: ranks per shard group (0: each node's ranks, torchrun's --nproc-per-node)."""
    activation_checkpointing: bool | None = dataclasses.field(
        default=None, metadata={"flag": "--trainer-activation-checkpointing"}
    )
    """Keep each decoder layer's input only and recompute the layer in the backward pass (activation memory of
    one layer instead of all). Default: on with --trainer-shard fsdp, off otherwise."""
    micro_batch_tokens: int = dataclasses.field(default=8192, metadata={"flag": "--trainer-micro-batch-tokens"})
    """Tokens computed per forward/backward micro-batch on each rank (bounds activation memory)."""
    pack: bool = dataclasses.field(default=True, metadata={"flag": "--trainer-pack"})
    """Pack each micro-batch's datums into one row (position ids restarting per datum, attention within each
    datum), so compute goes to real tokens; --no-trainer-pack: one right-padded row per datum."""
    state_every: int = 10
    """Save the full training state (optimizer moments) with every Nth step, and when a session closes (0: only
    then and on demand). A trainer crash resumes from the last checkpoint holding it; every step's weights reach
    the fleet and the store regardless."""

    def resolved_dtype(self, device: str) -> str:
        """The dtype with "auto" resolved for ``device``."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if device.startswith("cuda") else "float32"

    def compute_dtype(self, device: str) -> str:
        """Sharded on CUDA: layers compute in bf16 (over fp32 weights with --trainer-dtype float32), gradients
        reduced in fp32 ("": the weights' dtype throughout)."""
        return "bfloat16" if self.shard != "none" and device.startswith("cuda") else ""


@dataclasses.dataclass
class RolloutOptions:
    """RolloutService's own options."""

    engine: Literal["torch", "vllm"] = "torch"
    """Rollout engine: torch, or vllm (pip install 'yieldloop-server[vllm]')."""
    http_port: int = 0
    """RolloutService's OpenAI-compatible HTTP endpoint port (0: a free one; -1: off)."""
    max_models: int = dataclasses.field(default=2, metadata={"flag": "--rollout-max-models"})
    """Engines the rollout service keeps loaded at once, one per model slug (least recently used unloaded)."""
    memory_budget_mb: int = dataclasses.field(default=0, metadata={"flag": "--rollout-memory-mb"})
    """Megabytes of model weights the rollout service keeps loaded at once (0: only the engine count limits)."""
    max_runs: int = dataclasses.field(default=8192, metadata={"flag": "--rollout-max-runs"})
    """Episodes (tasks x group size) one StreamRollouts request may ask for."""
    max_episodes: int = dataclasses.field(default=1024, metadata={"flag": "--rollout-max-episodes"})
    """Episodes the rollout service runs at once over all requests (more wait their turn)."""
    lora_engine: Literal["same", "torch", "vllm"] = dataclasses.field(
        default="same", metadata={"flag": "--rollout-lora-engine"}
    )
    """Engine serving LoRA forks (one per frozen base, adapters applied per request): the rollout engine's kind
    (same), or torch: on CPU machines vLLM's LoRA kernels run at a few percent of its base throughput."""
    engine_process: bool | None = dataclasses.field(default=None, metadata={"flag": "--rollout-engine-process"})
    """The torch engine decodes in a process of its own (the service's event loop and the decode loop then do not
    share one interpreter lock; its torch threads leave one core to the service), as vLLM's engine core always
    does; off: in a thread of the service's process. Default: in a process, except where `yieldloop up` gives the
    rollout service one core of a CPU machine (the process would take the trainer's core)."""
    max_batch: int = dataclasses.field(default=0, metadata={"flag": "--rollout-max-batch"})
    """Sequences the engine decodes together at most (the torch engine's running batch, vLLM's ``max_num_seqs``;
    0: the engine's default: 256 for the torch engine, vLLM's own otherwise): more wait their turn. A GRPO batch
    larger than this decodes in waves, each decode step paying the model's fixed cost for fewer rows; a smaller one
    bounds the KV cache's memory."""
    tensor_parallel: int = dataclasses.field(default=1, metadata={"flag": "--rollout-tensor-parallel"})
    """GPUs one vLLM engine shards the model over (vLLM's ``tensor_parallel_size``; its workers then run in
    processes of their own, one per GPU). The torch engine runs on one device."""
    gpu_memory_utilization: float = dataclasses.field(
        default=0.0, metadata={"flag": "--rollout-gpu-memory-utilization"}
    )
    """Share of each GPU vLLM may take for weights, activations and KV cache (vLLM's ``gpu_memory_utilization``;
    0: the engine's default, 0.85 on GPUs, 0.3 of host memory on CPU)."""
    max_model_len: int = dataclasses.field(default=0, metadata={"flag": "--rollout-max-model-len"})
    """Context length the engine serves (vLLM's ``max_model_len``; 0: the model's). A shorter one leaves more of
    the KV cache to concurrent sequences."""
    weights_from: Literal["auto", "stream", "group", "store"] = dataclasses.field(
        default="auto", metadata={"flag": "--rollout-weights-from"}
    )
    """How a step's weights come from the trainer before the store has them: auto (on the trainer's host its
    files in place, from another host a chunked gRPC stream per rollout service), stream (always the stream), or
    group (the trainer broadcasts each checkpoint once to every rollout service of the model in its weight group,
    over torch.distributed: NCCL where every side has CUDA, gloo otherwise; a checkpoint not broadcast to this
    service is pulled as auto), or store (only what the store has: a pending checkpoint is asked for again for
    about 20 s, then refused; for rollout services that cannot reach the trainer, beside a trainer whose steps wait
    for the store)."""
    stream_interval_ms: float = 20.0
    """Streams (gRPC Generate, OpenAI ``stream: true``) send the first and the last tokens at once and in between
    at most one message per this many milliseconds, holding the tokens sampled meanwhile (0: one message per
    token). Each message costs the server and the client the same whatever it carries: at many streams of fast
    tokens, one per token costs more than the decoding."""

    def validate(self) -> RolloutOptions:
        """INVALID_ARGUMENT naming the flag of a value no engine takes."""
        from yieldloop.errors import invalid_field

        if self.tensor_parallel < 1:
            raise invalid_field(
                "rollout.tensor_parallel", f"--rollout-tensor-parallel must be >= 1, got {self.tensor_parallel}"
            )
        if self.tensor_parallel > 1 and "torch" in (self.engine, self.lora_engine):
            raise invalid_field(
                "rollout.tensor_parallel",
                "--rollout-tensor-parallel > 1 needs --rollout-engine vllm (and --rollout-lora-engine same or "
                "vllm): the torch engine runs on one device",
            )
        if not 0 <= self.gpu_memory_utilization <= 1:
            raise invalid_field(
                "rollout.gpu_memory_utilization",
                f"--rollout-gpu-memory-utilization must be in (0, 1] (0: the engine's default), got "
                f"{self.gpu_memory_utilization}",
            )
        if self.max_model_len < 0:
            raise invalid_field(
                "rollout.max_model_len", f"--rollout-max-model-len must be >= 0, got {self.max_model_len}"
            )
        return self


@dataclasses.dataclass
class StackConfig:
    """What a stack of the four services serves: what they share, and each service's own options."""

    data_dir: pathlib.Path = pathlib.Path(".yieldloop")
    """Root of the store, scratch space, address files and logs."""
    store: str = ""
    """Object store: a path or s3://bucket/prefix (default: DATA_DIR/store)."""
    model: str = "tiny"
    """Model served and trained: a slug of the store; the built-in "tiny" (created offline when absent); or a
    Hugging Face folder or a hub id in the local Hugging Face cache, imported on first start."""
    device: str = "cpu"
    """torch device for the trainer and the engine."""
    host: str = "127.0.0.1"
    """Interface every service binds."""
    checkpoint: CheckpointOptions = dataclasses.field(default_factory=CheckpointOptions)
    """CheckpointService's options."""
    env: EnvOptions = dataclasses.field(default_factory=EnvOptions)
    """EnvService's options."""
    trainer: TrainerOptions = dataclasses.field(default_factory=TrainerOptions)
    """TrainerService's options."""
    rollout: RolloutOptions = dataclasses.field(default_factory=RolloutOptions)
    """RolloutService's options."""
    transport: TransportConfig = dataclasses.field(default_factory=TransportConfig)
    """Message limits and interceptors of every server and internal client (see yieldloop.transport)."""
    auth: bool = True
    """Every call needs an API key, and a team acts on its own models only; --no-auth lets anyone who reaches a
    port do anything (benchmarks on a private machine)."""
    record_spans: bool = False
    """Record the spans of each episode's trace in the store, for `yieldloop trace ID` (tracing is then on even
    without an OTLP endpoint; OTEL_TRACES_SAMPLER picks the episodes kept)."""
    hud: bool = True
    """Serve the HTTP contracts of HUD's cloud (catalog, training, gateway, traces) from a fifth process, so scripts
    written with the HUD SDK train here; `yieldloop up` writes the HUD_* variables to DATA_DIR/run/hud.env."""
    hud_port: int = 0
    """Port of the HUD front (0: BASE_PORT+4, or a free one)."""
    base_port: int = 0
    """The stack's ports, in order from this one: the checkpoint, env, trainer and rollout services, the HUD front
    and the OpenAI endpoint (0: free ports; every address is in DATA_DIR/run and `yieldloop status`)."""
    tls: bool = False
    """Every service (gRPC and the HTTP endpoint) and every internal client speaks TLS, with a private CA made in
    DATA_DIR/tls (clients of the stack trust DATA_DIR/tls/ca.pem, or $YIELDLOOP_TLS_CA). Your own certificates:
    --tls-cert, --tls-key and --tls-ca instead."""

    @property
    def store_url(self) -> str:
        return self.store or str(self.data_dir / "store")

    def port_of(self, service: str) -> int:
        """The port ``service`` (or "http", the OpenAI endpoint) binds: its own flag, else its place after
        ``base_port``, else 0 (a free one)."""
        own = {"hud": self.hud_port, "http": self.rollout.http_port}.get(service, 0)
        if own or not self.base_port:
            return own
        return self.base_port + STACK_PORTS.index(service)

    def with_tls(self) -> StackConfig:
        """This config with the stack's own CA and certificates in the transport when ``tls`` asks for them and
        none were given (made in DATA_DIR/tls on first use)."""
        if not self.tls or self.transport.tls_cert:
            return self
        from yieldloop_server.common.tls import ensure_stack_certs

        ca, cert, key = ensure_stack_certs(self.data_dir / "tls", [self.host])
        return dataclasses.replace(
            self, transport=dataclasses.replace(self.transport, tls_cert=str(cert), tls_key=str(key), tls_ca=str(ca))
        )


STACK_PORTS = ("checkpoint", "env", "trainer", "rollout", "hud", "http")
"""What binds each port from a stack's ``base_port`` on."""

UP_BASE_PORT = 7740
"""``yieldloop up``'s default ``--base-port``: a stack's addresses stay the same from one start to the next."""


@dataclasses.dataclass
class ServeOptions(StackConfig):
    """One service process of a stack (``yieldloop serve <service>``)."""

    service: Literal["checkpoint", "env", "trainer", "rollout", "hud"] = dataclasses.field(
        default="checkpoint", metadata={"positional": True}
    )
    """Which service to run."""
    port: int = 0
    """Port to bind (0: a free one; see --ready-file)."""
    checkpoint_address: str = ""
    """CheckpointService host:port (trainer, rollout)."""
    env_address: str = ""
    """EnvService host:port (rollout)."""
    trainer_address: str = ""
    """TrainerService host:port (hud)."""
    rollout_address: str = ""
    """RolloutService host:port (hud)."""
    ready_file: pathlib.Path | None = None
    """Where to write {address} once serving."""
    grace_s: float = 5.0
    """Seconds in-flight calls get to finish on SIGTERM."""
    torch_threads: int = 0
    """torch's intra-op threads in this process (0: torch's default, one per core)."""
    metrics_port: int = 0
    """Port of the Prometheus /metrics endpoint when OTEL_METRICS_EXPORTER includes prometheus (0: a free one,
    written to the ready file as "metrics")."""
    service_key: str = dataclasses.field(default="", metadata={"cli": False}, repr=False)
    """The key this service calls the others with (default: $YIELDLOOP_SERVICE_KEY; without either, the
    service makes its own service key in the store at start)."""

    @classmethod
    def of(cls, config: StackConfig, service: str, addresses: dict[str, str]) -> ServeOptions:
        """How ``service`` starts in a stack whose earlier services listen at ``addresses``."""
        shared = {f.name: getattr(config, f.name) for f in dataclasses.fields(StackConfig)}
        if service == "rollout":
            shared["rollout"] = dataclasses.replace(config.rollout, http_port=config.port_of("http"))
        return cls(
            **shared,
            service=service,
            checkpoint_address=addresses.get("checkpoint", ""),
            env_address=addresses.get("env", ""),
            trainer_address=addresses.get("trainer", ""),
            rollout_address=addresses.get("rollout", ""),
            port=config.port_of(service),
        )

    def sharing_cores(self, cores: int | None = None) -> ServeOptions:
        """These options for a trainer or rollout service that shares a CPU machine with the other one (as
        ``yieldloop up`` runs them): half the cores each for torch, so sampling the next batch and training the
        current one run side by side instead of oversubscribing every core. A rollout service whose half is one
        core keeps its torch engine in a thread unless told otherwise: an engine process of its own would take
        the trainer's core (measured on 2 cores: the loop's steps 15-25% slower). Unchanged for other services,
        on GPUs, or when torch_threads or OMP_NUM_THREADS is set."""
        import os

        if (
            self.service not in ("trainer", "rollout")
            or self.torch_threads
            or not self.device.startswith("cpu")
            or os.environ.get("OMP_NUM_THREADS")
        ):
            return self
        share = max(1, (cores or os.cpu_count() or 2) // 2)
        rollout = (
            self.rollout
            if share > 1 or self.rollout.engine_process is not None
            else dataclasses.replace(self.rollout, engine_process=False)
        )
        return dataclasses.replace(self, torch_threads=share, rollout=rollout)

    def to_args(self) -> list[str]:
        """The ``yieldloop serve`` arguments that give these options (interceptors do not cross processes)."""
        args = ["serve", self.service]
        for _, flag, _, value in _flags(type(self), self):
            if value is None or value == "":
                continue
            if isinstance(value, bool):
                args.append(flag if value else "--no-" + flag[2:])
                continue
            for item in value if isinstance(value, tuple) else (value,):
                args += [flag, str(item)]
        return args


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(inspect.getsource(klass)).body[0].body
        for node, after in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


@functools.cache
def _field_specs(cls: type) -> list[tuple[str, str, Any, dataclasses.Field, str]]:
    """(name, flag, type, field, docstring) of every command-line field; nested dataclasses are flattened
    (their fields keep their own flags: ``env.workers`` is ``--env-workers``)."""
    hints = get_type_hints(cls)
    docs = _field_docs(cls)
    specs = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            specs += [(f"{f.name}.{name}", *rest) for name, *rest in _field_specs(kind)]
        elif f.metadata.get("cli", True):
            flag = f.name if f.metadata.get("positional") else f.metadata.get("flag", "--" + f.name.replace("_", "-"))
            specs.append((f.name, flag, kind, f, docs.get(f.name, "")))
    return specs


def _flags(cls: type, obj: Any) -> list[tuple[str, str, Any, Any]]:
    """(name, flag, type, value in ``obj``) of every optional flag."""
    out = []
    for name, flag, kind, _, _ in _field_specs(cls):
        if flag.startswith("--"):
            value = functools.reduce(getattr, name.split("."), obj)
            out.append((name, flag, kind, value))
    return out


def add_arguments(
    parser: argparse.ArgumentParser,
    cls: type = StackConfig,
    *,
    skip: tuple[str, ...] = (),
    defaults: dict[str, Any] | None = None,
) -> None:
    """Adds a flag per field of ``cls`` (help from the field's docstring, default from ``defaults`` or the field's),
    the fields of each nested dataclass (the checkpoint, env, trainer, rollout and transport options) in a group
    of their own in ``--help``."""
    groups: dict[str, Any] = {}
    for name, flag, kind, f, doc in _field_specs(cls):
        if name in skip:
            continue
        outer, _, inner = name.partition(".")
        if inner and outer not in groups:
            groups[outer] = parser.add_argument_group(f"{outer} options")
        target = groups[outer] if inner else parser
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        default = (defaults or {}).get(name, default)
        options: dict[str, Any] = {"help": doc}
        base = next((a for a in get_args(kind) if a is not type(None)), kind) if get_origin(kind) else kind
        if get_origin(kind) is Literal:
            options["choices"] = get_args(kind)
        elif get_origin(kind) is tuple:
            options.update(action="append", type=get_args(kind)[0])
        elif base in (int, float, pathlib.Path):
            options["type"] = base
        elif base is bool:
            options["action"] = argparse.BooleanOptionalAction
        if flag.startswith("--"):
            options.update(
                dest=name.replace(".", "__"),
                metavar=name.rpartition(".")[2].upper(),
                default=None if get_origin(kind) is tuple else default,
            )
            options["help"] += f" (default: {default})"
        target.add_argument(flag, **options)


def from_arguments(args: argparse.Namespace, cls: type = StackConfig, **values: Any) -> Any:
    """Builds ``cls`` from the parsed flags (``values`` override them)."""
    fields: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for name, flag, _, _, _ in _field_specs(cls):
        value = getattr(args, name.replace(".", "__") if flag.startswith("--") else name, None)
        if value is None:
            continue
        if isinstance(value, list):
            value = tuple(value)
        outer, _, inner = name.partition(".")
        if inner:
            nested.setdefault(outer, {})[inner] = value
        else:
            fields[name] = value
    hints = get_type_hints(cls)
    for outer, inner_values in nested.items():
        fields[outer] = hints[outer](**inner_values)
    fields.update(values)
    if isinstance(fields.get("data_dir"), pathlib.Path):
        fields["data_dir"] = fields["data_dir"].resolve()
    return cls(**fields)
