"""Loads environments from ``module:attr`` or ``path/to/file.py:attr`` specs."""

from __future__ import annotations

from yieldloop.environment import Environment
from yieldloop.errors import InvalidArgumentError
from yieldloop.specs import SPEC_ERROR, load_attr


def load_environment(spec: str) -> Environment:
    """Imports an :class:`Environment` named by ``module:attr`` or ``file.py:attr`` (attr defaults to ``env``), or
    serves a HUD environment: ``hud:path/to/env.py`` (see :mod:`yieldloop.hud`)."""
    if spec.startswith("hud:"):
        from yieldloop.hud import from_spec

        return from_spec(spec)
    env = load_attr(spec, "env", prefix="yieldloop_env")
    if not isinstance(env, Environment):
        raise InvalidArgumentError(
            f"{spec!r} does not name an Environment (found {type(env).__name__})", reason=SPEC_ERROR, field="env_spec"
        )
    return env
