"""The prompt of a multi-turn rollout: the dataset row's prompt as chat messages, rendered whole.

The trainer encodes it (the shared start of every trajectory of the group, without the
generation prompt) and sends the messages with the job, so that the rollout side renders each
trajectory's continuation from the same conversation.
"""

from __future__ import annotations

from typing import Any

from periodic_rl.agents.environment import Message


def prompt_messages(prompt: str | list[Message], system_prompt: str | None) -> list[Message]:
    """``prompt`` as chat messages: a string becomes a user message, after ``system_prompt``
    when given (as single-turn prompts are encoded); a list of messages is kept."""
    if isinstance(prompt, str):
        messages: list[Message] = [{"role": "user", "content": prompt}]
        if system_prompt:
            messages.insert(0, {"role": "system", "content": system_prompt})
        return messages
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        return [dict(m) for m in prompt]
    raise ValueError(
        f"a prompt must be a string or a list of chat messages, got {type(prompt).__name__}"
    )


def job_row(row: dict[str, Any], system_prompt: str | None) -> dict[str, Any]:
    """What a multi-turn job carries to its environment: the row's columns, with the prompt as
    the chat messages the trainer encoded."""
    return {**row, "prompt": prompt_messages(row["prompt"], system_prompt)}


def fit_agent_prompts(ids: list[list[int]], max_length: int | None, where: str) -> list[list[int]]:
    """``ids`` unchanged, or a clear error: a multi-turn prompt cannot be cut (each turn is
    rendered as the continuation of the whole conversation)."""
    if max_length is None:
        return ids
    long = [i for i, prompt in enumerate(ids) if len(prompt) > max_length]
    if long:
        raise ValueError(
            f"{where} {long[0]} has {len(ids[long[0]])} tokens, over max_prompt_length="
            f"{max_length} ({len(long)} such prompts): multi-turn rollouts cannot cut a prompt, "
            "since every turn continues the whole rendered conversation. Raise "
            "max_prompt_length, or filter the long prompts out of the data"
        )
    return ids
