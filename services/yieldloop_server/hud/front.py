"""The HUD front: the HTTP contracts of HUD's cloud, served by a stack, so scripts written with the unmodified
HUD SDK (``pip install hud``) train on yieldloop by setting environment variables.

The SDK reaches its cloud through base URLs; this one server answers all of them (``yieldloop up`` writes the
values to ``DATA_DIR/run/hud.env``):

- ``HUD_API_URL``: the model catalog (``GET /v2/models``, ``/v2/models/resolve``), a model's checkpoint tree
  (``GET /v2/models/{id}/checkpoints``), its head (``PUT /v2/models/{id}/head``), forks
  (``POST /v2/models/fork``), and the SDK's job and trace reports (``POST /v2/trace/job/{id}/enter``,
  ``/v2/trace/{id}/enter``, ``/v2/trace/{id}/exit``), which record the runs in the stack's trace store;
- ``HUD_RL_URL``: training, ``/v1/models/{id}/train/`` ``losses``, ``forward-backward``, ``forward``,
  ``backward``, ``optim-step``, on TrainerService;
- ``HUD_GATEWAY_URL`` (``.../v1``): ``/v1/chat/completions`` and ``/v1/models``, forwarded to RolloutService's
  OpenAI-compatible endpoint; an answer to a request carrying ``Trace-Id`` is kept as that trace's next sample
  (prompt ids, sampled ids, logprobs, weight version) until the trace exits and is recorded as a run;
- ``HUD_TELEMETRY_URL`` (``.../v3/api``): the SDK's span uploads, kept in the store beside the runs.

A model's id in these contracts is its slug. Every request needs a yieldloop API key (``Authorization: Bearer``,
the SDK's ``HUD_API_KEY``), checked here by the same interceptor as every service, then forwarded with each call
this front makes, so the services apply the key's role and its team's ownership exactly as to any client.
Replies have exactly the fields the SDK's models declare (it validates them strictly); errors are typed
(:mod:`yieldloop_server.common.http`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from yieldloop.client import Client
from yieldloop.errors import YieldloopError, as_yieldloop_error
from yieldloop.transport import DEFAULT_TRANSPORT, TransportConfig
from yieldloop_server.common import http
from yieldloop_server.hud.catalog import Catalog
from yieldloop_server.hud.gateway import Gateway
from yieldloop_server.hud.traces import Traces
from yieldloop_server.hud.training import Training
from yieldloop_server.store import ObjectStore

log = logging.getLogger(__name__)


class HudFront(http.HttpServer):
    """The HUD SDK's base URLs on one port, one module per contract (:mod:`.catalog`, :mod:`.training`,
    :mod:`.traces`, :mod:`.gateway`); see the module's docstring.

    Args:
        client: Calls CheckpointService, TrainerService and RolloutService (with the service key; each request
            forwards its caller's key instead).
        store: The stack's object store (the SDK's span uploads are kept there).
    """

    def __init__(
        self,
        client: Client,
        store: ObjectStore,
        host: str = "127.0.0.1",
        port: int = 0,
        transport: TransportConfig = DEFAULT_TRANSPORT,
        auth: bool = True,
    ) -> None:
        super().__init__(host, port, transport)
        self.client = client
        self.auth = auth
        self.catalog = Catalog(client, transport, auth)
        self.training = Training(client, transport, auth)
        self.traces = Traces(client, transport, auth, store)
        self.gateway = Gateway(client, transport, auth, self.traces)

    async def start(self) -> str:
        await self.gateway.open()
        return await super().start()

    async def stop(self) -> None:
        await super().stop()
        await self.gateway.close()

    def routes(self) -> list[Any]:
        contracts = (self.catalog, self.training, self.traces, self.gateway)
        return [route for contract in contracts for route in contract.routes(self._handler)]

    def _handler(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A route: its JSON body read (POST/PUT), the caller's client built, the reply as JSON, errors typed."""
        from aiohttp import web

        async def handle(request: Any) -> Any:
            try:
                body = (
                    http.json_object(await http.read_json(request, self.transport.http_body_timeout_s))
                    if request.method in ("POST", "PUT") and request.can_read_body
                    else {}
                )
                reply = await fn(request, body, self.catalog.caller(request))
            except http.BodyTimeout as err:
                return http.timeout_response(err)
            except Exception as err:  # the request's boundary: a typed answer, the front keeps serving
                if not isinstance(err, YieldloopError):
                    log.exception("unexpected error in %s %s", request.method, request.path)
                return http.error_response(as_yieldloop_error(err))
            return web.json_response(reply)

        return handle


def hud_settings(base_url: str, api_key: str, ca_file: str = "") -> dict[str, str]:
    """The HUD SDK's settings that point it at the front at ``base_url``: every base URL it has (the telemetry one
    too, or the SDK would upload its spans to HUD's cloud; the web and runtime ones, which it would otherwise
    reach for a login or a tunnel), the key it sends (``none`` for a stack without auth; the SDK needs one), its
    CLI's analytics and version check off, plus the stack's CA for https."""
    settings = {
        "HUD_API_URL": base_url,
        "HUD_RL_URL": base_url,
        "HUD_GATEWAY_URL": f"{base_url}/v1",
        "HUD_TELEMETRY_URL": f"{base_url}/v3/api",
        "HUD_WEB_URL": base_url,
        "HUD_RUNTIME_URL": base_url,
        "HUD_API_KEY": api_key or "none",
        # Nothing else leaves the machine: the CLI's usage analytics and its check for a newer release on PyPI.
        "HUD_CLI_ANALYTICS_ENABLED": "false",
        "HUD_SKIP_VERSION_CHECK": "1",
    }
    if ca_file:
        settings["SSL_CERT_FILE"] = ca_file
    return settings
