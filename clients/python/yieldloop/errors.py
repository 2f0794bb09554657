"""The yieldloop exception hierarchy, shared by the client library and the services.

Services raise these from plain-Python domain code; the servicer layer turns
them into a ``google.rpc.Status`` carrying ``ErrorInfo{reason, domain}`` (and
``BadRequest`` for a named field); the client turns such a status back into
the same class; the HTTP endpoints answer its ``http_status`` with an OpenAI-shaped body, and the
EnvService worker pipe carries :meth:`YieldloopError.to_wire` dicts. Every class inherits :class:`YieldloopError` and, where one
fits, the matching builtin (``NotFoundError`` is a ``LookupError``, ...).

This module imports nothing heavy (no grpc), so domain code can use it freely.
"""

from __future__ import annotations

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
    """``exc`` itself when it is a yieldloop error, else INTERNAL naming its type (for every transport)."""
    if isinstance(exc, YieldloopError):
        return exc
    return InternalError(f"{type(exc).__name__}: {exc}")


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


def check_json_object(text: str, field: str) -> str:
    """``text`` when it is empty or a JSON object; INVALID_ARGUMENT naming ``field`` otherwise."""
    import json

    if text:
        try:
            if not isinstance(json.loads(text), dict):
                raise ValueError("not an object")
        except (ValueError, RecursionError) as err:
            raise invalid_field(field, f"{field} must be a JSON object: {err}") from None
    return text
