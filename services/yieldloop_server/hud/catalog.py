"""HUD's model catalog on the front (``HUD_API_URL``): models, resolving a name, forks, a model's checkpoint tree
and its head."""

from __future__ import annotations

import json
from typing import Any

from yieldloop.client import Client
from yieldloop.errors import NotFoundError, invalid_field
from yieldloop.types import ModelInfo
from yieldloop_server.hud.common import AGENT_TYPE, Contract, finite_metrics, iso, only_fields


class Catalog(Contract):
    """``GET /v2/models``, ``/v2/models/resolve``, ``/v2/models/{id}``, ``/v2/models/{id}/checkpoints``,
    ``PUT /v2/models/{id}/head``, ``POST /v2/models/fork``."""

    def routes(self, handler: Any) -> list[Any]:
        from aiohttp import web

        return [
            web.get("/v2/models", handler(self._list_models)),
            web.get("/v2/models/resolve", handler(self._resolve_model)),
            web.post("/v2/models/fork", handler(self._fork)),
            web.get("/v2/models/{model}", handler(self._get_model)),
            web.get("/v2/models/{model}/checkpoints", handler(self._checkpoints)),
            web.put("/v2/models/{model}/head", handler(self._set_head)),
        ]

    @staticmethod
    def _entry(info: ModelInfo) -> dict[str, Any]:
        return {
            "id": info.slug,
            "name": info.slug,
            "model_name": info.slug,
            "sdk_agent_type": AGENT_TYPE,
            "is_trainable": info.trainable,
            "provider": {"name": "yieldloop"},
            "created_at": iso(info.created_time) if info.created_time else None,
        }

    async def _models(self, client: Client) -> list[ModelInfo]:

        return sorted(await client.list_models(), key=lambda m: m.slug)

    async def _list_models(self, request: Any, body: dict, client: Client) -> dict[str, Any]:
        query = request.query
        try:
            limit = int(query.get("limit", 100))
            offset = int(query.get("offset", 0))
        except ValueError:
            raise invalid_field("limit", "limit and offset must be integers") from None
        if not 1 <= limit <= 1000 or offset < 0:
            raise invalid_field("limit", "limit must be in [1, 1000] and offset >= 0")
        models = await self._models(client)  # the ones this key may see
        return {"items": [self._entry(m) for m in models[offset : offset + limit]], "total": len(models)}

    async def _resolve_model(self, request: Any, body: dict, client: Client) -> dict[str, Any]:
        name = request.query.get("model", "")
        for info in await self._models(client):
            if info.slug.lower() == name.lower():
                return self._entry(info)
        raise NotFoundError(f"no model {name!r}", reason="MODEL_NOT_FOUND", field="model")

    async def _get_model(self, request: Any, body: dict, client: Client) -> dict[str, Any]:
        return self._entry(await client.get_model(request.match_info["model"]))

    async def _fork(self, request: Any, body: dict, client: Client) -> dict[str, Any]:
        only_fields(body, {"source_model_id", "name"}, "a fork")
        source, name = body.get("source_model_id"), body.get("name")
        if not isinstance(source, str) or not source or not isinstance(name, str) or not name:
            raise invalid_field("name", "a fork needs source_model_id and name (strings)")
        await client.fork_model(source, name)  # ALREADY_EXISTS (409) when the name is taken
        return self._entry(await client.get_model(name))

    async def _checkpoints(self, request: Any, body: dict, client: Client) -> list[dict[str, Any]]:
        rows = []
        for summary in await client.list_checkpoints(request.match_info["model"]):
            metadata = json.loads(summary.metadata_json or "{}")
            stats = metadata.get("hud", {}) if isinstance(metadata.get("hud"), dict) else {}
            numbers = {**{k: v for k, v in metadata.items() if k != "hud"}, **stats}
            row: dict[str, Any] = {
                "id": summary.checkpoint_id,
                "name": summary.checkpoint_id,
                "checkpoint_name": summary.checkpoint_id,
                "prev_model_checkpoint_id": summary.parent_checkpoint_id or None,
                "is_active": summary.is_head,
                "created_at": iso(summary.created_time),
                "metrics": finite_metrics({k: v for k, v in numbers.items() if not isinstance(v, bool)}),
            }
            for key, kind in (
                ("num_traces", int),
                ("num_datums", int),
                ("num_tokens", int),
                ("mean_reward", float),
                ("learning_rate", float),
                ("loss_fn", str),
            ):
                if isinstance(stats.get(key), (int, float, str)) and not isinstance(stats.get(key), bool):
                    row[key] = kind(stats[key])
            rows.append(row)
        return rows

    async def _set_head(self, request: Any, body: dict, client: Client) -> dict[str, Any]:
        only_fields(body, {"checkpoint_id"}, "a head move")
        checkpoint_id = body.get("checkpoint_id")
        if not isinstance(checkpoint_id, str) or not checkpoint_id:
            raise invalid_field("checkpoint_id", "checkpoint_id must be a checkpoint of the model")
        model = request.match_info["model"]
        head = await client.set_head(model, checkpoint_id)
        await client.get_serving_info(wait_for_checkpoint_id=checkpoint_id, model=model)  # served before the answer
        return {"model": model, "checkpoint_id": head.checkpoint_id}
