"""Tool calls read out of the model's text.

Two formats cover the common open models:

- ``"hermes"``: each call is a JSON object ``{"name": ..., "arguments": {...}}`` inside
  ``<tool_call>...</tool_call>`` tags, anywhere in the turn. Qwen2.5, Qwen3, SmolLM3 and the
  Hermes models write it, and it is the format that :class:`~periodic_rl.agents.rendering.
  ChatRenderer` asks for when a chat template ignores ``tools``.
- ``"llama3_json"``: the whole turn is a bare JSON object ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``; several calls separated by ``;``), as Llama 3.1-3.3's
  templates ask for.

A call the model botched (malformed JSON, a missing name, an unclosed tag) is not an exception:
it comes back as a :class:`ToolCallError` in the list, in its place, so the loop can answer it
with an error reply and the model can learn from it. Ids are deterministic
(``call_{turn}_{index}``), so a rerun of the same trajectory produces the same messages.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Literal

ToolCallFormat = Literal["hermes", "llama3_json"]

_HERMES_TAG = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)
_LLAMA3_PREFIX = "<|python_tag|>"
_LLAMA3_END_TEXTS = ("<|eot_id|>", "<|eom_id|>")


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: the tool's ``name``, its ``arguments`` (a JSON object) and a
    deterministic ``id`` that the tool's reply can carry as ``tool_call_id``."""

    name: str
    arguments: dict[str, object] = field(default_factory=dict)
    id: str = ""


@dataclass(frozen=True)
class ToolCallError:
    """A call the model attempted but wrote wrongly: ``text`` is what it wrote, ``reason`` says
    what is wrong in words the model can act on, ``id`` as for :class:`ToolCall`."""

    text: str
    reason: str
    id: str = ""


def resolve_format(
    format: ToolCallFormat | Literal["auto"], chat_template: str | None
) -> ToolCallFormat:
    """``format``, or for ``"auto"`` the format ``chat_template`` asks the model to call tools in.

    ``<tool_call>`` in the template means hermes; Llama 3's header markers together with a
    rendering of ``tools`` mean llama3_json; anything else (no template, a template that ignores
    tools) means hermes, the format of the tool prompt the renderer then writes itself
    (:attr:`~periodic_rl.agents.rendering.ChatRenderer.tool_call_format` knows for sure).
    """
    if format in ("hermes", "llama3_json"):
        return format
    if format != "auto":
        raise ValueError(f"unknown tool call format {format!r}: hermes, llama3_json or auto")
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|start_header_id|>" in template and "tools" in template:
        return "llama3_json"
    return "hermes"


def parse_tool_calls(
    text: str,
    format: ToolCallFormat | Literal["auto"] = "hermes",
    *,
    chat_template: str | None = None,
    turn: int = 0,
) -> list[ToolCall | ToolCallError]:
    """The tool calls in one model turn, in the order written (empty: the turn calls nothing).

    ``text`` is the model's turn; a trailing end-of-turn token text does no harm. ``format``
    ``"auto"`` picks the format from ``chat_template`` (:func:`resolve_format`). ``turn``
    numbers the ids, ``call_{turn}_{index}``, with one index across calls and errors.
    """
    resolved = resolve_format(format, chat_template)
    found = _parse_hermes(text) if resolved == "hermes" else _parse_llama3_json(text)
    calls: list[ToolCall | ToolCallError] = []
    for index, item in enumerate(found):
        call_id = f"call_{turn}_{index}"
        if isinstance(item, ToolCall):
            calls.append(ToolCall(item.name, item.arguments, call_id))
        else:
            calls.append(ToolCallError(item.text, item.reason, call_id))
    return calls


def _parse_hermes(text: str) -> list[ToolCall | ToolCallError]:
    calls: list[ToolCall | ToolCallError] = []
    for match in _HERMES_TAG.finditer(text):
        body = match.group(1).strip()
        if not match.group(2):
            reason = "the <tool_call> tag is not closed: write </tool_call> after the JSON object"
            calls.append(ToolCallError(match.group(0), reason))
            continue
        try:
            value = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(ToolCallError(body, f"the tool call is not valid JSON ({exc})"))
            continue
        calls.append(_call_from_json(value, body, "arguments"))
    return calls


def _parse_llama3_json(text: str) -> list[ToolCall | ToolCallError]:
    body = text.strip()
    for end in _LLAMA3_END_TEXTS:
        body = body.removesuffix(end).rstrip()
    tagged = body.startswith(_LLAMA3_PREFIX)
    body = body.removeprefix(_LLAMA3_PREFIX).lstrip()
    if not body.startswith(("{", "[")):
        return []
    decoder = json.JSONDecoder()
    values: list[object] = []
    position = 0
    try:
        while position < len(body):
            value, position = decoder.raw_decode(body, position)
            values.extend(value if isinstance(value, list) else [value])
            position = _skip_separators(body, position)
    except json.JSONDecodeError as exc:
        if tagged or '"name"' in body:
            return [ToolCallError(body, f"the tool call is not valid JSON ({exc})")]
        return []  # an answer that merely starts with a brace
    if not tagged and not any(isinstance(v, dict) and "name" in v for v in values):
        return []  # a JSON answer, not a call
    return [_call_from_json(value, body, "parameters") for value in values]


def _skip_separators(text: str, position: int) -> int:
    while position < len(text) and (text[position].isspace() or text[position] == ";"):
        position += 1
    return position


def _call_from_json(value: object, text: str, arguments_key: str) -> ToolCall | ToolCallError:
    """A call from its decoded JSON. Either key for the arguments is taken, and arguments given
    as a JSON string are decoded: models write both."""
    if not isinstance(value, dict):
        return ToolCallError(
            text,
            f'a tool call must be a JSON object {{"name": ..., '
            f'"{arguments_key}": {{...}}}}, got {type(value).__name__}',
        )
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError(text, 'the tool call has no "name" (a string naming the tool)')
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolCallError(text, f"the arguments of {name!r} are not valid JSON ({exc})")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCallError(
            text,
            f'the "{arguments_key}" of {name!r} must be a JSON object mapping parameter '
            f"names to values, got {type(arguments).__name__}",
        )
    return ToolCall(name, arguments)
