"""JSON schemas from Python signatures, and argument binding/validation against them.

Used by the environment SDK for tools (what the agent sees) and scenarios
(what a task's arguments must match). Parameters annotated with
:class:`~yieldloop.environment.EpisodeContext` are injected, not described.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable
from typing import Any

from yieldloop.errors import InvalidArgumentError

_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
_CHECKS: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def json_schema_for(annotation: Any) -> dict[str, Any]:
    """A JSON schema for a Python type hint (the common cases; anything else is unconstrained)."""
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (list, tuple, set) or annotation in (list, tuple, set):
        return {"type": "array", "items": json_schema_for(args[0]) if args else {}}
    if origin is dict or annotation is dict:
        return {"type": "object"}
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        options = [json_schema_for(a) for a in args if a is not type(None)]
        return options[0] if len(options) == 1 else {"anyOf": options}
    return {}


_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns|Yields|Raises|Examples?|Notes?):$")


def docstring_args(doc: str) -> tuple[str, dict[str, str]]:
    """Splits a Google-style docstring into its text before any section and per-argument descriptions."""
    summary: list[str] = []
    described: dict[str, str] = {}
    section = current = None
    entry_indent: int | None = None
    for line in doc.splitlines():
        stripped = line.strip()
        header = _SECTION.match(stripped)
        if header and not line[:1].isspace():
            section, current = header.group(1), None
            continue
        if section is None:
            if stripped:
                summary.append(stripped)
        elif section in ("Args", "Arguments", "Parameters") and stripped:
            indent = len(line) - len(line.lstrip())
            entry = re.match(r"^(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", stripped)
            if entry and (entry_indent is None or indent <= entry_indent):
                entry_indent, current = indent, entry.group(1)
                described[current] = entry.group(2)
            elif current:
                described[current] = f"{described[current]} {stripped}".strip()
    return " ".join(summary), described


def injected_parameters(fn: Callable[..., Any], injected: type) -> set[str]:
    """Names of ``fn``'s parameters annotated with the ``injected`` type."""
    hints = typing.get_type_hints(fn)
    return {name for name, hint in hints.items() if hint is injected}


def signature_schema(fn: Callable[..., Any], skip: set[str] = frozenset()) -> dict[str, Any]:
    """JSON schema (object) of a function's parameters, from its type hints and docstring."""
    hints = typing.get_type_hints(fn)
    _, described = docstring_args(inspect.getdoc(fn) or "")
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, param in inspect.signature(fn).parameters.items():
        if name in skip:
            continue
        prop = json_schema_for(hints.get(name, Any))
        if name in described:
            prop["description"] = described[name]
        if param.default is not inspect.Parameter.empty and param.default is not None:
            prop["default"] = param.default
        properties[name] = prop
        if param.default is inspect.Parameter.empty:
            required.append(name)
    return {"type": "object", "properties": properties, "required": required}


def _matches(value: Any, schema: dict[str, Any]) -> bool:
    if "anyOf" in schema:
        return any(_matches(value, option) for option in schema["anyOf"])
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind is None:
        return True
    if not _CHECKS[kind](value):
        return False
    if kind == "array" and schema.get("items"):
        return all(_matches(item, schema["items"]) for item in value)
    return True


def validate_arguments(args: dict[str, Any], schema: dict[str, Any], *, what: str, reason: str) -> None:
    """Checks ``args`` against an object schema made by :func:`signature_schema`.

    Raises:
        InvalidArgumentError: with ``reason``, naming the first offending argument.
    """
    properties = schema["properties"]
    if not args.keys() <= properties.keys():  # (checked without building anything: tools run thousands per second)
        unknown = sorted(set(args) - set(properties))
        raise InvalidArgumentError(f"{what}: unexpected argument(s) {unknown}", reason=reason, field=unknown[0])
    for required in schema["required"]:
        if required not in args:
            missing = [name for name in schema["required"] if name not in args]
            raise InvalidArgumentError(
                f"{what}: missing required argument(s) {missing}", reason=reason, field=missing[0]
            )
    for name, value in args.items():
        if not _matches(value, properties[name]):
            raise InvalidArgumentError(
                f"{what}: argument {name!r}={value!r} does not match {properties[name]}", reason=reason, field=name
            )
