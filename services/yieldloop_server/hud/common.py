"""What HUD's HTTP contracts on the front share: the request's caller, and the validators of HUD's bodies."""

from __future__ import annotations

import datetime
import math
from typing import Any

from yieldloop.client import Client
from yieldloop.errors import invalid_field
from yieldloop.transport import CallInfo, TransportConfig
from yieldloop_server.common.auth import current_principal, presented_key

AGENT_TYPE = "openai_compatible"
"""The SDK agent that samples yieldloop models (through the gateway's chat completions)."""


class Contract:
    """One of HUD's HTTP contracts on the front (catalog, training, traces, gateway): its routes, served with the
    caller's own key on every call it makes (``auth``), within the front's transport."""

    def __init__(self, client: Client, transport: TransportConfig, auth: bool) -> None:
        self.client = client
        self.transport = transport
        self.auth = auth

    def caller(self, request: Any) -> Client:
        """The client acting for this request: the caller's own key on every call."""
        return self.client.with_api_key(presented_key_of(request)) if self.auth else self.client

    def team(self) -> str:
        return current_principal().team if self.auth else ""

    def routes(self, handler: Any) -> list[Any]:
        """aiohttp routes; ``handler`` wraps a ``(request, body, client) -> reply`` method as a JSON route."""
        raise NotImplementedError


def presented_key_of(request: Any) -> str:
    """The API key an HTTP request presents (``Authorization: Bearer``)."""
    return presented_key(
        CallInfo(method="", metadata=tuple((k.lower(), v) for k, v in request.headers.items()), protocol="http")
    )


def iso(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat()


def number(value: Any, field: str, *, minimum: float | None = None, above: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid_field(field, f"{field} must be a finite number")
    if minimum is not None and value < minimum or above is not None and value <= above:
        bound = f">= {minimum:g}" if minimum is not None else f"> {above:g}"
        raise invalid_field(field, f"{field} must be {bound}")
    return float(value)


def only_fields(body: dict[str, Any], allowed: set[str], what: str) -> None:
    """The SDK's request models forbid unknown fields; so does this front (a misspelled knob is not ignored)."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise invalid_field(unknown[0], f"{what} has no field {unknown[0]!r} (fields: {', '.join(sorted(allowed))})")


def ints(value: Any, field: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise invalid_field(field, f"{field} must be a list of token ids")
    return value


def floats(value: Any, field: str) -> list[float]:
    if not isinstance(value, list) or not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in value
    ):
        raise invalid_field(field, f"{field} must be a list of finite numbers")
    return [float(x) for x in value]


def finite_metrics(values: dict[str, float]) -> dict[str, float]:
    """Metrics as the SDK reads them: every value a finite float (its models have no nulls)."""
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)}
