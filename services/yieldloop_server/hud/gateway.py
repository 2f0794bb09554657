"""HUD's gateway on the front (``HUD_GATEWAY_URL``): ``/v1/chat/completions`` and ``/v1/models``, forwarded to
RolloutService's OpenAI-compatible endpoint; an answer to a request carrying ``Trace-Id`` becomes that trace's next
sample."""

from __future__ import annotations

import contextlib
import json
from typing import Any

from yieldloop.client import Client
from yieldloop.errors import UnavailableError, YieldloopError
from yieldloop.transport import TransportConfig
from yieldloop.types import Turn
from yieldloop_server.common.http import BodyTimeout, error_response, json_object, read_json, timeout_response
from yieldloop_server.hud.common import Contract, presented_key_of
from yieldloop_server.hud.traces import OpenTrace, Traces


class Gateway(Contract):
    """The gateway's routes (raw aiohttp handlers: the answers are the endpoint's own)."""

    def __init__(self, client: Client, transport: TransportConfig, auth: bool, traces: Traces) -> None:
        super().__init__(client, transport, auth)
        self.traces = traces
        self.gateway_url = ""
        """RolloutService's OpenAI-compatible base URL (found at start)."""
        self._session: Any = None

    async def open(self) -> None:
        """Finds the endpoint and opens the connection pool to it."""
        import aiohttp

        info = await self.client.get_serving_info()
        self.gateway_url = info.openai_base_url
        ssl: Any = None
        if self.gateway_url.startswith("https") and self.transport.tls_ca:
            import ssl as ssl_module

            ssl = ssl_module.create_default_context(cafile=self.transport.tls_ca)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=ssl, limit=0), timeout=aiohttp.ClientTimeout(total=None, sock_connect=30)
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def routes(self, handler: Any) -> list[Any]:
        from aiohttp import web

        return [web.post("/v1/chat/completions", self._chat), web.get("/v1/models", self._gateway_models)]

    async def _gateway_models(self, request: Any) -> Any:
        return await self._forward_http(request, "GET", "/models", None)

    async def _chat(self, request: Any) -> Any:
        """Chat completions, forwarded to the rollout's endpoint; with ``Trace-Id`` the answer's tokens become
        the trace's next sample."""
        try:
            body = json_object(await read_json(request, self.transport.http_body_timeout_s))
            trace_id = request.headers.get("Trace-Id", "")
            trace = await self.traces.trace(trace_id, self.caller(request)) if trace_id else None
            if trace is not None:
                # A trace's sample needs its token ids and logprobs, asked for or not (an agent that forgot
                # `return_token_ids` still trains); the extra fields in the answer are ignored by any client.
                body = {**body, "return_token_ids": True, "logprobs": True}
                trace.prompt = trace.prompt or _prompt_text(body.get("messages"))
        except BodyTimeout as err:
            return timeout_response(err)
        except YieldloopError as err:
            return error_response(err)
        return await self._forward_http(request, "POST", "/chat/completions", body, trace)

    async def _forward_http(
        self, request: Any, method: str, path: str, body: Any, trace: OpenTrace | None = None
    ) -> Any:
        """Forwards to RolloutService's OpenAI-compatible endpoint; when it cannot be reached, its address is asked
        again (GetServingInfo) and the request tried once more."""
        from aiohttp import ClientConnectorError, ClientError

        if not self.gateway_url:
            return error_response(
                UnavailableError(
                    "the rollout service serves no HTTP endpoint (--http-port -1)", reason="GATEWAY_UNAVAILABLE"
                )
            )
        key = presented_key_of(request)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if "traceparent" in request.headers:
            headers["traceparent"] = request.headers["traceparent"]
        for attempt in range(2):
            try:
                return await self._forward_once(request, method, path, body, headers, trace)
            except ClientConnectorError as err:
                failure = err
                if attempt == 0:  # the endpoint moved (a rollout service restarted elsewhere): ask again
                    with contextlib.suppress(YieldloopError):
                        self.gateway_url = (await self.client.get_serving_info()).openai_base_url or self.gateway_url
            except ClientError as err:
                failure = err
                break
        return error_response(
            UnavailableError(f"the rollout service's endpoint did not answer: {failure}", reason="GATEWAY_UNAVAILABLE")
        )

    async def _forward_once(
        self, request: Any, method: str, path: str, body: Any, headers: dict[str, str], trace: OpenTrace | None
    ) -> Any:
        from aiohttp import web

        async with self._session.request(method, self.gateway_url + path, json=body, headers=headers) as upstream:
            if body and body.get("stream"):  # streamed through as it comes (not recorded as a sample)
                response = web.StreamResponse(
                    status=upstream.status,
                    headers={"Content-Type": upstream.headers.get("Content-Type", "text/event-stream")},
                )
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                return response
            data = await upstream.read()
            status = upstream.status
        if trace is not None and status == 200:
            trace.samples.append(_sample(json.loads(data)))
            if body.get("model") and not trace.model:
                trace.model = body["model"]
        return web.Response(body=data, status=status, content_type="application/json")


def _prompt_text(messages: Any) -> str:
    """The text of the last user message of a chat request ("" when there is none)."""
    for message in reversed(messages if isinstance(messages, list) else []):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def _sample(answer: dict[str, Any]) -> Turn:
    """The turn one chat completion sampled: the prompt ids, the sampled ids and their logprobs."""
    choice = answer["choices"][0]
    content = (choice.get("logprobs") or {}).get("content") or []
    return Turn(
        prompt_token_ids=list(choice.get("prompt_token_ids") or answer.get("prompt_token_ids") or []),
        completion_token_ids=list(choice.get("token_ids") or []),
        completion_logprobs=[float(item["logprob"]) for item in content],
        weight_version=choice.get("weight_version", ""),
        completion_text=(choice.get("message") or {}).get("content") or "",
    )
