"""yieldloop: a self-hosted closed loop from agent evals to RL training data.

The import root holds the client library (``yieldloop.client``), the
environment SDK (``yieldloop.environment``), the generated protobuf packages
(``yieldloop.<service>.v1``) and the servers (``yieldloop.services``). Names
below are imported lazily so ``import yieldloop`` stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Client": "yieldloop.client",
    "Environment": "yieldloop.environment",
    "EpisodeContext": "yieldloop.environment",
    "Grade": "yieldloop.environment",
    "Task": "yieldloop.environment",
    "Taskset": "yieldloop.taskset",
    "YieldloopError": "yieldloop.errors",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'yieldloop' has no attribute {name!r}")
