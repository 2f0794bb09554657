"""Mapping between :mod:`yieldloop.errors` and ``google.rpc.Status`` on the wire.

Both directions live here so the services and the client agree by
construction: :func:`to_rpc_status` builds the status a servicer aborts with,
:func:`error_from_rpc` rebuilds the typed exception on the client.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from yieldloop.errors import ERROR_DOMAIN, ERRORS_BY_CODE, UnknownError, YieldloopError

_DETAILS_KEY = "grpc-status-details-bin"


def to_rpc_status(error: YieldloopError) -> grpc.Status:
    """The gRPC status (with ErrorInfo and, for a field, BadRequest) for ``error``."""
    details = []
    info = error_details_pb2.ErrorInfo(reason=error.reason, domain=ERROR_DOMAIN)
    if error.field:
        info.metadata["field"] = error.field
    packed = any_pb2.Any()
    packed.Pack(info)
    details.append(packed)
    if error.field:
        bad = error_details_pb2.BadRequest(
            field_violations=[error_details_pb2.BadRequest.FieldViolation(field=error.field, description=error.message)]
        )
        packed = any_pb2.Any()
        packed.Pack(bad)
        details.append(packed)
    status = status_pb2.Status(code=code_pb2.Code.Value(error.code), message=error.message, details=details)
    return rpc_status.to_status(status)


def error_from_rpc(err: grpc.aio.AioRpcError | grpc.RpcError) -> YieldloopError:
    """The typed yieldloop exception for a failed call (reason from ErrorInfo when present)."""
    code = err.code()
    code_name = code.name if code is not None else "UNKNOWN"
    cls = ERRORS_BY_CODE.get(code_name, UnknownError)
    reason, field = code_name, ""
    for key, value in err.trailing_metadata() or ():
        if key != _DETAILS_KEY:
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason = info.reason or reason
                field = info.metadata.get("field", "")
    return cls(err.details() or code_name, reason=reason, field=field)
