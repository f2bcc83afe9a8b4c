"""Incremental rendering with SmolLM2's tokenizer: its ChatML template (which ignores tools), a
Qwen2.5-style template (tools in the system prompt, tool replies merged into one user turn),
and templates that are not prefix-stable or rewrite the model's turn, refused with a clear
error. The model's tokens are never re-tokenized; the whole sequence must read as the
template's rendering of the conversation."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from periodic_rl.agents.rendering import (
    ChatRenderer,
    IncrementalRenderError,
    tool_system_prompt,
    truncate_reply,
)
from periodic_rl.agents.tool_calls import parse_tool_calls
from periodic_rl.agents.tools import ToolRunner, Toolset


def lookup(city: str) -> str:
    """Look up the weather of a city.

    Args:
        city: the city's name
    """
    return f"sunny in {city}"


TOOLS = Toolset.from_functions([lookup])
PROMPT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
]
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"city": "Paris"}}\n</tool_call>'
REPLY = [{"role": "tool", "name": "lookup", "tool_call_id": "call_0_0", "content": "sunny"}]

QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""  # noqa: E501

# Renders the last assistant turn with an empty reasoning block, earlier ones without (Qwen3
# with enable_thinking=False behaves so).
LAST_TURN_THINKS = r"""{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\n' }}
    {%- if message.role == 'assistant' and loop.last %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
    {{- message.content + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' }}{%- endif %}
"""

# Drops the reasoning of assistant turns before the last user message (as Qwen3 does).
DROPS_OLD_REASONING = r"""{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content %}
    {%- if message.role == 'assistant' and loop.index0 < ns.last_query and '</think>' in content %}
        {%- set content = content.split('</think>')[-1].lstrip('\n') %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

# Drops the newline after an assistant turn that a tool reply follows.
TOOL_TURN_SEPARATOR = r"""{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' }}
    {%- if not (message.role == 'assistant' and not loop.last and messages[loop.index0 + 1].role == 'tool') %}{{- '\n' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""  # noqa: E501

TRIMS_CONTENT = r"""{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\n' + message.content | trim + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


def sampled(renderer: ChatRenderer, text: str, end: bool = True) -> list[int]:
    """Tokens a model could have sampled for ``text``: one per character, not the tokenizer's
    own encoding of it (so a re-tokenization would show), then the end token."""
    ids = [i for character in text for i in renderer.encode(character)]
    return ids + (renderer.encode("<|im_end|>") if end else [])


def test_a_template_that_ignores_tools_gets_them_in_the_system_message(tokenizer):
    renderer = ChatRenderer(tokenizer, TOOLS.schemas())
    assert renderer.tools_in_system_prompt
    assert renderer.tool_call_format == "hermes"
    system = "Be brief.\n\n" + tool_system_prompt(TOOLS.schemas())
    assert renderer.decode(renderer.prompt_ids(PROMPT)) == (
        f"<|im_start|>system\n{system}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert json.dumps(TOOLS.schemas()[0]) in system
    assert '<tool_call>\n{"name": <function-name>' in system
    alone = renderer.render(PROMPT[1:], add_generation_prompt=True)
    assert alone.startswith("<|im_start|>system\n# Tools\n")
    assert "SmolLM" not in alone  # the template's default system message is replaced


def test_without_tools_the_prompt_is_the_templates(tokenizer):
    renderer = ChatRenderer(tokenizer)
    assert not renderer.tools_in_system_prompt
    expected = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
    assert renderer.prompt_ids(PROMPT) == list(expected["input_ids"])


def test_turns_continue_from_the_models_exact_tokens(tokenizer):
    renderer = ChatRenderer(tokenizer, TOOLS.schemas())
    ids = renderer.prompt_ids(PROMPT)
    model = sampled(renderer, f"Checking.{CALL}")
    assert renderer.encode(renderer.decode(model)) != model  # re-tokenizing would change them
    ids += model
    env = renderer.continuation(PROMPT, renderer.decode(model), REPLY)
    assert renderer.decode(env) == "\n<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n"
    ids += env
    trajectory = [{"role": "assistant", "content": f"Checking.{CALL}"}, *REPLY]
    renderer.check_whole(PROMPT, trajectory, ids)  # ends with the generation prompt
    final = sampled(renderer, "It is sunny.")
    trajectory.append({"role": "assistant", "content": "It is sunny."})
    renderer.check_whole(PROMPT, trajectory, ids + final)
    renderer.check_whole(PROMPT, trajectory, ids + final[:-1])  # a last turn cut short

    wrong = ids + sampled(renderer, "It is rainy.")
    with pytest.raises(IncrementalRenderError, match=f"from token {len(ids) + 6} on, at character"):
        renderer.check_whole(PROMPT, trajectory, wrong)
    with pytest.raises(IncrementalRenderError, match="not with an end token"):
        renderer.check_whole(PROMPT, trajectory, ids + final + renderer.encode("\n"))


def test_a_turn_cut_before_its_end_token_gets_it_from_the_environment(tokenizer):
    renderer = ChatRenderer(tokenizer, TOOLS.schemas())
    env = renderer.continuation(PROMPT, CALL, REPLY)
    assert renderer.decode(env).startswith("<|im_end|>\n<|im_start|>tool\nsunny")
    ids = renderer.prompt_ids(PROMPT) + sampled(renderer, CALL, end=False) + env
    renderer.check_whole(PROMPT, [{"role": "assistant", "content": CALL}, *REPLY], ids)


def test_opening_messages_before_the_first_turn(tokenizer):
    renderer = ChatRenderer(tokenizer)
    shared = renderer.prompt_ids(PROMPT, add_generation_prompt=False)
    observation = [{"role": "user", "content": "You see a door."}]
    ids = shared + renderer.opening(PROMPT, observation)
    renderer.check_whole(PROMPT, observation, ids)
    assert renderer.decode(renderer.opening(PROMPT, [])) == "<|im_start|>assistant\n"


def test_qwen_style_template_renders_tools_and_merges_tool_replies(smollm2_path):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    tokenizer.chat_template = QWEN25_TEMPLATE
    renderer = ChatRenderer(tokenizer, TOOLS.schemas())
    assert not renderer.tools_in_system_prompt
    assert renderer.tool_call_format == "hermes"
    ids = renderer.prompt_ids(PROMPT)
    prompt = renderer.decode(ids)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(TOOLS.schemas()[0], ensure_ascii=False) in prompt

    turn = CALL + "\n" + CALL.replace("Paris", "Oslo")
    calls = parse_tool_calls(turn, renderer.tool_call_format)
    replies = [
        {"role": "tool", "name": c.name, "tool_call_id": c.id, "content": text}
        for c, text in zip(calls, ["sunny", "rain"], strict=True)
    ]
    model = sampled(renderer, turn)
    env = renderer.continuation(PROMPT, renderer.decode(model), replies)
    assert renderer.decode(env) == (
        "\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrain\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    trajectory = [{"role": "assistant", "content": turn}, *replies]
    final = sampled(renderer, "Sunny, then rain.")
    trajectory.append({"role": "assistant", "content": "Sunny, then rain."})
    renderer.check_whole(PROMPT, trajectory, ids + model + env + final)


@pytest.mark.parametrize(
    ("template", "turn", "reply"),
    [
        (LAST_TURN_THINKS, CALL, REPLY),
        (
            DROPS_OLD_REASONING,
            "<think>count</think>\nMy guess: 5",
            [{"role": "user", "content": "Higher."}],
        ),
        (TOOL_TURN_SEPARATOR, CALL, REPLY),
    ],
    ids=["last-turn-special", "drops-old-reasoning", "tool-turn-separator"],
)
def test_templates_that_are_not_prefix_stable_are_refused(tokenizer, template, turn, reply):
    renderer = ChatRenderer(tokenizer, chat_template=template)
    with pytest.raises(IncrementalRenderError) as error:
        renderer.continuation(PROMPT, turn + "<|im_end|>", reply)
    message = str(error.value)
    assert "renders earlier turns differently once a new message follows" in message
    assert "at character" in message
    assert "pass chat_template=" in message


def test_dropped_reasoning_is_fine_until_a_new_user_message(tokenizer):
    renderer = ChatRenderer(tokenizer, chat_template=DROPS_OLD_REASONING)
    turn = "<think>count</think>\nMy guess: 5"
    env = renderer.continuation(PROMPT, turn + "<|im_end|>", REPLY)  # a tool reply: no query
    assert renderer.decode(env) == "\n<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_rewrites_the_models_turn_is_refused(tokenizer):
    renderer = ChatRenderer(tokenizer, chat_template=TRIMS_CONTENT)
    renderer.continuation(PROMPT, "5<|im_end|>", REPLY)  # nothing to trim: fine
    with pytest.raises(IncrementalRenderError, match="differently from how the model wrote it"):
        renderer.continuation(PROMPT, " 5 <|im_end|>", REPLY)


def test_continuation_needs_new_messages(tokenizer):
    with pytest.raises(ValueError, match="new messages"):
        ChatRenderer(tokenizer).continuation(PROMPT, "hi<|im_end|>", [])


def test_a_tool_turn_end_to_end(tokenizer):
    renderer = ChatRenderer(tokenizer, TOOLS.schemas())
    turn = '<tool_call>{"name": "lookup", "arguments": {"city": "Oslo"}}</tool_call>'
    calls = parse_tool_calls(turn, renderer.tool_call_format)
    with ToolRunner(TOOLS) as runner:
        results = [runner.submit(c.name, c.arguments).result(timeout=10) for c in calls]
    replies = [
        {"role": "tool", "name": c.name, "tool_call_id": c.id, "content": r.content}
        for c, r in zip(calls, results, strict=True)
    ]
    env = renderer.continuation(PROMPT, turn + "<|im_end|>", replies)
    assert "<|im_start|>tool\nsunny in Oslo<|im_end|>" in renderer.decode(env)


def test_truncate_reply_marks_the_cut(tokenizer):
    assert truncate_reply(tokenizer, "short reply", 16) == ("short reply", False)
    text = "word " * 100
    total = len(tokenizer.encode(text, add_special_tokens=False))
    out, cut = truncate_reply(tokenizer, text, 16)
    assert cut
    kept, marker = out.split("… ")
    assert marker == f"[truncated: {total} tokens, cap 16]"
    assert text.startswith(kept) and kept
    assert len(tokenizer.encode(kept, add_special_tokens=False)) <= 16


def test_truncate_reply_does_not_split_a_character(tokenizer):
    text = "日本語のテキスト" * 20
    out, cut = truncate_reply(tokenizer, text, 7)
    kept = out.split("… ")[0]
    assert cut and "\ufffd" not in out
    assert text.startswith(kept)
