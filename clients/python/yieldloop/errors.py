"""The yieldloop exception hierarchy, shared by the client library and the services.

Services raise these from plain-Python domain code; the servicer layer turns
them into a ``google.rpc.Status`` carrying ``ErrorInfo{reason, domain}`` (and
``BadRequest`` for a named field); the client turns such a status back into
the same class; the HTTP endpoints answer its ``http_status`` with an OpenAI-shaped body, and the
EnvService worker pipe carries :meth:`YieldloopError.to_wire` dicts. Every class inherits
:class:`YieldloopError` and, where one fits, the matching builtin (``NotFoundError`` is a ``LookupError``, ...).

This module imports nothing heavy (no grpc), so domain code can use it freely.
"""

from __future__ import annotations

import functools
from typing import Any

ERROR_DOMAIN = "yieldloop.dev"
MAX_MESSAGE = 1024
"""An error's message is cut to this many characters: a message that echoes a huge input must not turn into
a different error (gRPC's trailing metadata is limited to a few kilobytes)."""
MAX_FIELD = 256


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


class YieldloopError(Exception):
    """Root of every yieldloop error.

    Attributes:
        code: gRPC status code name, e.g. ``"NOT_FOUND"``.
        reason: Machine-readable reason (an ``ErrorReason`` name from
            ``yieldloop.common.v1``), e.g. ``"SCENARIO_NOT_FOUND"``.
        message: Human-readable text.
        field: The offending request field, when one is to blame.
    """

    code = "UNKNOWN"
    http_status = 500

    def __init__(self, message: str, *, reason: str = "INTERNAL", field: str = "") -> None:
        message, field = _clip(str(message), MAX_MESSAGE), _clip(str(field), MAX_FIELD)
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.field = field

    def __str__(self) -> str:
        where = f" (field {self.field})" if self.field else ""
        return f"{self.code}/{self.reason}: {self.message}{where}"

    def to_wire(self) -> dict[str, str]:
        """The error as plain data (code, reason, message, field), for transports other than gRPC."""
        return {"code": self.code, "reason": self.reason, "message": self.message, "field": self.field}


def as_yieldloop_error(exc: BaseException) -> YieldloopError:
    """``exc`` itself when it is a yieldloop error; RESOURCE_EXHAUSTED (NO_SPACE) for a disk that is full (or a quota
    spent), which is retryable once space is freed; else INTERNAL naming its type (for every transport)."""
    if isinstance(exc, YieldloopError):
        return exc
    if no_space(exc):
        return ResourceExhaustedError(
            f"no space left on the device this service writes to ({getattr(exc, 'filename', '') or exc}): nothing "
            "was half-written; retry once space is freed",
            reason="NO_SPACE",
        )
    return InternalError(f"{type(exc).__name__}: {exc}")


def no_space(exc: BaseException) -> bool:
    """Whether ``exc`` says a disk is full or a quota is spent (ENOSPC, EDQUOT)."""
    import errno

    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def error_from_wire(data: dict[str, str]) -> YieldloopError:
    """The typed error :meth:`YieldloopError.to_wire` described (UnknownError for an unknown code)."""
    cls = ERRORS_BY_CODE.get(data.get("code", ""), UnknownError)
    return cls(data.get("message", ""), reason=data.get("reason", "INTERNAL"), field=data.get("field", ""))


class InvalidArgumentError(YieldloopError, ValueError):
    code = "INVALID_ARGUMENT"
    http_status = 400


class NotFoundError(YieldloopError, LookupError):
    code = "NOT_FOUND"
    http_status = 404


class AlreadyExistsError(YieldloopError):
    code = "ALREADY_EXISTS"
    http_status = 409


class FailedPreconditionError(YieldloopError):
    code = "FAILED_PRECONDITION"
    http_status = 400


class AbortedError(YieldloopError):
    code = "ABORTED"
    http_status = 409


class OutOfRangeError(YieldloopError, ValueError):
    code = "OUT_OF_RANGE"
    http_status = 400


class UnauthenticatedError(YieldloopError, PermissionError):
    code = "UNAUTHENTICATED"
    http_status = 401


class PermissionDeniedError(YieldloopError, PermissionError):
    code = "PERMISSION_DENIED"
    http_status = 403


class ResourceExhaustedError(YieldloopError):
    code = "RESOURCE_EXHAUSTED"
    http_status = 429


class RequestTooLargeError(ResourceExhaustedError):
    """An HTTP request body past the server's limit (HTTP 413; RESOURCE_EXHAUSTED, as gRPC answers a message
    past its limit)."""

    http_status = 413


class UnimplementedError(YieldloopError, NotImplementedError):
    code = "UNIMPLEMENTED"
    http_status = 501


class UnavailableError(YieldloopError, ConnectionError):
    code = "UNAVAILABLE"
    http_status = 503


class DeadlineExceededError(YieldloopError, TimeoutError):
    code = "DEADLINE_EXCEEDED"
    http_status = 504


class CancelledError(YieldloopError):
    code = "CANCELLED"
    http_status = 499


class DataLossError(YieldloopError):
    """Bytes differ from what was declared for them (a checksum mismatch): nothing was committed."""

    code = "DATA_LOSS"
    http_status = 500


class InternalError(YieldloopError):
    code = "INTERNAL"
    http_status = 500


class UnknownError(YieldloopError):
    code = "UNKNOWN"
    http_status = 500


ERRORS_BY_CODE: dict[str, type[YieldloopError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        AlreadyExistsError,
        FailedPreconditionError,
        AbortedError,
        OutOfRangeError,
        UnauthenticatedError,
        PermissionDeniedError,
        ResourceExhaustedError,
        UnimplementedError,
        UnavailableError,
        DeadlineExceededError,
        CancelledError,
        DataLossError,
        InternalError,
        UnknownError,
    )
}


def invalid_field(field: str, message: str) -> InvalidArgumentError:
    """An INVALID_ARGUMENT error blaming one request field."""
    return InvalidArgumentError(message, reason="INVALID_FIELD", field=field)


def check_text(value: str, field: str, max_chars: int = 256) -> str:
    """``value`` when it is a short label (a job's or a key's name): at most ``max_chars`` characters and no
    control characters; INVALID_ARGUMENT naming ``field`` otherwise."""
    if len(value) > max_chars:
        raise invalid_field(field, f"{field} has {len(value):,} characters; at most {max_chars} are kept")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise invalid_field(field, f"{field} holds control characters")
    return value


MAX_JSON_DEPTH = 100
"""How deep JSON from a caller may nest (arrays and objects): deeper input is refused where it enters, before
anything walks it recursively (Python's recursion limit is about 1,000 frames)."""


def parse_json(text: str | bytes, field: str, reason: str = "INVALID_FIELD", **options: Any) -> Any:
    """``text`` parsed as JSON (``options`` go to ``json.loads``); INVALID_ARGUMENT with ``reason`` naming ``field``
    when it is not JSON or nests deeper than :data:`MAX_JSON_DEPTH`."""
    import json

    try:
        value = _SCANNED if options or type(text) is not str else _scanned(text)
        if value is _SCANNED:
            value = json.loads(text, **options)
    except RecursionError:
        value, nested = None, True
    except (ValueError, UnicodeDecodeError) as err:
        raise InvalidArgumentError(f"{field} is not valid JSON: {err}", reason=reason, field=field) from None
    else:
        opening = (b"[", b"{") if isinstance(text, bytes) else ("[", "{")
        nested = sum(map(text.count, opening)) > MAX_JSON_DEPTH and _nesting(value) > MAX_JSON_DEPTH
    if nested:
        raise InvalidArgumentError(f"{field} nests deeper than {MAX_JSON_DEPTH} levels", reason=reason, field=field)
    return value


_SCANNED = object()
"""What :func:`_scanned` returns for a text its scan does not take whole."""


def _scanned(text: str) -> Any:
    """The JSON value ``text`` holds when it is that value alone (nothing around it), read by ``json.loads``' own
    scanner (in C where there is one) without the decoder's Python layers around it: half of ``json.loads``' time
    at the sizes of a tool's arguments. :data:`_SCANNED` otherwise (``json.loads`` then reads it, or says what is
    wrong with it)."""
    try:
        value, end = _scanner()(text, 0)
    except (ValueError, StopIteration):
        return _SCANNED
    return value if end == len(text) else _SCANNED


@functools.cache
def _scanner() -> Any:
    import json
    import json.scanner

    return json.scanner.make_scanner(json.JSONDecoder())


def _nesting(value: Any) -> int:
    """How deep arrays and objects nest in a parsed JSON value (without recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_JSON_DEPTH:
            break
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def check_json_object(text: str, field: str) -> str:
    """``text`` when it is empty or a JSON object; INVALID_ARGUMENT naming ``field`` otherwise."""
    if text and not isinstance(parse_json(text, field), dict):
        raise invalid_field(field, f"{field} must be a JSON object")
    return text
