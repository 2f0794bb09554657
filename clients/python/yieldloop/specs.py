"""One way to name user code on the command line and in configs: ``module:attr`` or ``path/to/file.py:attr``.

Environments (``--env-spec``), tasksets (``eval TASKS``, ``train_tasks``) and HUD environments all resolve through
:func:`load_attr`, so they accept the same forms and fail the same way: whatever goes wrong in the user's file
(a syntax error, an exception at import, a missing attribute) is one line naming the file, the line and the error.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys
import traceback
from typing import Any

from yieldloop.errors import InvalidArgumentError, YieldloopError

SPEC_ERROR = "BAD_CONFIG"
"""The reason of every error a spec that cannot be loaded raises (INVALID_ARGUMENT)."""


def where_it_failed(err: BaseException, path: pathlib.Path | None = None) -> str:
    """``file:line: Type: message`` for an exception raised by user code: a syntax error's own position, else the
    deepest frame in ``path`` (else the deepest frame outside the standard library and site-packages)."""
    if isinstance(err, SyntaxError) and err.filename:
        return f"{err.filename}:{err.lineno}: SyntaxError: {err.msg}"
    frames = traceback.extract_tb(err.__traceback__)
    mine = [f for f in frames if path is not None and pathlib.Path(f.filename) == path]
    mine = mine or [f for f in frames if "site-packages" not in f.filename and "/lib/python" not in f.filename]
    message = f"{type(err).__name__}: {err}".rstrip(": ")
    return f"{mine[-1].filename}:{mine[-1].lineno}: {message}" if mine else message


def import_file(path: pathlib.Path, prefix: str) -> Any:
    """Imports a ``.py`` file as a module (under a name made from ``prefix`` and its stem).

    Raises:
        InvalidArgumentError: BAD_CONFIG, one line naming the file and line, when it is missing or fails.
    """
    path = path.resolve()
    if not path.is_file():
        raise InvalidArgumentError(f"{path}: no such file", reason=SPEC_ERROR, field="spec")
    name = f"{prefix}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise InvalidArgumentError(f"cannot import {path}", reason=SPEC_ERROR, field="spec")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # the file's own imports of its neighbours work, as `python file.py`
    try:
        spec.loader.exec_module(module)
    except YieldloopError:
        raise
    except Exception as err:  # user code: any failure is the file's, reported in one line
        raise InvalidArgumentError(where_it_failed(err, path), reason=SPEC_ERROR, field="spec") from None
    finally:
        sys.path.remove(str(path.parent))
    return module


def load_attr(spec: str, default_attr: str, prefix: str = "yieldloop_user") -> Any:
    """The object ``spec`` names: ``module:attr`` or ``file.py:attr`` (``attr`` defaults to ``default_attr``).

    Raises:
        InvalidArgumentError: BAD_CONFIG naming the spec, the file and line where it failed, or the attributes
            the module does define.
    """
    target, _, attr = spec.partition(":")
    attr = attr or default_attr
    if target.endswith(".py"):
        module = import_file(pathlib.Path(target), prefix)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as err:
            if err.name and target.startswith(err.name):
                raise InvalidArgumentError(
                    f"cannot load {spec!r}: no module {err.name!r} (a file is named path/to/file.py:{attr})",
                    reason=SPEC_ERROR,
                    field="spec",
                ) from None
            raise InvalidArgumentError(f"cannot load {spec!r}: {where_it_failed(err)}", reason=SPEC_ERROR) from None
        except YieldloopError:
            raise
        except Exception as err:
            raise InvalidArgumentError(f"cannot load {spec!r}: {where_it_failed(err)}", reason=SPEC_ERROR) from None
    if not hasattr(module, attr):
        names = ", ".join(n for n in vars(module) if not n.startswith("_") and n.islower()) or "nothing"
        raise InvalidArgumentError(
            f"{target} defines no {attr!r} (it defines: {names}); name another with {target}:NAME",
            reason=SPEC_ERROR,
            field="spec",
        )
    return getattr(module, attr)


def called(value: Any, spec: str) -> Any:
    """``value()`` when ``value`` is callable (a spec may name a function making the object), else ``value``;
    what fails in the call is one line naming the file and line.

    Raises:
        InvalidArgumentError: BAD_CONFIG when the call fails.
    """
    if not callable(value):
        return value
    try:
        return value()
    except YieldloopError:
        raise
    except Exception as err:  # user code: any failure is the function's, reported in one line
        raise InvalidArgumentError(f"{spec}: {where_it_failed(err)}", reason=SPEC_ERROR, field="spec") from None
