"""Loads environments from ``module:attr`` or ``path/to/file.py:attr`` specs."""

from __future__ import annotations

import importlib
import importlib.util
import pathlib

from yieldloop.environment import Environment
from yieldloop.errors import NotFoundError

DEFAULT_ENV_SPEC = "yieldloop.envs.letters:env"


def load_environment(spec: str) -> Environment:
    """Imports an :class:`Environment` named by ``module:attr`` or ``file.py:attr`` (attr defaults to ``env``)."""
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


class EnvironmentSet:
    """The environments one EnvService serves, by name."""

    def __init__(self, envs: list[Environment]) -> None:
        self.envs = {env.name: env for env in envs}

    def get(self, name: str) -> Environment:
        if not name and len(self.envs) == 1:
            return next(iter(self.envs.values()))
        if name not in self.envs:
            raise NotFoundError(f"no environment {name!r}; loaded: {sorted(self.envs)}", reason="ENVIRONMENT_NOT_FOUND")
        return self.envs[name]

    def select(self, name: str) -> list[Environment]:
        return [self.get(name)] if name else list(self.envs.values())
