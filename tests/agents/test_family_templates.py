"""Incremental rendering against whole-conversation rendering with the real chat templates of
the model families users train: Llama 3.1 and 3.2, Qwen2.5 and Qwen3, Gemma 3, Phi-3.5,
DeepSeek-V3, Cohere2 (Command), GLM-4-MoE and LFM2 (SmolLM2's own is in test_rendering.py).

The templates in ``chat_templates/`` are the originals as their models ship them, and TRL's
prefix-preserving training variant of Qwen3's (copied from TRL 1.16's ``trl/chat_templates``,
Apache-2.0). Each is rendered with SmolLM2's tokenizer plus the family's special tokens, so that
those encode as one token each, as in the family's own tokenizer. Two trajectories per template:
the model's turn, then an environment's observation (a ``user`` message), then a final turn; and
the same with a tool's reply (a ``tool`` message) where the template has a tool role. Each must
either read back as the template's rendering of the whole conversation, token for token (the
model's tokens sampled one character at a time, so a re-tokenization would show), or be refused
with :class:`IncrementalRenderError` before any training: never silently different.
:data:`EXPECTED` records which, per template.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from periodic_rl.agents.rendering import ChatRenderer, IncrementalRenderError
from periodic_rl.agents.tools import Toolset

TEMPLATES = Path(__file__).resolve().parent / "chat_templates"


def lookup(city: str) -> str:
    """Look up the weather of a city.

    Args:
        city: the city's name
    """
    return f"sunny in {city}"


TOOLS = Toolset.from_functions([lookup]).schemas()
PROMPT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Guess my number from 1 to 8, or look up the weather."},
]
OBSERVATION = [{"role": "user", "content": "Higher."}]
TOOL_REPLY = [{"role": "tool", "name": "lookup", "tool_call_id": "call_0", "content": "sunny"}]
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"city": "Paris"}}\n</tool_call>'


@dataclass(frozen=True)
class Family:
    """A template's special tokens: its BOS and EOS texts, the texts that end a model turn,
    and the other special tokens it writes."""

    bos: str | None
    eos: str
    ends: tuple[str, ...]
    others: tuple[str, ...] = ()
    template_kwargs: tuple[tuple[str, bool], ...] = ()


LLAMA3 = ("<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>")
DEEPSEEK = ("<｜User｜>", "<｜Assistant｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>")
DEEPSEEK += ("<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>")
COHERE = ("<|START_OF_TURN_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>")
COHERE += ("<|START_RESPONSE|>", "<|END_RESPONSE|>")
GLM = ("[gMASK]", "<sop>", "<|system|>", "<|assistant|>")
LFM = ("<|tool_list_start|>", "<|tool_list_end|>", "<|tool_response_start|>")
LFM += ("<|tool_response_end|>",)
PHI3 = ("<|system|>", "<|user|>", "<|assistant|>")
DEEPSEEK_BOS, DEEPSEEK_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
IM_END, EOT, COHERE_END = "<|im_end|>", "<|eot_id|>", "<|END_OF_TURN_TOKEN|>"
NO_THINKING = (("enable_thinking", False),)
FAMILIES: dict[str, Family] = {
    "llama3_1": Family("<|begin_of_text|>", EOT, (EOT,), LLAMA3),
    "llama3_2": Family("<|begin_of_text|>", EOT, (EOT,), LLAMA3),
    "qwen2_5": Family(None, IM_END, (IM_END,)),
    "qwen3": Family(None, IM_END, (IM_END,), (), NO_THINKING),
    "qwen3_training": Family(None, IM_END, (IM_END,), (), NO_THINKING),
    "gemma3": Family("<bos>", "<eos>", ("<end_of_turn>",), ("<start_of_turn>",)),
    "phi3_5": Family(None, "<|endoftext|>", ("<|end|>",), PHI3),
    "deepseekv3": Family(DEEPSEEK_BOS, DEEPSEEK_EOS, (DEEPSEEK_EOS,), DEEPSEEK),
    "cohere2": Family("<BOS_TOKEN>", COHERE_END, ("<|END_RESPONSE|>",), COHERE),
    "glm4moe": Family(None, "<|endoftext|>", ("<|user|>", "<|observation|>"), GLM),
    "lfm2": Family("<|startoftext|>", IM_END, (IM_END,), LFM),
}

#: What each template gives, per trajectory (an observation, a tool's reply): "exact", or the
#: words of its refusal. Each refusal names a real property of the template: Qwen3's (without
#: thinking) writes an empty reasoning block into the last assistant turn only, and TRL's training
#: variant of it is exact; DeepSeek-V3's generation prompt opens a reasoning block that its
#: written turns do not have; GLM-4-MoE writes an empty one into turns the model wrote without;
#: Gemma 3 raises on a tool message; Phi-3.5 drops it; Command drops it, then raises.
NOT_STABLE = "renders earlier turns differently once a new message follows"
NO_TOOL_ROLE = "cannot render a tool's reply"
EXPECTED: dict[str, tuple[str, str]] = {
    "llama3_1": ("exact", "exact"),
    "llama3_2": ("exact", "exact"),
    "qwen2_5": ("exact", "exact"),
    "qwen3": (NOT_STABLE, NOT_STABLE),
    "qwen3_training": ("exact", "exact"),
    "gemma3": ("exact", NO_TOOL_ROLE),
    "phi3_5": ("exact", NO_TOOL_ROLE),
    "deepseekv3": ("begins a written assistant turn differently",) * 2,
    "cohere2": ("exact", NO_TOOL_ROLE),
    "glm4moe": ("renders the model's turn differently",) * 2,
    "lfm2": ("exact", "exact"),
}


@pytest.fixture(scope="module")
def base_tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


def family_tokenizer(base, name: str):
    """SmolLM2's tokenizer with the family's special tokens, BOS, EOS and template."""
    family = FAMILIES[name]
    tokenizer = copy.deepcopy(base)
    texts = (family.bos, family.eos, *family.ends, *family.others)
    specials = [t for t in dict.fromkeys(texts) if t and t not in tokenizer.get_vocab()]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.bos_token = family.bos
    tokenizer.eos_token = family.eos
    tokenizer.chat_template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    return tokenizer


def sampled(renderer: ChatRenderer, text: str, end: str) -> list[int]:
    """Tokens a model could have sampled for ``text``: one per character (not the tokenizer's
    own encoding of the text), then the end of its turn."""
    return [i for character in text for i in renderer.encode(character)] + renderer.encode(end)


def trajectory_outcome(tokenizer, name: str, kind: str) -> str:
    """Two model turns around an environment's reply, checked against the whole rendering
    after each: "exact", or the refusal's message."""
    family = FAMILIES[name]
    ends = family.ends
    try:
        renderer = ChatRenderer(
            tokenizer,
            TOOLS if kind == "tool" else None,
            end_texts=ends,
            template_kwargs=dict(family.template_kwargs),
        )
        first = f"Checking.\n{CALL}" if kind == "tool" else "My guess: 4"
        replies = TOOL_REPLY if kind == "tool" else OBSERVATION
        ids = renderer.prompt_ids(PROMPT)
        model = sampled(renderer, first, ends[0])
        ids += model
        env = renderer.continuation(PROMPT, renderer.decode(model), replies)
        ids += env
        trajectory = [{"role": "assistant", "content": first}, *replies]
        renderer.check_whole(PROMPT, trajectory, ids)
        final = sampled(renderer, "It is 6.", ends[0])
        trajectory.append({"role": "assistant", "content": "It is 6."})
        renderer.check_whole(PROMPT, trajectory, ids + final)
        # the environment's tokens are exactly what turns the first turn into the whole
        whole = renderer.render([*PROMPT, *trajectory[:-1]], add_generation_prompt=True)
        assert renderer.decode(ids) == whole
    except IncrementalRenderError as error:
        return str(error)
    return "exact"


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("kind", ["observation", "tool"])
def test_a_family_template_is_exact_or_refused_before_training(base_tokenizer, name, kind):
    outcome = trajectory_outcome(family_tokenizer(base_tokenizer, name), name, kind)
    expected = EXPECTED[name][kind == "tool"]
    if expected == "exact":
        assert outcome == "exact", outcome
    else:
        assert expected in outcome and "pass chat_template=" in outcome, outcome


def test_every_template_here_has_an_expectation():
    assert {p.stem for p in TEMPLATES.glob("*.jinja")} == set(FAMILIES) == set(EXPECTED)
