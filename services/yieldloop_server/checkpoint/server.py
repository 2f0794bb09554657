"""CheckpointService process wiring."""

from __future__ import annotations

import pathlib
from collections.abc import Awaitable, Callable

from yieldloop.client import Client
from yieldloop.errors import DeadlineExceededError, NotFoundError, UnavailableError
from yieldloop.proto.checkpoint.v1 import checkpoint_service_pb2_grpc as pb_grpc
from yieldloop.transport import DEFAULT_TRANSPORT, TransportConfig
from yieldloop.types import Manifest
from yieldloop_server.checkpoint.importer import ImportPolicy
from yieldloop_server.checkpoint.pending import PendingHeads
from yieldloop_server.checkpoint.registry import CheckpointRegistry
from yieldloop_server.checkpoint.servicer import CheckpointServicer
from yieldloop_server.common.auth import KeyStore
from yieldloop_server.common.grpc_server import GrpcServer
from yieldloop_server.common.service import Service
from yieldloop_server.config import ServeOptions
from yieldloop_server.store import ObjectStore

SERVICE_NAME = "yieldloop.checkpoint.v1.CheckpointService"
PROBE_TIMEOUT_S = 3.0
"""How long a pending head's trainer has to say it still serves the checkpoint before the head is settled."""


def trainer_probe(transport: TransportConfig) -> Callable[[Manifest], Awaitable[bool]]:
    """Whether a pending checkpoint's trainer is alive and still holds it (PullWeights with ``probe``): a trainer
    that is unreachable or answers NOT_FOUND (a new process on its address) does not; any other answer counts
    as holding it (nothing is given up on a doubt)."""

    async def holds(manifest: Manifest) -> bool:
        if not manifest.weights_source:
            return False
        client = Client(trainer=manifest.weights_source, transport=transport, retry_within_s=0, timeout=PROBE_TIMEOUT_S)
        try:
            async for _ in client.pull_weights(manifest.model, manifest.checkpoint_id, probe=True):
                break
            return True
        except (NotFoundError, UnavailableError, DeadlineExceededError):
            return False
        finally:
            await client.close()

    return holds


async def build(
    options: ServeOptions, store: ObjectStore, transport: TransportConfig, keys: KeyStore | None = None
) -> Service:
    """CheckpointService as ``yieldloop serve checkpoint`` runs it (its options: ``options.checkpoint``)."""
    own = options.checkpoint
    forbidden = (options.data_dir, *((store.root,) if hasattr(store, "root") else ()))
    imports = ImportPolicy(tuple(pathlib.Path(root) for root in own.import_roots), forbidden)
    server = make_server(
        store, options.host, options.port, own.keep_last, transport, keys, imports, int(own.max_upload_gb * 10**9)
    )
    return Service(server.start, server.stop)


def make_server(
    store: ObjectStore,
    host: str = "127.0.0.1",
    port: int = 0,
    keep_last: int = 0,
    transport: TransportConfig = DEFAULT_TRANSPORT,
    keys: KeyStore | None = None,
    imports: ImportPolicy = ImportPolicy(),
    max_upload_bytes: int = 500 * 10**9,
) -> GrpcServer:
    """A CheckpointService server over ``store`` (not started); ``keep_last`` > 0 applies retention on commit;
    ``imports`` says which server-side folders admins may import."""
    server = GrpcServer(host, port, transport)
    registry = CheckpointRegistry(store, keep_last=keep_last)
    servicer = CheckpointServicer(
        registry, keys, PendingHeads(registry, trainer_probe(transport)), imports, max_upload_bytes
    )
    server.add(pb_grpc.add_CheckpointServiceServicer_to_server, servicer, SERVICE_NAME)
    return server
