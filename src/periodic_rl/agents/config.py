"""`AgentConfig`: what turns single completions into multi-turn trajectories.

Given to :class:`~periodic_rl.RLModule` as ``agent=AgentConfig(...)`` (in YAML, ``agent:`` with
import paths for the tools and environments). The same value travels to every rollout worker,
which builds the tools or environments itself: classes and functions must be importable there
(installed, or on the Ray rollouts' ``pythonpath``), or picklable.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

ToolCallFormat = Literal["auto", "hermes", "llama3_json"]


def resolve(target: Any, what: str) -> Any:
    """``target`` itself, or the object a ``"package.module:name"`` string names."""
    if not isinstance(target, str):
        return target
    module_name, sep, name = target.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"{what} {target!r}: expected an object or a 'package.module:name' path")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ImportError(
            f"{what} {target!r}: cannot import {module_name!r} ({error}); is it installed, or "
            "on the Ray rollouts' pythonpath?"
        ) from error
    if not hasattr(module, name):
        raise ImportError(f"{what} {target!r}: {module_name!r} has no {name!r}")
    return getattr(module, name)


@dataclass(frozen=True)
class AgentConfig:
    """Multi-turn rollouts with tools or an environment.

    Tool level (TRL's ``tools`` and ``environment_factory``): the model's turns are parsed for
    tool calls (``tool_call_format``), the tools run concurrently in a pool of
    ``tool_workers`` threads with ``tool_timeout_s`` each, and their replies are appended as
    ``tool`` messages; a turn without a tool call ends the trajectory.

    Environment level: ``environment`` builds one object per trajectory following
    :class:`~periodic_rl.agents.environment.Environment` (``reset(row, seed)``,
    ``step(turn) -> (observation, reward, done)``, plain or ``async``); its observations are
    appended as ``user`` messages and its rewards summed into the ``environment`` reward.

    Args:
        tools: plain functions (or ``"module:function"`` paths) the model may call; their
            schemas come from their signatures and Google-style docstrings.
        environment_factory: a class (or path) built once per trajectory whose public methods
            are tools, with ``reset(**row_columns) -> str | None`` called first (the contract of
            TRL's ``environment_factory``; its returned text opens the trajectory as a user
            message).
        environment: a class or factory (or path) of an
            :class:`~periodic_rl.agents.environment.Environment`, one per trajectory. Not
            together with ``tools`` or ``environment_factory``.
        environment_kwargs: keyword arguments of ``environment`` (or ``environment_factory``)
            when it builds each instance (e.g. ``{"env_id": "Wordle-v0"}`` for
            :class:`~periodic_rl.agents.textarena.TextArenaGame`).
        max_turns: model turns per trajectory, at least 1.
        max_turn_tokens: a model turn still going after this many tokens is cut there and
            answered like one that ended (``None``: a turn ends at its end token, or when the
            trajectory's budget of model tokens, the module's ``max_new_tokens``, is spent).
        max_tool_response_tokens: a tool reply or observation longer than this is cut, and the
            cut is marked in its text.
        tool_timeout_s: a tool call (or an environment's step) that takes longer gets a
            timed-out reply (a step ends its trajectory).
        tool_workers: tool calls and environment steps running at once.
        on_tool_error: ``"reply"``: a raising tool's message goes back to the model as its
            reply; ``"raise"``: the error stops the run.
        tool_call_format: how tool calls are written: ``"hermes"``
            (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), ``"llama3_json"``,
            or ``"auto"`` (from the chat template).
        chat_template: a chat template to use instead of the tokenizer's (it must render a
            conversation as a prefix of the rendering of any continuation of it).
    """

    tools: list[Callable[..., Any] | str] = field(default_factory=list)
    environment_factory: Callable[[], Any] | str | None = None
    environment: Callable[[], Any] | str | None = None
    environment_kwargs: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 4
    max_turn_tokens: int | None = None
    max_tool_response_tokens: int = 256
    tool_timeout_s: float = 30.0
    tool_workers: int = 8
    on_tool_error: Literal["reply", "raise"] = "reply"
    tool_call_format: ToolCallFormat = "auto"
    chat_template: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tools", list(self.tools or []))
        object.__setattr__(self, "environment_kwargs", dict(self.environment_kwargs or {}))
        if self.environment is not None and (self.tools or self.environment_factory):
            raise ValueError(
                "AgentConfig: give either tools / environment_factory (the model calls tools) or "
                "environment (an object that answers every turn), not both"
            )
        if self.environment is None and not self.tools and self.environment_factory is None:
            raise ValueError(
                "AgentConfig needs tools=[...], environment_factory=... or environment=..."
            )
        for name in ("max_turns", "max_tool_response_tokens", "tool_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"AgentConfig.{name} must be an integer >= 1, got {value!r}")
        if self.max_turn_tokens is not None and (
            isinstance(self.max_turn_tokens, bool)
            or not isinstance(self.max_turn_tokens, int)
            or self.max_turn_tokens < 1
        ):
            raise ValueError(
                f"AgentConfig.max_turn_tokens must be an integer >= 1 or None, got "
                f"{self.max_turn_tokens!r}"
            )
        if not self.tool_timeout_s > 0:
            raise ValueError(f"AgentConfig.tool_timeout_s must be > 0, got {self.tool_timeout_s}")
        if self.on_tool_error not in ("reply", "raise"):
            raise ValueError(
                f"AgentConfig.on_tool_error must be 'reply' or 'raise', got {self.on_tool_error!r}"
            )
        if self.tool_call_format not in ("auto", "hermes", "llama3_json"):
            raise ValueError(
                "AgentConfig.tool_call_format must be 'auto', 'hermes' or 'llama3_json', got "
                f"{self.tool_call_format!r}"
            )

    @property
    def uses_tools(self) -> bool:
        """Whether the model's turns are parsed for tool calls (else an environment answers)."""
        return self.environment is None
