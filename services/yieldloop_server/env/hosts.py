"""Which EpisodeHost runs environment code: the factory keyed on ``HostConfig.type``.

Apart from :mod:`.host` (the interface) so that the implementations import the interface and only this
module imports them: no cycle.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from yieldloop_server.env.host import EpisodeHost
from yieldloop_server.env.inprocess import InProcessHost
from yieldloop_server.env.loader import load_environment
from yieldloop_server.env.workers import WorkerPoolHost


@dataclasses.dataclass(frozen=True)
class HostConfig:
    """How EnvService runs environment code."""

    type: Literal["inprocess", "workers"] = "workers"
    """"workers": a pool of processes; "inprocess": the service's own loop (trusted, light environments)."""
    num_workers: int = 2
    """Worker processes in the pool (type "workers")."""
    hang_timeout_s: float = 10.0
    """A worker that answers no heartbeat for this long is killed and replaced."""


def create_host(env_specs: tuple[str, ...], config: HostConfig) -> EpisodeHost:
    """The host ``config`` names, loading ``env_specs`` (module:attr or file.py:attr)."""
    if config.type == "inprocess":
        return InProcessHost([load_environment(spec) for spec in env_specs])
    if config.type == "workers":
        for spec in env_specs:  # a broken file is one line here, before any worker starts
            load_environment(spec)
        return WorkerPoolHost(env_specs, config.num_workers, config.hang_timeout_s)
    raise ValueError(f"unknown host type {config.type!r}")
