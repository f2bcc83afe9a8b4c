"""Tool calls parsed out of model text: the hermes and llama3_json formats, botched calls as
error entries in place, deterministic ids, and the format chosen from a chat template."""

from __future__ import annotations

import pytest

from periodic_rl.agents.tool_calls import (
    ToolCall,
    ToolCallError,
    parse_tool_calls,
    resolve_format,
)

HERMES_TWO = (
    "Let me look both up.\n"
    '<tool_call>\n{"name": "lookup", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "convert", "arguments": {"value": 3.5, "unit": "km"}}\n</tool_call>'
)


def test_hermes_calls_in_order_with_turn_numbered_ids():
    calls = parse_tool_calls(HERMES_TWO, "hermes", turn=3)
    assert calls == [
        ToolCall("lookup", {"city": "Paris"}, "call_3_0"),
        ToolCall("convert", {"value": 3.5, "unit": "km"}, "call_3_1"),
    ]


def test_text_without_calls_gives_none():
    assert parse_tool_calls("The answer is 42.", "hermes") == []
    assert parse_tool_calls("The answer is 42.<|im_end|>", "hermes") == []


def test_a_trailing_end_token_does_no_harm():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call><|im_end|>'
    assert parse_tool_calls(text, "hermes") == [ToolCall("f", {}, "call_0_0")]


def test_malformed_json_is_an_error_entry_in_its_place():
    text = (
        '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "g", "arguments": {"x": }</tool_call>'
        '<tool_call>{"name": "h", "arguments": {}}</tool_call>'
    )
    calls = parse_tool_calls(text, "hermes", turn=1)
    assert [type(c) for c in calls] == [ToolCall, ToolCallError, ToolCall]
    assert [c.id for c in calls] == ["call_1_0", "call_1_1", "call_1_2"]
    error = calls[1]
    assert isinstance(error, ToolCallError)
    assert "not valid JSON" in error.reason
    assert '"g"' in error.text


def test_unclosed_tag_is_an_error():
    calls = parse_tool_calls('Calling <tool_call>{"name": "f", "arguments": {}}', "hermes")
    assert len(calls) == 1
    assert isinstance(calls[0], ToolCallError)
    assert "</tool_call>" in calls[0].reason


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ('{"arguments": {"x": 1}}', '"name"'),
        ('["f", {"x": 1}]', "JSON object"),
        ('{"name": "f", "arguments": [1, 2]}', "JSON object mapping"),
        ('{"name": "f", "arguments": "{not json"}', "arguments of 'f' are not valid JSON"),
    ],
)
def test_calls_without_a_name_or_object_arguments_are_errors(body, reason):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>", "hermes")
    assert isinstance(call, ToolCallError)
    assert reason in call.reason


def test_arguments_written_as_a_json_string_are_decoded():
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>'
    assert parse_tool_calls(text, "hermes") == [ToolCall("f", {"x": 2}, "call_0_0")]


def test_parsing_is_deterministic():
    assert parse_tool_calls(HERMES_TWO, "hermes", turn=2) == parse_tool_calls(
        HERMES_TWO, "hermes", turn=2
    )


def test_llama3_json_bare_object():
    text = '{"name": "lookup", "parameters": {"city": "Oslo"}}<|eot_id|>'
    assert parse_tool_calls(text, "llama3_json", turn=1) == [
        ToolCall("lookup", {"city": "Oslo"}, "call_1_0")
    ]


def test_llama3_json_python_tag_and_several_calls():
    text = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"n": 1}}'
    calls = parse_tool_calls(text, "llama3_json")
    assert calls == [ToolCall("a", {}, "call_0_0"), ToolCall("b", {"n": 1}, "call_0_1")]


@pytest.mark.parametrize(
    "text",
    ["The answer is 4.", '{"answer": 4}', "{ not json, just braces }", "Use {x} here"],
)
def test_llama3_json_plain_answers_are_not_calls(text):
    assert parse_tool_calls(text, "llama3_json") == []


def test_llama3_json_broken_call_is_an_error():
    (call,) = parse_tool_calls('{"name": "a", "parameters": {"x": 1}', "llama3_json")
    assert isinstance(call, ToolCallError)
    assert "not valid JSON" in call.reason


LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- if tools is not none %}{{- 'Environment: ipython' }}{%- endif %}"
    "{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{ '<tool_call>' }}{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),
        (LLAMA3_TEMPLATE, "llama3_json"),
        ("{% for m in messages %}<|start_header_id|>{{ m.content }}{% endfor %}", "hermes"),
        (None, "hermes"),
    ],
)
def test_auto_format_from_the_chat_template(template, expected):
    assert resolve_format("auto", template) == expected


def test_auto_parses_with_the_templates_format():
    text = '{"name": "a", "parameters": {}}'
    assert parse_tool_calls(text, "auto", chat_template=LLAMA3_TEMPLATE) == [
        ToolCall("a", {}, "call_0_0")
    ]
    assert parse_tool_calls(text, "auto", chat_template=None) == []


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unknown tool call format 'xml'"):
        parse_tool_calls("", "xml")  # type: ignore[arg-type]
    assert resolve_format("hermes", LLAMA3_TEMPLATE) == "hermes"
