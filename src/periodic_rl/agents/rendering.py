"""Token-in, token-out rendering of multi-turn conversations with the tokenizer's chat template.

The model's tokens are never re-tokenized: after a model turn, only the environment's new
messages are rendered, as the text that takes the rendering of the conversation so far to the
rendering of the conversation with them (and the generation prompt). That works when the chat
template is prefix-stable: its rendering of a conversation is a prefix of its rendering of any
continuation of it. Templates that are not (one that drops the reasoning of earlier turns, or
renders the last assistant turn specially) are refused with :class:`IncrementalRenderError`
rather than silently producing token sequences that no rendering of the conversation matches.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from periodic_rl.agents.tool_calls import ToolCallFormat, resolve_format
from periodic_rl.models import TOKENIZER_LOCK

#: A chat message as the chat template reads it (``role``, ``content``, maybe ``name``...).
Message = Mapping[str, Any]


class ChatTokenizer(Protocol):
    """What the renderer needs of a tokenizer (any ``transformers`` tokenizer has it)."""

    @property
    def eos_token(self) -> str | None: ...

    @property
    def chat_template(self) -> str | None: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any: ...

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], **kwargs: Any) -> str: ...


class IncrementalRenderError(ValueError):
    """The chat template cannot render a conversation one turn at a time consistently."""


_FIX = (
    "multi-turn rollouts need a chat template whose rendering of a conversation is a prefix of "
    "its rendering of any continuation, and that writes the model's turns verbatim: pass "
    "chat_template= (AgentConfig.chat_template) with such a template, e.g. one that keeps "
    "earlier turns as written instead of dropping their reasoning or trimming them"
)


def tool_system_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tool instructions the renderer writes into the system message when the chat template
    ignores ``tools``: the JSON schemas, one a line, and the hermes call format
    (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``)."""
    schemas = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{schemas}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


class ChatRenderer:
    """Renders prompts and environment replies for one tokenizer, chat template and toolset.

    ``tools`` are JSON schemas (``Toolset.schemas()``). A template that renders them (Qwen,
    Llama 3.1, Hermes...) gets them as ``tools=``; one that ignores them (SmolLM2's ChatML,
    for one: rendering with and without tools is the same) gets :func:`tool_system_prompt`
    appended to the system message instead (a system message is added when there is none, which
    replaces such a template's default one); :attr:`tool_call_format` says which format the
    model is then asked for. ``chat_template`` replaces the tokenizer's; ``template_kwargs``
    go to the template (``enable_thinking=False``...). ``end_texts`` are the texts of the
    tokens that end a model turn (default: the tokenizer's EOS token).
    """

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        end_texts: Sequence[str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = [dict(tool) for tool in tools] if tools else None
        self.chat_template = chat_template
        self.template_kwargs = dict(template_kwargs or {})
        ends = end_texts if end_texts is not None else [tokenizer.eos_token or ""]
        self.end_texts = tuple(end for end in ends if end)
        if not self.end_texts:
            raise ValueError("the tokenizer has no EOS token: pass end_texts=[...]")
        self.tools_in_system_prompt = self.tools is not None and self._ignores_tools()
        if self.tools is not None:
            self._check_tool_replies()

    @property
    def tool_call_format(self) -> ToolCallFormat:
        """The format the model is asked to call tools in (for ``parse_tool_calls``)."""
        if self.tools_in_system_prompt:
            return "hermes"
        return resolve_format("auto", self.chat_template or self.tokenizer.chat_template)

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
        """The template's text for ``messages`` (with the tools, as described above)."""
        conversation = [dict(message) for message in messages]
        if self.tools_in_system_prompt:
            conversation = self._with_tool_prompt(conversation)
        tools = None if self.tools_in_system_prompt else self.tools
        return self._apply(conversation, tools, add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        """Token ids of template text (special tokens written in it become those tokens)."""
        with TOKENIZER_LOCK:
            return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """The exact text of ``ids``, special tokens included, nothing cleaned up."""
        with TOKENIZER_LOCK:
            return self.tokenizer.decode(
                list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
            )

    def prompt_ids(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """The prompt's token ids: ``messages`` rendered with the tools and, by default, the
        generation prompt (without it, :meth:`opening` supplies it)."""
        return self.encode(self.render(messages, add_generation_prompt=add_generation_prompt))

    def opening(self, messages: Sequence[Message], new_messages: Sequence[Message]) -> list[int]:
        """The ids that follow ``prompt_ids(messages, add_generation_prompt=False)`` so that the
        sequence reads as ``messages + new_messages`` with the generation prompt (just the
        generation prompt when ``new_messages`` is empty)."""
        after = self.render([*messages, *new_messages], add_generation_prompt=True)
        before = self._open(self.render(messages, add_generation_prompt=False), after)
        self._require_prefix(
            before, after, "renders earlier turns differently once a new message follows"
        )
        return self.encode(after[len(before) :])

    def continuation(
        self, messages: Sequence[Message], model_text: str, new_messages: Sequence[Message]
    ) -> list[int]:
        """The ids to append after the model's tokens so that the whole sequence reads as the
        rendering of ``messages``, the model's turn and ``new_messages``, with the generation
        prompt.

        ``messages`` is the conversation before the model's turn (the prompt and earlier turns;
        the model's turns as ``{"role": "assistant", "content": <text without end token>}``,
        with no ``tool_calls`` key, since templates re-serialize those differently from how the
        model wrote them). ``model_text`` is the turn decoded exactly as generated, with its
        end token's text; a turn cut before its end token gets the template's end of turn
        appended here, as environment tokens. ``new_messages`` are the environment's replies
        (``tool`` messages, or a ``user`` observation).

        Raises :class:`IncrementalRenderError` when the template is not prefix-stable or renders
        the model's turn differently from how the model wrote it.
        """
        if not new_messages:
            raise ValueError("continuation needs the environment's new messages (none given)")
        turn = [*messages, {"role": "assistant", "content": self.strip_end(model_text)}]
        before = self.render(messages, add_generation_prompt=True)
        whole = self.render([*turn, *new_messages], add_generation_prompt=True)
        with_turn = self._open(self.render(turn, add_generation_prompt=False), whole)
        self._require_prefix(
            with_turn, whole, "renders earlier turns differently once a new message follows"
        )
        self._require_prefix(
            before,
            with_turn,
            "begins a written assistant turn differently from its generation prompt",
        )
        written = before + model_text
        self._require_prefix(
            written,
            with_turn,
            "renders the model's turn differently from how "
            "the model wrote it (it changes assistant content: trims it, drops "
            "reasoning, or the model's text has no end token where expected)",
        )
        return self.encode(whole[len(written) :])

    def strip_end(self, model_text: str) -> str:
        """The model's turn without its end token's text (the assistant message's content)."""
        for end in self.end_texts:
            if model_text.endswith(end):
                return model_text[: -len(end)]
        return model_text

    def check_whole(
        self, prompt_messages: Sequence[Message], messages: Sequence[Message], ids: Sequence[int]
    ) -> None:
        """Check that ``ids`` (the prompt's and the trajectory's) decode to the template's
        rendering of ``prompt_messages + messages``: with the generation prompt after an
        environment's message; after a model turn, up to that turn's end token (or its last
        token, when it was cut). Raises :class:`IncrementalRenderError` naming the first
        difference."""
        conversation = [*prompt_messages, *messages]
        text = self.decode(ids)
        last = conversation[-1] if messages else None
        if last is None or last.get("role") != "assistant":
            expected = self.render(conversation, add_generation_prompt=True)
            if text != expected:
                raise IncrementalRenderError(self._whole_mismatch(expected, text, ids))
            return
        expected = self.render(conversation, add_generation_prompt=False)
        before = self.render(conversation[:-1], add_generation_prompt=True)
        content_end = len(before) + len(str(last.get("content", "")))
        tail = text[content_end:]
        if not expected.startswith(text) or len(text) < content_end:
            raise IncrementalRenderError(self._whole_mismatch(expected, text, ids))
        if tail and tail not in self.end_texts:
            raise IncrementalRenderError(
                f"the trajectory's last model turn ends with {tail!r} after its content, not "
                f"with an end token ({', '.join(map(repr, self.end_texts))})"
            )

    def _whole_mismatch(self, expected: str, text: str, ids: Sequence[int]) -> str:
        at = _first_difference(expected, text)
        low, high = 0, len(ids)  # the first token whose text reaches past the difference
        while low < high:
            middle = (low + high) // 2
            if len(self.decode(ids[: middle + 1])) > at:
                high = middle
            else:
                low = middle + 1
        return (
            "the token ids do not read as the chat template's rendering of the conversation: "
            f"from token {low} on, {_mismatch(expected, text)}"
        )

    def _apply(
        self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None, gen: bool
    ) -> str:
        with TOKENIZER_LOCK:
            return self.tokenizer.apply_chat_template(
                conversation,
                tools=tools,
                add_generation_prompt=gen,
                tokenize=False,
                chat_template=self.chat_template,
                **self.template_kwargs,
            )

    def _ignores_tools(self) -> bool:
        """Whether the template renders a probe conversation the same with and without tools."""
        probe = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
        try:
            plain = self._apply(probe, None, True)
        except Exception:  # a template without a system role
            probe = probe[1:]
            plain = self._apply(probe, None, True)
        return self._apply(probe, self.tools, True) == plain

    def _with_tool_prompt(self, conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
        prompt = tool_system_prompt(self.tools or [])
        if conversation and conversation[0].get("role") == "system":
            system = conversation[0]
            return [
                {**system, "content": f"{system.get('content', '')}\n\n{prompt}"},
                *conversation[1:],
            ]
        return [{"role": "system", "content": prompt}, *conversation]

    def _open(self, rendering: str, continued: str) -> str:
        """``rendering`` (made without the generation prompt) without the EOS token text that
        some templates write after the last message only (Phi-3's), when the rendering of the
        continued conversation has the rest of it there instead: that EOS closes the whole
        conversation, it belongs to no turn."""
        eos = self.tokenizer.eos_token or ""
        if eos and rendering.endswith(eos) and not continued.startswith(rendering):
            opened = rendering[: -len(eos)]
            if continued.startswith(opened):
                return opened
        return rendering

    def _check_tool_replies(self) -> None:
        """Fail at set-up, not at a trajectory's first tool call, when the template cannot
        render a tool's reply and a turn after it (Gemma 3's raises on a ``tool`` message;
        Command's drops its content, then raises on the next assistant turn)."""
        reply = "tool reply 8e1f"
        probe = [
            {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A"},
            {"role": "tool", "name": "tool", "tool_call_id": "call_0", "content": reply},
            {"role": "assistant", "content": "B"},
        ]
        try:
            text = self.render(probe[:3], add_generation_prompt=True)
            self.render(probe, add_generation_prompt=False)
            problem = None if reply in text else "drops the reply's content"
        except Exception as error:  # noqa: BLE001 - any template failure, named below
            problem = f"raises {type(error).__name__}: {error}"
        if problem is not None:
            raise IncrementalRenderError(
                "this chat template cannot render a tool's reply (a 'tool' message between two "
                f"assistant turns): it {problem}. Tools need a template with a tool role: pass "
                "chat_template= (AgentConfig.chat_template) with one, or answer the model "
                "through an Environment, whose observations are user messages"
            )

    def _require_prefix(self, prefix: str, text: str, problem: str) -> None:
        if not text.startswith(prefix):
            raise IncrementalRenderError(
                f"this chat template {problem}: {_mismatch(text, prefix)}; {_FIX}"
            )


def _first_difference(expected: str, actual: str) -> int:
    return next(
        (i for i, (a, b) in enumerate(zip(expected, actual, strict=False)) if a != b),
        min(len(expected), len(actual)),
    )


def _mismatch(expected: str, actual: str) -> str:
    """Where ``actual`` first departs from ``expected``, with the text around it."""
    at = _first_difference(expected, actual)
    start = max(0, at - 40)
    return (
        f"at character {at}, the template's rendering has {expected[start : at + 40]!r} where "
        f"the sequence has {actual[start : at + 40]!r}"
    )


def truncate_reply(tokenizer: ChatTokenizer, text: str, max_tokens: int) -> tuple[str, bool]:
    """``text`` cut to its first ``max_tokens`` tokens, the cut marked in the text
    (``… [truncated: 1234 tokens, cap 256]``, a few tokens more), and whether it was cut."""
    with TOKENIZER_LOCK:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= max_tokens:
            return text, False
        kept = tokenizer.decode(
            list(ids[:max_tokens]), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
    kept = kept.rstrip("\ufffd")  # a character whose bytes the cut split
    return f"{kept}… [truncated: {len(ids)} tokens, cap {max_tokens}]", True
