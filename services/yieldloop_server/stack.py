"""Starting the four services together: in one process (tests) or one process each (``yieldloop up``).

Data directory layout::

    <data>/store/            filesystem object store (models, checkpoints, HEAD)
    <data>/work/<service>/   scratch and verified-checkpoint caches
    <data>/run/<service>.json  address of each running service (written when ready)
    <data>/logs/<service>.log  output of each service process
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import pathlib
from collections.abc import Callable

from yieldloop_server.checkpoint.importer import BASE_CHECKPOINT, inspect_folder
from yieldloop_server.checkpoint.registry import CheckpointRegistry, Manifest
from yieldloop_server.common.auth import SERVICE_TEAM
from yieldloop_server.common.service import Stopper
from yieldloop_server.config import SERVICES, ServeOptions, StackConfig
from yieldloop_server.serve import build_service
from yieldloop_server.store import ObjectStore
from yieldloop_server.supervisor import ServiceProcess
from yieldloop_server.weights.files import upload_folder

log = logging.getLogger(__name__)

BUILTIN_MODEL = "tiny"
"""The slug of the model a stack creates offline when it is asked for and absent (the embedded default)."""


def ensure_model(store: ObjectStore, model: str, progress: Callable[[str], None] = lambda line: None) -> str:
    """The slug a stack serves for ``model`` (``--model``).

    ``model`` is an existing slug; the built-in tiny model (created offline on first use); or a Hugging Face
    source, a folder or a hub id in the local cache, imported on first start under a slug named after it
    (later starts find that slug).

    Raises:
        NotFoundError: MODEL_NOT_FOUND naming the models that exist, when ``model`` is none of these.
    """
    from yieldloop.errors import AlreadyExistsError, InvalidArgumentError, NotFoundError
    from yieldloop_server.checkpoint.importer import hub_cache_dir, import_model, resolve_source, slug_for

    registry = CheckpointRegistry(store)
    try:
        registry.get_model(model)
        return model
    except (NotFoundError, InvalidArgumentError):  # not a slug of this store (or not a slug at all)
        pass
    if model == BUILTIN_MODEL:
        ensure_base_model(store, model, progress)
        return model
    if resolve_source(model) is None:
        known = ", ".join(sorted(m.slug for m in registry.list_models())) or "none"
        raise NotFoundError(
            f"no model {model!r}: not a model of this store (it has: {known}), not the built-in "
            f"{BUILTIN_MODEL!r}, not a folder, and not in the local Hugging Face cache {hub_cache_dir()}",
            reason="MODEL_NOT_FOUND",
        )
    slug = slug_for(model)
    progress(f"importing {model} as {slug} (first start on this store)")
    try:
        import_model(registry, model, slug, owner=SERVICE_TEAM, public=True)
    except AlreadyExistsError:
        existing = registry.get_model(slug)
        if existing.source != model:
            raise AlreadyExistsError(
                f"model {slug!r} exists (from {existing.source or 'elsewhere'!r}), so {model!r} cannot be imported "
                f"under that name: import it with `yieldloop models import {model} --name OTHER`",
                reason="MODEL_ALREADY_EXISTS",
            ) from None
    return slug


def ensure_base_model(
    store: ObjectStore, slug: str = BUILTIN_MODEL, progress: Callable[[str], None] = lambda line: None
) -> bool:
    """Creates the tiny model offline and commits it as ``slug``'s head when the slug is absent.

    Returns True when a model was created.
    """
    from yieldloop.errors import NotFoundError
    from yieldloop_server.common.tiny_model import cached_tiny_model

    registry = CheckpointRegistry(store)
    try:
        registry.get_model(slug)
        return False
    except NotFoundError:
        pass
    folder = cached_tiny_model(progress=progress)
    facts = inspect_folder(folder, "the built-in model")
    progress(f"storing it as the model {slug!r}")
    objects = upload_folder(store, slug, BASE_CHECKPOINT, folder)
    registry.create_model(facts.base_info(slug, "built-in", SERVICE_TEAM, sum(o.size for o in objects), public=True))
    registry.commit(Manifest(model=slug, checkpoint_id=BASE_CHECKPOINT, objects=objects), set_head=True)
    return True


def ensure_stack_keys(store: ObjectStore, data_dir: pathlib.Path) -> tuple[str, str]:
    """The stack's admin key (``<data_dir>/api_key``, mode 0600, picked up by the CLI and ``connect()``) and its
    services' key (``<data_dir>/run/service_key``): kept while they are valid in ``store``, made otherwise."""
    from yieldloop.training import API_KEY_FILE
    from yieldloop_server.common.auth import KeyStore

    keys = KeyStore(store)
    found = []
    for path, role, name in (
        (data_dir / API_KEY_FILE, "admin", "the stack's admin key"),
        (data_dir / "run" / "service_key", "service", "the stack's services"),
    ):
        try:
            key = path.read_text().strip()
        except OSError:
            key = ""
        principal = keys.check(key) if key else None
        if principal is None or principal.role != role:
            _, key = keys.create(SERVICE_TEAM, role, name=name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as file:
                file.write(key + "\n")
        found.append(key)
    return found[0], found[1]


async def prepare_stack(
    config: StackConfig, progress: Callable[[str], None] = lambda line: None
) -> tuple[StackConfig, str, str]:
    """What every stack does before its services start: the model it serves (created or imported on first use),
    its TLS certificates (``--tls``) and its keys (with auth). Returns the config the services get, the admin key
    and the services' key ("" and "" without auth)."""
    from yieldloop_server.store import open_store

    store = open_store(config.store_url)
    slug = await asyncio.to_thread(ensure_model, store, config.model, progress)
    config = dataclasses.replace(await asyncio.to_thread(config.with_tls), model=slug)
    if not config.auth:
        return config, "", ""
    admin_key, service_key = await asyncio.to_thread(ensure_stack_keys, store, config.data_dir)
    return config, admin_key, service_key


HUD_ENV = "run/hud.env"
"""Under DATA_DIR: ``export HUD_...=...`` lines that point the HUD SDK at the stack (the API key included)."""


def write_hud_env(config: StackConfig, base_url: str, api_key: str) -> pathlib.Path:
    """Writes DATA_DIR/run/hud.env (mode 0600: it holds a key) for ``source``-ing before a HUD SDK script."""
    from yieldloop_server.common import write_file_atomically
    from yieldloop_server.hud.front import hud_settings

    path = config.data_dir / HUD_ENV
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(
        f"export {name}={value}\n" for name, value in hud_settings(base_url, api_key, config.transport.tls_ca).items()
    )
    write_file_atomically(path, lines, 0o600)  # a reader (a script waiting for it) never sees it half written
    return path


class InProcessStack:
    """All four services (and the HUD front) in the current event loop, on free ports (for tests and embedding)."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.addresses: dict[str, str] = {}
        self._stoppers: list[Stopper] = []
        self.api_key = ""
        """The stack's admin key ("" without auth)."""
        self.hud_url = ""
        """The HUD front's base URL ("" when not served)."""

    async def start(self) -> dict[str, str]:
        """Starts the services; returns the four gRPC services' addresses (the HUD front's URL is :attr:`hud_url`)."""
        self.config, self.api_key, service_key = await prepare_stack(self.config)
        for service in (*SERVICES, "hud") if self.config.hud else SERVICES:  # in dependency order
            options = dataclasses.replace(
                ServeOptions.of(self.config, service, self.addresses), service_key=service_key
            )
            built = await build_service(options)
            start, stop = built.start, built.stop
            address = await start()
            self._stoppers.append(stop)
            if service == "hud":
                self.hud_url = address
                write_hud_env(self.config, address, self.api_key)
            else:
                self.addresses[service] = address
        return self.addresses

    async def stop(self, grace: float = 5.0) -> None:
        for stop in reversed(self._stoppers):
            await stop(grace)
        self._stoppers.clear()


class ProcessStack:
    """Each service in its own process (``yieldloop serve <service>``), as ``yieldloop up`` runs them; a process
    that dies is started again on the same address (:class:`ServiceProcess`)."""

    def __init__(
        self, config: StackConfig, ready_timeout_s: float = 300.0, progress: Callable[[str], None] = lambda line: None
    ) -> None:
        self.config = config
        self.progress = progress
        """Told what a first start does at length (creating or importing the model)."""
        self.ready_timeout_s = ready_timeout_s
        self.addresses: dict[str, str] = {}
        self.services: dict[str, ServiceProcess] = {}
        self.api_key = ""
        """The stack's admin key ("" without auth)."""
        self.hud_url = ""
        """The HUD front's base URL ("" when not served)."""
        self._service_key = ""

    async def _spawn(self, service: str) -> None:
        run_dir = self.config.data_dir / "run"
        run_dir.mkdir(parents=True, exist_ok=True)
        options = ServeOptions.of(self.config, service, self.addresses).sharing_cores()
        options.ready_file = run_dir / f"{service}.json"
        self.services[service] = process = ServiceProcess(
            options, self.config.data_dir / "logs", self.ready_timeout_s, service_key=self._service_key
        )
        self.addresses[service] = await process.start()

    async def start(self) -> dict[str, str]:
        from yieldloop.stackdir import take_lock

        take_lock(self.config.data_dir)
        try:
            check_ports_free(self.config)
            self.config, self.api_key, self._service_key = await prepare_stack(self.config, self.progress)
        except BaseException:
            await self.stop()
            raise
        try:
            await asyncio.gather(self._spawn("checkpoint"), self._spawn("env"))
            await asyncio.gather(self._spawn("trainer"), self._spawn("rollout"))
            if self.config.hud:
                await self._spawn("hud")
                self.hud_url = self.addresses.pop("hud")
                write_hud_env(self.config, self.hud_url, self.api_key)
        except BaseException:
            await self.stop()
            raise
        return self.addresses

    async def stop(self, timeout_s: float = 15.0) -> None:
        """Stops every process at once (SIGTERM, then SIGKILL after ``timeout_s``); their ready files and the data
        directory's lock go with them, so the next command hears STACK_NOT_RUNNING, not a refused connection."""
        from yieldloop.stackdir import release_lock

        await asyncio.gather(*(process.stop(timeout_s) for process in self.services.values()))
        for process in self.services.values():
            if process.options.ready_file is not None:
                process.options.ready_file.unlink(missing_ok=True)
        self.services.clear()
        release_lock(self.config.data_dir)


def check_ports_free(config: StackConfig) -> None:
    """Fails fast, in one line, when a port the stack would bind from ``base_port`` is taken.

    Raises:
        FailedPreconditionError: PORT_IN_USE naming the port and what to do.
    """
    import socket

    from yieldloop.errors import FailedPreconditionError
    from yieldloop_server.config import STACK_PORTS

    for what in STACK_PORTS:
        port = config.port_of(what)
        if port <= 0 or (what == "hud" and not config.hud):
            continue
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((config.host, port))
            except OSError:
                raise FailedPreconditionError(
                    f"port {port} ({what}) on {config.host} is in use (another stack? `yieldloop status`): "
                    f"start with --base-port N for ports N..N+5, or --base-port 0 for free ones",
                    reason="PORT_IN_USE",
                ) from None
