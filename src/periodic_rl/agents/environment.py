"""What answers a model's turn: an :class:`Environment` (games, simulated users, judges) or the
tools the model calls, both seen by the agent loop as one :class:`TurnHandler` per trajectory.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from periodic_rl.agents.tool_calls import ToolCallError, parse_tool_calls
from periodic_rl.agents.tools import ToolRunner, Toolset

Message = dict[str, Any]


@runtime_checkable
class Environment(Protocol):
    """Anything that reacts to the model's turns, one instance per trajectory.

    ``reset`` receives the dataset row (its columns, the prompt included) and the trajectory's
    seed, and returns the first observation (appended as a user message before the model's
    first turn) or ``None``. ``step`` receives the model's turn as text (without its end token)
    and returns ``(observation, reward, done)``: the observation is appended as a user message
    unless the trajectory ends; the rewards of a trajectory are summed. Either method may be
    ``async def``. Steps of different trajectories run concurrently, each in its own thread.
    """

    def reset(self, row: dict[str, Any], seed: int) -> str | None | Awaitable[str | None]: ...

    def step(
        self, turn: str
    ) -> tuple[str | None, float, bool] | Awaitable[tuple[str | None, float, bool]]: ...


@dataclass(frozen=True)
class StepResult:
    """What answered one model turn: the messages to append, the reward, whether the
    trajectory ends, and the tool calls behind it."""

    messages: list[Message]
    reward: float | None = None
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_seconds: float = 0.0


class TurnHandler(Protocol):
    """The agent loop's view of one trajectory's environment."""

    def open(self, row: dict[str, Any], seed: int) -> list[Message]:
        """Messages before the model's first turn (``[]``: none)."""
        ...

    def step(self, model_text: str) -> StepResult:
        """Answer the model's turn (its text without the end token)."""
        ...


def _awaited(value: Any) -> Any:
    """``value``, or what it resolves to when an ``async`` method returned a coroutine."""
    if inspect.isawaitable(value):
        return asyncio.run(_wait(value))
    return value


async def _wait(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


class EnvironmentHandler:
    """A user's :class:`Environment` as a :class:`TurnHandler`: observations become user
    messages."""

    def __init__(self, environment: Environment) -> None:
        for method in ("reset", "step"):
            if not callable(getattr(environment, method, None)):
                raise TypeError(
                    f"{type(environment).__name__} is not an Environment: it has no {method}() "
                    "(see periodic_rl.agents.Environment)"
                )
        self.environment = environment

    def open(self, row: dict[str, Any], seed: int) -> list[Message]:
        observation = _awaited(self.environment.reset(row, seed))
        return [] if observation is None else [{"role": "user", "content": str(observation)}]

    def step(self, model_text: str) -> StepResult:
        outcome = _awaited(self.environment.step(model_text))
        if not (isinstance(outcome, tuple) and len(outcome) == 3):
            raise TypeError(
                f"{type(self.environment).__name__}.step must return (observation, reward, done), "
                f"got {outcome!r}"
            )
        observation, reward, done = outcome
        messages = [] if observation is None else [{"role": "user", "content": str(observation)}]
        return StepResult(messages, float(reward), bool(done))


class ToolHandler:
    """Tools as a :class:`TurnHandler`: the model's turn is parsed for tool calls; none ends the
    trajectory, each call's reply (run concurrently by ``runner``) becomes a ``tool`` message.

    ``instance``: the trajectory's environment object (TRL's ``environment_factory`` contract:
    ``reset(**row_columns)`` is called first; its text opens the trajectory), or ``None``;
    ``tools``: the trajectory's tools (the functions, and ``instance``'s methods), run by the
    loop's shared ``runner``.
    """

    def __init__(
        self, runner: ToolRunner, call_format: str, tools: Toolset, instance: Any = None
    ) -> None:
        self.runner, self.call_format, self.instance = runner, call_format, instance
        self.tools = tools
        self.turn = 0

    def open(self, row: dict[str, Any], seed: int) -> list[Message]:
        if self.instance is None or not callable(getattr(self.instance, "reset", None)):
            return []
        columns = {k: v for k, v in row.items() if k != "prompt"}
        text = _awaited(self.instance.reset(**columns))
        return [] if text is None else [{"role": "user", "content": str(text)}]

    def step(self, model_text: str) -> StepResult:
        calls = parse_tool_calls(model_text, self.call_format, turn=self.turn)
        self.turn += 1
        if not calls:
            return StepResult([], done=True)
        started = time.monotonic()
        futures = [
            None
            if isinstance(call, ToolCallError)
            else self.runner.submit(call.name, call.arguments, toolset=self.tools)
            for call in calls
        ]
        messages, errors, timeouts = [], 0, 0
        for call, future in zip(calls, futures, strict=True):
            if future is None:  # a call the parser could not read: the model is told why
                errors += 1
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": f"error: {call.reason}"}
                )
                continue
            result = future.result()
            errors += int(result.error)
            timeouts += int(result.timed_out)
            messages.append(
                {
                    "role": "tool",
                    "name": call.name,
                    "tool_call_id": call.id,
                    "content": result.content,
                }
            )
        return StepResult(
            messages,
            tool_calls=len(calls),
            tool_errors=errors,
            tool_timeouts=timeouts,
            tool_seconds=time.monotonic() - started,
        )
