"""The agent loop for open models: tools in the chat template, Hermes/Qwen tool calls, token-exact turns.

Each model turn is sampled from token ids. When it calls tools, the results
are appended as ``tool`` messages and the next turn's prompt is the previous
prompt + the sampled completion + the ids of only the *new* text, so every
turn's prompt extends the previous turn's ids exactly (no retokenization
drift). The new text is what the model's chat template writes after an
assistant message plus the tool messages and the generation prompt, found by
rendering the conversation twice with a sentinel in place of the assistant
content and taking the difference.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from typing import Any

from yieldloop.errors import FailedPreconditionError
from yieldloop_server.rollout.engines import Engine

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_SENTINEL = "\u27e6yieldloop-assistant-turn\u27e7"


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


class MalformedToolCall(ValueError):
    """The model wrote ``<tool_call>`` markup whose content is not a valid call."""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Hermes/Qwen tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, in order.

    Raises:
        MalformedToolCall: unbalanced tags, invalid JSON, no ``name``, or ``arguments`` not an object.
    """
    bodies = _TOOL_CALL.findall(text)
    if len(bodies) != text.count("<tool_call>") or len(bodies) != text.count("</tool_call>"):
        raise MalformedToolCall("unbalanced <tool_call> tags")
    calls = []
    for body in bodies:
        try:
            call = json.loads(body.strip())
        except json.JSONDecodeError as err:
            raise MalformedToolCall(f"tool call is not JSON: {err}") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            raise MalformedToolCall("a tool call needs a string 'name'")
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise MalformedToolCall("tool call arguments are not JSON") from None
        if not isinstance(arguments, dict):
            raise MalformedToolCall("tool call arguments must be a JSON object")
        calls.append(ToolCall(call["name"], arguments))
    return calls


def strip_tool_calls(text: str) -> str:
    """The text around the tool calls (what a final answer shows)."""
    return _TOOL_CALL.sub("", text).strip()


def tools_for_template(tools: Sequence[Any]) -> list[dict[str, Any]]:
    """EnvService tool specs in the OpenAI function format chat templates take."""
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description,
                "parameters": json.loads(tool.parameters_json_schema or "{}"),
            },
        }
        for tool in tools
    ]


def continuation_ids(
    engine: Engine,
    history: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None,
    completion_ids: Sequence[int],
    new_messages: Sequence[dict[str, Any]],
) -> list[int]:
    """Ids to append after ``prompt + completion`` so the next prompt renders ``history + answer + new``.

    Args:
        history: Messages the previous turn's prompt rendered (before the assistant's answer).
        completion_ids: The assistant turn as sampled (with or without its end-of-turn token).
        new_messages: Messages after the assistant turn (tool results).
    """
    with_turn = [*history, {"role": "assistant", "content": _SENTINEL}]
    closed = engine.render_chat_text(with_turn, tools)
    extended = engine.render_chat_text([*with_turn, *new_messages], tools, add_generation_prompt=True)
    if _SENTINEL not in closed or not extended.startswith(closed):
        raise FailedPreconditionError(
            "the model's chat template does not render a conversation as an extension of its prefix",
            reason="EPISODE_PROTOCOL",
        )
    closing = closed[closed.rindex(_SENTINEL) + len(_SENTINEL) :]  # what the template writes after a turn
    eos_text = engine.decode([engine.eos_token_id], skip_special_tokens=False)
    if completion_ids and completion_ids[-1] == engine.eos_token_id and closing.startswith(eos_text):
        closing = closing[len(eos_text) :]  # the model already closed its turn
    return engine.encode(closing + extended[len(closed) :])
