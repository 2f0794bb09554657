"""RolloutService's OpenAI-compatible HTTP endpoint, for agents written against the OpenAI API.

``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` (plain and
``stream: true`` server-sent events), served by the same engine as gRPC
``Generate``, in the service's event loop. Every choice carries the exact
``token_ids`` it sampled and the response the ``prompt_token_ids`` (the shape
vLLM's ``return_token_ids`` uses), plus the ``weight_version`` that sampled
them, so any agent framework pointed at this base URL produces training
rollouts. Tools are rendered with the model's chat template and tool calls
parsed from Hermes/Qwen ``<tool_call>`` markup into ``message.tool_calls``.

A multi-turn agent that keeps its token ids sends, with a chat request, the previous turn's ``prompt_token_ids``
+ ``token_ids`` as ``prompt_token_ids`` and the index of the first message that is new since then as
``continuation_from`` (the HUD SDK's agents do): the prompt is then those ids and the rendering of the new
messages only, as the rollout's own agent loop builds its turns, so the tokens trained on are the tokens the
model saw (a whole conversation rendered again can tokenize differently).

Errors are OpenAI-shaped with the HTTP status of their gRPC code (:mod:`yieldloop_server.common.http`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from yieldloop.errors import InvalidArgumentError, YieldloopError, as_yieldloop_error, invalid_field, parse_json
from yieldloop.transport import DEFAULT_TRANSPORT, TransportConfig
from yieldloop_server.common.auth import ModelAccess, current_principal, may
from yieldloop_server.common.http import (
    BodyTimeout,
    HttpServer,
    error_response,
    json_object,
    read_json,
    timeout_response,
)
from yieldloop_server.rollout.agent import MalformedToolCall, continuation_ids, parse_tool_calls, strip_tool_calls
from yieldloop_server.rollout.engines import SamplingConfig, TokenDelta, whole_completion
from yieldloop_server.rollout.engines.base import chat_chars
from yieldloop_server.rollout.models import ServedModel, ServedModels

log = logging.getLogger(__name__)
_FINISH = {"eos": "stop", "stop_string": "stop", "length": "length", "context": "length", "cancelled": "stop"}


def _typed(body: dict[str, Any], name: str, kinds: tuple[type, ...], what: str, default: Any) -> Any:
    """``body[name]`` when it has one of ``kinds`` (never coerced; booleans are not numbers), else INVALID."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise invalid_field(name, f"{name} must be {what}, got {json.dumps(value)[:40]}")
    return value


def _sampling(body: dict[str, Any], max_tokens_keys: tuple[str, ...]) -> SamplingConfig:
    key = next((k for k in max_tokens_keys if body.get(k) is not None), max_tokens_keys[-1])
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise invalid_field("stop", "stop must be a string or a list of strings")
    top_k = _typed(body, "top_k", (int,), "an integer", 0)
    config = SamplingConfig(
        max_tokens=_typed(body, key, (int,), "an integer", 256),
        temperature=float(_typed(body, "temperature", (int, float), "a number", 1.0)),
        top_p=float(_typed(body, "top_p", (int, float), "a number", 1.0)),
        top_k=0 if top_k == -1 else top_k,  # vLLM's "-1: off"
        stop=stop,
        seed=_typed(body, "seed", (int,), "an integer", 0),
        ignore_eos=_typed(body, "ignore_eos", (bool,), "a boolean", False),
    )
    try:
        return config.validate()
    except InvalidArgumentError as err:  # name the body's field, not the internal one
        field = err.field.removeprefix("sampling.")
        raise invalid_field(key if field == "max_tokens" else field, err.message) from None


def _message_text(message: dict[str, Any], index: int = 0) -> str:
    """A message's text; an assistant turn's ``tool_calls`` become the Hermes markup the template shows.
    INVALID_ARGUMENT naming the field for content or tool calls of the wrong shape (never coerced)."""
    field = f"messages[{index}]"
    content = message.get("content") or ""
    if isinstance(content, list):  # content parts: only text parts exist for these models
        if not all(isinstance(part, dict) and isinstance(part.get("text", ""), str) for part in content):
            raise invalid_field(f"{field}.content", "content parts must be objects with a text string")
        content = "".join(part.get("text", "") for part in content)
    elif not isinstance(content, str):
        raise invalid_field(f"{field}.content", "content must be a string or a list of content parts")
    if not isinstance(message.get("role", "user"), str):
        raise invalid_field(f"{field}.role", "role must be a string")
    parts = [content] if content else []
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise invalid_field(f"{field}.tool_calls", "tool_calls must be a list")
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid_field(f"{field}.tool_calls", "each tool call needs a function with a name")
        arguments = function.get("arguments", "{}")
        arguments = parse_json(arguments, f"{field}.tool_calls") if isinstance(arguments, str) else arguments
        if not isinstance(arguments, dict):
            raise invalid_field(f"{field}.tool_calls", "a tool call's arguments must be a JSON object")
        parts.append(f"<tool_call>\n{json.dumps({'name': function['name'], 'arguments': arguments})}\n</tool_call>")
    return "\n".join(parts)


def _continuation(body: dict[str, Any], rendered: list[dict[str, Any]]) -> tuple[list[int], int]:
    """(the previous turn's ids, index of the first new message) of a continued chat request.

    ``continuation_from`` counts the messages as sent, or as the agent keeps them when it prepends a system
    prompt to every request; either way the message before the new ones is the assistant turn those ids end
    with, which is how the two are told apart. INVALID_ARGUMENT naming the field otherwise."""
    previous = body["prompt_token_ids"]
    if (
        not isinstance(previous, list)
        or not previous
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in previous)
    ):
        raise invalid_field("prompt_token_ids", "prompt_token_ids must be a non-empty list of token ids")
    start = body.get("continuation_from")
    if isinstance(start, bool) or not isinstance(start, int):
        raise invalid_field(
            "continuation_from",
            "prompt_token_ids needs continuation_from: the index of the first "
            "message after the turn those ids end with",
        )
    if rendered[0]["role"] == "system" and 0 < start < len(rendered) and rendered[start]["role"] == "assistant":
        start += 1  # counted without the system prompt
    if not 1 <= start <= len(rendered) or rendered[start - 1]["role"] != "assistant":
        raise invalid_field(
            "continuation_from", f"messages[{start - 1}] must be the assistant turn the prompt_token_ids end with"
        )
    if start == len(rendered):
        raise invalid_field("continuation_from", "there are no messages after the assistant turn to continue with")
    return previous, start


class OpenAIEndpoint(HttpServer):
    """The HTTP endpoint of one RolloutService (``base_url`` is ``http://host:port/v1``)."""

    path_prefix = "/v1"

    def __init__(
        self,
        models: ServedModels,
        host: str = "127.0.0.1",
        port: int = 0,
        transport: TransportConfig = DEFAULT_TRANSPORT,
        stream_interval_s: float = 0.0,
        access: ModelAccess | None = None,
    ) -> None:
        super().__init__(host, port, transport)
        self.models = models
        self.stream_interval_s = stream_interval_s
        """``stream: true`` answers send at most one chunk per this many seconds (SamplingConfig.stream_interval_s)."""
        self.access = access
        """Checks the caller may sample the model it names (the RolloutService's own check)."""

    def routes(self) -> list[Any]:
        from aiohttp import web

        return [
            web.get("/v1/models", self._models),
            web.post("/v1/completions", self._completions),
            web.post("/v1/chat/completions", self._chat),
        ]

    # Handlers ----------------------------------------------------------------------------

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        # Every slug of the store is served on request: the default first; loaded ones with their weights.
        slugs = [self.models.default]
        if self.models.checkpoints is not None:
            principal = current_principal()
            listed = await self.models.checkpoints.list_models()
            visible = sorted(m.slug for m in listed if may(principal, m, "see"))
            slugs = [slug for slug in slugs if slug in visible] + [s for s in visible if s != self.models.default]
        loaded = {served.slug: served.engine for served in self.models.loaded}
        cards = []
        for slug in slugs:
            card: dict[str, Any] = {
                "id": slug,
                "object": "model",
                "created": 0,
                "owned_by": "yieldloop",
                "weight_version": loaded[slug].weight_version if slug in loaded else "",
            }
            if slug in loaded and loaded[slug].weight_version:
                card["max_model_len"] = loaded[slug].max_model_len
            cards.append(card)
        return web.json_response({"object": "list", "data": cards})

    async def _completions(self, request: Any) -> Any:
        return await self._handle(request, chat=False)

    async def _chat(self, request: Any) -> Any:
        return await self._handle(request, chat=True)

    async def _handle(self, request: Any, chat: bool) -> Any:
        try:
            body = json_object(await read_json(request, self.transport.http_body_timeout_s))
            model = body.get("model") or ""
            if not isinstance(model, str):
                raise invalid_field("model", "model must be a model slug")
            n = body.get("n", 1)
            if n is None:
                n = 1
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 64:
                raise invalid_field("n", "n must be an integer in [1, 64]")
            sampling = _sampling(body, ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",))
            if self.access is not None:
                await self.access.require(model or self.models.default, "sample")
            async with self.models.use(model) as served:  # NOT_FOUND (MODEL_NOT_FOUND) for a missing slug
                prompt_ids = await (self._chat_prompt(served, body) if chat else self._completion_prompt(served, body))
                if body.get("stream"):
                    if n != 1:
                        raise invalid_field("n", "streaming supports n = 1")
                    return await self._stream(served, request, chat, body, prompt_ids, sampling)
                choices = await asyncio.gather(*(self._collect(served, prompt_ids, sampling, i) for i in range(n)))
                response = self._response(served, chat, body, prompt_ids, choices)
        except BodyTimeout as err:
            return timeout_response(err)
        except Exception as err:  # the request's boundary: a typed answer, the endpoint keeps serving
            if not isinstance(err, YieldloopError):
                log.exception("unexpected error in %s", request.path)
            return error_response(as_yieldloop_error(err))
        from aiohttp import web

        return web.json_response(response)

    async def _completion_prompt(self, served: ServedModel, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return await served.engine.encode_async(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        raise invalid_field("prompt", "prompt must be a string or a list of token ids (one prompt per request)")

    async def _chat_prompt(self, served: ServedModel, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise invalid_field("messages", "messages must be a non-empty list of message objects")
        rendered = [{"role": m.get("role", "user"), "content": _message_text(m, i)} for i, m in enumerate(messages)]
        tools = body.get("tools") or None
        if tools is not None and (
            not isinstance(tools, list)
            or not all(
                isinstance(t, dict)
                and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str)
                for t in tools
            )
        ):
            raise invalid_field("tools", 'tools must be a list of {"type": "function", "function": {"name": ...}}')
        if body.get("prompt_token_ids") is None:
            return await served.engine.render_chat_async(rendered, tools)
        previous, start = _continuation(body, rendered)
        engine = served.engine
        added = chat_chars(rendered[start:], None)
        engine.check_text(added)  # the whole prompt is checked (length, vocabulary) where every prompt is
        # The new messages' tokens after the previous ids, exactly as the agent loop extends its own turns.
        return [
            *previous,
            *await engine.off_loop(
                added, continuation_ids, engine, rendered[: start - 1], tools, previous[-1:], rendered[start:]
            ),
        ]

    async def _collect(
        self, served: ServedModel, prompt_ids: list[int], sampling: SamplingConfig, index: int
    ) -> dict[str, Any]:
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: set[str] = set()
        reason = ""
        async for delta in served.engine.generate(prompt_ids, whole_completion(sampling)):
            tokens += delta.token_ids
            logprobs += delta.logprobs
            versions.add(delta.weight_version)
            reason = delta.stop_reason or reason
        return {
            "index": index,
            "token_ids": tokens,
            "logprobs": logprobs,
            "stop": reason,
            "weight_version": ",".join(sorted(versions)),
        }

    def _choice(self, served: ServedModel, chat: bool, body: dict[str, Any], sampled: dict[str, Any]) -> dict[str, Any]:
        text = served.engine.decode(sampled["token_ids"])
        finish = _FINISH.get(sampled["stop"], "stop")
        choice: dict[str, Any] = {
            "index": sampled["index"],
            "finish_reason": finish,
            "token_ids": sampled["token_ids"],
            "weight_version": sampled["weight_version"],
        }
        pieces = (
            [served.engine.decode([t], skip_special_tokens=False) for t in sampled["token_ids"]]
            if body.get("logprobs") not in (None, False)
            else []
        )
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            try:
                calls = parse_tool_calls(text) if body.get("tools") else []
            except MalformedToolCall:
                calls = []
            if calls:
                message["content"] = strip_tool_calls(text) or None
                message["tool_calls"] = [
                    {
                        "id": f"call_{uuid.uuid4().hex[:12]}",
                        "type": "function",
                        "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                    }
                    for c in calls
                ]
                choice["finish_reason"] = "tool_calls"
            choice["message"] = message
            choice["logprobs"] = (
                {
                    "content": [
                        {"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []}
                        for piece, lp in zip(pieces, sampled["logprobs"], strict=True)
                    ]
                }
                if body.get("logprobs")
                else None
            )
        else:
            choice["text"] = text
            choice["logprobs"] = (
                {"tokens": pieces, "token_logprobs": sampled["logprobs"], "top_logprobs": None, "text_offset": []}
                if body.get("logprobs") is not None
                else None
            )
        return choice

    def _response(
        self, served: ServedModel, chat: bool, body: dict[str, Any], prompt_ids: list[int], choices: list[dict]
    ) -> dict:
        completion_tokens = sum(len(c["token_ids"]) for c in choices)
        response = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": served.slug,
            "choices": [self._choice(served, chat, body, c) for c in choices],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt_ids) + completion_tokens,
            },
            "prompt_token_ids": prompt_ids,
        }
        for choice in response["choices"]:  # also on each choice, where vLLM and the HUD SDK read it
            choice["prompt_token_ids"] = prompt_ids
        return response

    async def _stream(
        self, served: ServedModel, request: Any, chat: bool, body: dict, prompt_ids: list[int], sampling: SamplingConfig
    ) -> Any:
        from aiohttp import web

        stream_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        deltas: AsyncIterator[TokenDelta] = served.engine.generate(
            prompt_ids, dataclasses.replace(sampling, stream_interval_s=self.stream_interval_s)
        )
        first = await anext(deltas)  # errors before the first byte are still a proper HTTP error
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        tokens: list[int] = []
        text = ""

        async def send(delta: TokenDelta) -> None:
            nonlocal text
            tokens.extend(delta.token_ids)
            full = served.engine.decode(tokens)
            piece, text = full[len(text) :], full
            finish = _FINISH.get(delta.stop_reason, "stop") if delta.finished else None
            choice: dict[str, Any] = {
                "index": 0,
                "finish_reason": finish,
                "token_ids": delta.token_ids,
                "weight_version": delta.weight_version,
            }
            if chat:
                choice["delta"] = (
                    {"role": "assistant", "content": piece}
                    if len(tokens) == len(delta.token_ids)
                    else {"content": piece}
                )
                choice["logprobs"] = {
                    "content": [
                        {
                            "token": served.engine.decode([t], skip_special_tokens=False),
                            "logprob": lp,
                            "bytes": None,
                            "top_logprobs": [],
                        }
                        for t, lp in zip(delta.token_ids, delta.logprobs, strict=True)
                    ]
                }
            else:
                choice["text"] = piece
                choice["logprobs"] = {
                    "tokens": [served.engine.decode([t], skip_special_tokens=False) for t in delta.token_ids],
                    "token_logprobs": delta.logprobs,
                    "top_logprobs": None,
                    "text_offset": [],
                }
            chunk = {
                "id": stream_id,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()),
                "model": served.slug,
                "choices": [choice],
            }
            if len(tokens) == len(delta.token_ids):
                chunk["prompt_token_ids"] = prompt_ids
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

        try:
            await send(first)
            async for delta in deltas:
                await send(delta)
            await response.write(b"data: [DONE]\n\n")
        except ConnectionError:  # the client went away mid-stream: not an error; the generation is cancelled
            log.info("%s: the client closed the stream", request.path)
        finally:
            await deltas.aclose()
        return response
