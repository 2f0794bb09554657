"""Loads environments from ``module:attr`` or ``path/to/file.py:attr`` specs."""

from __future__ import annotations

import importlib
import importlib.util
import pathlib

from yieldloop.environment import Environment


def load_environment(spec: str) -> Environment:
    """Imports an :class:`Environment` named by ``module:attr`` or ``file.py:attr`` (attr defaults to ``env``), or
    serves a HUD environment: ``hud:path/to/env.py`` (see :mod:`yieldloop.hud`)."""
    if spec.startswith("hud:"):
        from yieldloop.hud import from_spec

        return from_spec(spec)
    target, _, attr = spec.partition(":")
    attr = attr or "env"
    if target.endswith(".py"):
        path = pathlib.Path(target).resolve()
        module_spec = importlib.util.spec_from_file_location(f"yieldloop_env_{path.stem}", path)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"cannot load environment file {path}")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    env = getattr(module, attr, None)
    if not isinstance(env, Environment):
        raise ValueError(f"{spec!r} does not name an Environment (found {type(env).__name__})")
    return env
