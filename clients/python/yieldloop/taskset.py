"""Tasksets: lists of tasks loaded from ``.py`` modules, ``.json`` and ``.jsonl``, written as ``.json``/``.jsonl``.

A ``.json`` file holds a list of ``{"env", "scenario", "args"}`` objects, a
``.jsonl`` file one such object per line; a ``.py`` file defines ``tasks``
(a list of :class:`~yieldloop.environment.Task`, or a callable returning one).
With an environment given, every task's arguments are validated against its
scenario on load.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable
from typing import Any

from yieldloop.environment import Environment, Task
from yieldloop.errors import InvalidArgumentError
from yieldloop.specs import called, load_attr

TASKSET_ERROR = "BAD_CONFIG"
"""The reason of every error a malformed taskset file raises (INVALID_ARGUMENT)."""


def _bad(message: str) -> InvalidArgumentError:
    return InvalidArgumentError(message, reason=TASKSET_ERROR)


def _task_from_dict(raw: Any, where: str, env: Environment | None) -> Task:
    if not isinstance(raw, dict) or "scenario" not in raw:
        raise _bad(f"{where}: a task is an object with 'scenario' and 'args'")
    args = raw.get("args", {})
    if not isinstance(args, dict):
        raise _bad(f"{where}: 'args' must be an object")
    if env is None:
        return Task(env=raw.get("env", ""), scenario=raw["scenario"], args=args)
    if raw.get("env", env.name) != env.name:
        raise _bad(f"{where}: task is for env {raw['env']!r}, not {env.name!r}")
    return env.get_scenario(raw["scenario"]).task(**args)


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise _bad(f"{where}: not valid JSON ({err})") from None


class Taskset(list):
    """A list of :class:`Task` with loaders and writers."""

    def __init__(self, tasks: Iterable[Task] = ()) -> None:
        super().__init__(tasks)

    @classmethod
    def load(cls, path: str | pathlib.Path, env: Environment | None = None) -> Taskset:
        """Loads tasks from a ``.py``, ``.json`` or ``.jsonl`` file (validated against ``env`` when given).

        Raises:
            InvalidArgumentError: BAD_CONFIG naming the file (and line or index) when it is malformed.
        """
        path = pathlib.Path(path)
        if path.suffix not in (".py", ".json", ".jsonl"):
            raise _bad(f"unsupported taskset file {path} (use .py, .json or .jsonl)")
        if path.suffix == ".py":
            return cls(_load_module_tasks(path))
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise _bad(f"cannot read taskset {path}: {err}") from None
        if path.suffix == ".json":
            raws = _parse_json(text, str(path))
            if not isinstance(raws, list):
                raise _bad(f"{path}: a .json taskset is a list of task objects")
            return cls(_task_from_dict(raw, f"{path}[{i}]", env) for i, raw in enumerate(raws))
        lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        return cls(_task_from_dict(_parse_json(line, f"{path}:{n}"), f"{path}:{n}", env) for n, line in lines)

    async def run(
        self, agent: Any, *, job: Any, max_concurrent: int = 0, checkpoint_id: str = "", on_run: Any = None
    ) -> list:
        """Plays every task ``job.group`` times with ``agent`` (a :class:`yieldloop.training.Agent`) through
        RolloutService; the runs are appended to ``job.runs`` and returned."""
        from yieldloop.training import run_tasks

        return await run_tasks(
            self, agent, job=job, max_concurrent=max_concurrent, checkpoint_id=checkpoint_id, on_run=on_run
        )

    def save(self, path: str | pathlib.Path) -> pathlib.Path:
        """Writes the tasks as ``.json`` (a list) or ``.jsonl`` (one per line)."""
        path = pathlib.Path(path)
        rows = [task.to_dict() for task in self]
        if path.suffix == ".json":
            path.write_text(json.dumps(rows, indent=1) + "\n")
        elif path.suffix == ".jsonl":
            path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        else:
            raise _bad(f"unsupported taskset file {path} (use .json or .jsonl)")
        return path


def _load_module_tasks(path: pathlib.Path) -> list[Task]:
    """The ``tasks`` a ``.py`` file defines; whatever fails in the user's module is reported as BAD_CONFIG."""
    tasks = called(load_attr(str(path), "tasks", prefix="yieldloop_tasks"), str(path))
    if not isinstance(tasks, list) or not all(isinstance(t, Task) for t in tasks):
        raise _bad(f"{path} must define `tasks`: a list of Task (or a function returning one)")
    return tasks
