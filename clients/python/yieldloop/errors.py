"""The yieldloop exception hierarchy, shared by the client library and the services.

Services raise these from plain-Python domain code; the servicer layer turns
them into a ``google.rpc.Status`` carrying ``ErrorInfo{reason, domain}`` (and
``BadRequest`` for a named field); the client turns such a status back into
the same class. Every class inherits :class:`YieldloopError` and, where one
fits, the matching builtin (``NotFoundError`` is a ``LookupError``, ...).

This module imports nothing heavy (no grpc), so domain code can use it freely.
"""

from __future__ import annotations

ERROR_DOMAIN = "yieldloop.dev"


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

    def __init__(self, message: str, *, reason: str = "INTERNAL", field: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.field = field

    def __str__(self) -> str:
        where = f" (field {self.field})" if self.field else ""
        return f"{self.code}/{self.reason}: {self.message}{where}"


class InvalidArgumentError(YieldloopError, ValueError):
    code = "INVALID_ARGUMENT"


class NotFoundError(YieldloopError, LookupError):
    code = "NOT_FOUND"


class AlreadyExistsError(YieldloopError):
    code = "ALREADY_EXISTS"


class FailedPreconditionError(YieldloopError):
    code = "FAILED_PRECONDITION"


class AbortedError(YieldloopError):
    code = "ABORTED"


class OutOfRangeError(YieldloopError, ValueError):
    code = "OUT_OF_RANGE"


class PermissionDeniedError(YieldloopError, PermissionError):
    code = "PERMISSION_DENIED"


class ResourceExhaustedError(YieldloopError):
    code = "RESOURCE_EXHAUSTED"


class UnimplementedError(YieldloopError, NotImplementedError):
    code = "UNIMPLEMENTED"


class UnavailableError(YieldloopError, ConnectionError):
    code = "UNAVAILABLE"


class DeadlineExceededError(YieldloopError, TimeoutError):
    code = "DEADLINE_EXCEEDED"


class CancelledError(YieldloopError):
    code = "CANCELLED"


class InternalError(YieldloopError):
    code = "INTERNAL"


class UnknownError(YieldloopError):
    code = "UNKNOWN"


ERRORS_BY_CODE: dict[str, type[YieldloopError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        AlreadyExistsError,
        FailedPreconditionError,
        AbortedError,
        OutOfRangeError,
        PermissionDeniedError,
        ResourceExhaustedError,
        UnimplementedError,
        UnavailableError,
        DeadlineExceededError,
        CancelledError,
        InternalError,
        UnknownError,
    )
}


def invalid_field(field: str, message: str) -> InvalidArgumentError:
    """An INVALID_ARGUMENT error blaming one request field."""
    return InvalidArgumentError(message, reason="INVALID_FIELD", field=field)
