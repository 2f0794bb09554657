"""yieldloop: a self-hosted closed loop from agent evals to RL training data.

This is the client distribution: the typed async client (``yieldloop.client``),
the environment SDK (``yieldloop.environment``), tasksets, the training API
(``yieldloop.training``), domain types (``yieldloop.types``), the transport seam
(``yieldloop.transport``) and the generated protobuf packages
(``yieldloop.proto.<service>.v1``). The servers are the ``yieldloop-server``
distribution. Names below are imported lazily so ``import yieldloop`` stays fast.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# yieldloop forks only to exec (service processes, environment workers, MCP stdio servers,
# trainer ranks). gRPC's fork handlers, on by default, act in the parent at every fork while
# gRPC threads run; they must be off before gRPC's core is loaded.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

__version__ = "0.1.0"

_LAZY = {
    "Agent": "yieldloop.training",
    "Client": "yieldloop.client",
    "Job": "yieldloop.training",
    "TrainingClient": "yieldloop.training",
    "connect": "yieldloop.training",
    "create_agent": "yieldloop.training",
    "Environment": "yieldloop.environment",
    "TransportConfig": "yieldloop.transport",
    "EpisodeContext": "yieldloop.environment",
    "Grade": "yieldloop.environment",
    "RawText": "yieldloop.environment",
    "FinalCompletion": "yieldloop.environment",
    "Task": "yieldloop.environment",
    "Taskset": "yieldloop.taskset",
    "YieldloopError": "yieldloop.errors",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'yieldloop' has no attribute {name!r}")
