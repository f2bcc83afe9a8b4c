"""The one check of choice arguments: every argument typed as a ``Literal`` is checked against it.

The choices of :class:`~periodic_rl.RLModule`, the strategies and
:class:`~periodic_rl.rollout.options.RolloutOptions` are typed as ``Literal`` aliases defined
where each choice lives (``LossType`` in :mod:`periodic_rl.algorithms.losses`, ``LRScheduler``
in :mod:`periodic_rl.optim`, ...). From the command line jsonargparse refuses a value outside
the ``Literal`` while it parses; from Python nothing does, so the constructors call
:func:`check_choices`, which reads the same annotations (``typing.get_type_hints``) and refuses
a value outside them, naming the argument and its allowed values. An argument whose type also
admits other values (``Literal["vllm", "hf"] | str``: a registry or a class path) is an open
choice, left to its own check.
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, Union, get_args, get_origin


def choices_of(annotation: Any) -> tuple[Any, ...] | None:
    """The values a closed choice type allows (``None`` included when it is optional), or None
    when ``annotation`` is not a closed choice."""
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    if get_origin(annotation) in (Union, types.UnionType):
        allowed: list[Any] = []
        for member in get_args(annotation):
            if member is type(None):
                allowed.append(None)
            elif get_origin(member) is Literal:
                allowed.extend(get_args(member))
            else:
                return None  # an open choice: other values are allowed
        return tuple(allowed) if any(a is not None for a in allowed) else None
    return None


@functools.cache
def choice_arguments(target: Callable[..., Any] | type) -> dict[str, tuple[Any, ...]]:
    """The closed choice arguments of a function or a dataclass, with their allowed values."""
    hints = typing.get_type_hints(target)
    found = {name: choices_of(hint) for name, hint in hints.items() if name != "return"}
    return {name: allowed for name, allowed in found.items() if allowed is not None}


def check_choices(target: Callable[..., Any] | type, values: Mapping[str, Any]) -> None:
    """Refuse a value of a ``Literal``-typed argument of ``target`` that its type does not
    allow, naming the argument and the allowed values (arguments absent from ``values`` are
    not checked)."""
    for name, allowed in choice_arguments(target).items():
        if name in values and not _allowed(values[name], allowed):
            raise ValueError(choice_error(name, values[name], allowed))


def choice_error(name: str, value: Any, allowed: tuple[Any, ...]) -> str:
    """The message of a refused choice: the argument, its allowed values, the value given."""
    shown = ", ".join("null" if a is None else repr(a) for a in allowed)
    return f"{name} must be one of {shown}; got {value!r}"


def _allowed(value: Any, allowed: tuple[Any, ...]) -> bool:
    # ``True == 1``: a bool is not an int choice, nor an int a bool one.
    return any(value == a and type(value) is type(a) for a in allowed)
