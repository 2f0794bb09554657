"""The HUD front's process wiring (``yieldloop serve hud``)."""

from __future__ import annotations

from yieldloop.client import Client
from yieldloop.transport import TransportConfig
from yieldloop_server.common.auth import KeyStore
from yieldloop_server.common.service import Service
from yieldloop_server.config import ServeOptions
from yieldloop_server.hud.front import HudFront
from yieldloop_server.store import ObjectStore


async def build(
    options: ServeOptions, store: ObjectStore, transport: TransportConfig, keys: KeyStore | None = None
) -> Service:
    """The HUD front: HUD's HTTP contracts over the stack's services (their addresses in ``options``)."""
    client = Client(
        checkpoint=options.checkpoint_address,
        trainer=options.trainer_address,
        rollout=options.rollout_address,
        transport=transport,
    )
    front = HudFront(client, store, options.host, options.port, transport, auth=options.auth)

    async def stop(grace: float) -> None:
        await front.stop()
        await client.close()

    return Service(front.start, stop)
