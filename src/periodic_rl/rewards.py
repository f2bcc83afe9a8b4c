"""Reward functions: resolving them from config, calling them, and checking what they return.

A reward is a plain callable ``(prompts, completions, **columns) -> list[float]`` (TRL's
convention): extra dataset columns arrive as keyword lists aligned with ``completions``. It may
instead return named components, a dict ``{name: list[float]}``: each is logged on its own
(``rewards/<name>``, and a held-out column ``eval/<name>``), and their sum, times the reward's
weight, is its part of the total.

Rewards that fail (:class:`~periodic_rl.scoring.Scorer` applies this to every call):

========================  ==============================  =====================================
what went wrong           ``reward_on_error: raise``      ``reward_on_error: zero``
========================  ==============================  =====================================
the call raised           :class:`RewardError`, chained   the call's completions score 0
no return within          :class:`RewardTimeoutError`     the call's completions score 0
``reward_timeout_s``
not a list, wrong length  :class:`RewardError`            the call's completions score 0
an entry None, NaN, inf,  :class:`RewardError` naming     only those entries score 0
a string, not a number    the entry
========================  ==============================  =====================================

Every error names the reward, shows the (truncated) prompt and completion(s), and says what to
return instead. Under ``zero`` each failing *call* (one group's completions, whatever the number
of bad entries) counts once, logged as ``rewards/failures`` and ``rewards/<name>/failures``, and
the first failure of each reward is also a warning with the same text. A reward whose every
call failed for :data:`~periodic_rl.scoring.STOP_AFTER_FAILED_ITERATIONS` iterations in a row
stops the run with a :class:`RewardError` naming it and its first failure: the run was learning
nothing from it.

The timeout: a reward that runs in the reward pool (:mod:`periodic_rl.reward_pool`, the
default for module-level functions) is stopped at ``reward_timeout_s``, its process killed. One
that runs in the trainer's process (the ``reward()`` override, a lambda, a
:class:`RewardModel`; or every reward with ``reward_workers: 0``) runs in a daemon thread that
is waited for ``reward_timeout_s``; Python cannot stop a thread, so a call that never returns is
abandoned and its thread lingers until the process exits.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

from periodic_rl.dotted import import_dotted

RewardFunc = Callable[..., Sequence[float] | Mapping[str, Sequence[float]]]

#: ``reward_on_error``: stop the run at the first failing reward call, or score it 0 and go on.
RewardOnError = Literal["raise", "zero"]
REWARD_ON_ERROR: tuple[str, ...] = get_args(RewardOnError)
#: what a ``raise`` error says to switch to the other policy.
ZERO_HINT = "set reward_on_error: zero to score such samples 0 and go on"
SNIPPET_CHARS = 200  # prompt and completion text shown in an error


class RewardError(ValueError):
    """A reward call failed (it raised, or returned something that is not one finite float per
    completion): the message names the reward, the prompt and completion(s), and the fix."""


class RewardTimeoutError(RewardError, TimeoutError):
    """A reward call did not return within ``reward_timeout_s``."""


def check_reward_policy(on_error: Any, timeout_s: Any) -> None:
    """Refuse a bad ``reward_on_error`` or ``reward_timeout_s`` (at construction)."""
    if on_error not in REWARD_ON_ERROR:
        raise ValueError(
            f"reward_on_error must be 'raise' (stop at the first failing reward call) or "
            f"'zero' (score its samples 0, count it and go on), got {on_error!r}"
        )
    if timeout_s is not None and (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, int | float)
        or not 0 < timeout_s < float("inf")
    ):
        raise ValueError(
            f"reward_timeout_s must be a finite number of seconds > 0 (the longest one reward "
            f"call may take, e.g. 300), or null for no limit; got {timeout_s!r}"
        )


def reward_name(func: Any) -> str:
    """The name a reward component is logged under."""
    return getattr(func, "__name__", None) or type(func).__name__


def resolve_reward(spec: str | RewardFunc) -> RewardFunc:
    """A callable from itself or a dotted path: ``pkg.module:func`` or ``pkg.module.func``."""
    if callable(spec):
        return spec
    try:
        func = import_dotted(spec)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(
            f"reward_funcs: cannot import {spec!r} ({error}); give 'package.module:function'"
        ) from error
    if not callable(func):
        raise ValueError(f"reward_funcs: {spec!r} is not callable")
    return func


@dataclass
class RewardCheck:
    """What one reward call returned, checked: ``values`` (0.0 in place of every bad entry, and
    all 0.0 when the output as a whole is unusable), ``whole`` (why it is: not a list of
    numbers, or the wrong length) and ``entries`` (index -> what was returned there)."""

    values: list[float]
    whole: str | None = None
    entries: dict[int, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.whole is None and not self.entries

    def problem(self, name: str, expected: int, component: str | None = None) -> str:
        """The first thing wrong, as a sentence that names the reward (and the component of
        a dict it returned) and what to return."""
        who = f"reward '{name}'" + (f" component '{component}'" if component else "")
        if self.whole is not None:
            return f"{who} {self.whole}; return a list of one float per completion"
        where = sorted(self.entries)
        first = where[0]
        more = f" (and {len(where) - 1} more: completions {where[1:6]})" if len(where) > 1 else ""
        return (
            f"{who} returned {self.entries[first]} for completion {first} of "
            f"{expected}{more}; return a finite float for every completion (0.0 for one it "
            "cannot score)"
        )


def inspect_rewards(values: Any, expected: int) -> RewardCheck:
    """Check a reward's output: a sequence of ``expected`` finite numbers (a bool, an int, a
    numpy or 0-d tensor number are numbers; None, NaN, inf and strings are not)."""
    if isinstance(values, str | bytes | dict) or not hasattr(values, "__iter__"):
        return RewardCheck([0.0] * expected, f"returned {_describe(values)}, not a list")
    try:
        values = list(values)
    except Exception as error:  # noqa: BLE001 - an iterable that fails is bad output too
        return RewardCheck([0.0] * expected, f"returned an iterable that failed ({error!r})")
    if len(values) != expected:
        return RewardCheck(
            [0.0] * expected, f"returned {len(values)} values for {expected} completions"
        )
    out, entries = [], {}
    for i, value in enumerate(values):
        number = _as_number(value)
        if number is None or not math.isfinite(number):
            entries[i] = _describe(value)
            number = 0.0
        out.append(number)
    return RewardCheck(out, None, entries)


def split_components(name: str, values: Any) -> dict[str, Any]:
    """What a reward returned, by the name each part is logged under: a dict's own items (named
    components), else ``{name: values}``. A dict with no items, or a key that is not a
    non-empty string, is a :class:`RewardError`."""
    if not isinstance(values, Mapping):
        return {name: values}
    bad = [k for k in values if not isinstance(k, str) or not k]
    if not values or bad:
        what = "an empty dict" if not values else f"a dict with the key {bad[0]!r}"
        raise RewardError(
            f"reward '{name}' returned {what}; named components are a dict of "
            "{'name': [one float per completion], ...} with non-empty string names"
        )
    return dict(values)


def check_rewards(name: str, values: Any, expected: int) -> list[float]:
    """``values`` as floats, or a :class:`RewardError` (a ValueError) that names the reward,
    what is wrong and what to return instead."""
    check = inspect_rewards(values, expected)
    if not check.ok:
        raise RewardError(check.problem(name, expected))
    return check.values


def _as_number(value: Any) -> float | None:
    if value is None or isinstance(value, str | bytes):
        return None
    try:
        return float(value)
    except Exception:  # noqa: BLE001 - TypeError, ValueError, a tensor's RuntimeError
        return None


def _describe(value: Any) -> str:
    """A returned value, for a message: ``None``, ``NaN``, ``inf``, ``a str ('abc')``."""
    if value is None:
        return "None"
    number = None if isinstance(value, str | bytes) else _safe_float(value)
    if number is not None and math.isnan(number):
        return "NaN"
    if number is not None and math.isinf(number):
        return "inf" if number > 0 else "-inf"
    return f"a {type(value).__name__} ({snippet(repr(value), 60)})"


def _safe_float(value: Any) -> float | None:
    try:
        return float(value)
    except Exception:  # noqa: BLE001
        return None


def snippet(text: Any, limit: int = SNIPPET_CHARS) -> str:
    """``text`` (a prompt may be chat messages) on one line, cut to ``limit`` characters."""
    text = as_text(text) if not isinstance(text, str) else text
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def call_context(prompts: list[Any], completions: list[str], indices: Sequence[int]) -> str:
    """The prompt(s) and the completions at ``indices`` (at most 3), truncated, one per line."""
    shown = list(indices)[:3]
    lines = []
    distinct = {snippet(prompts[i]) for i in shown}
    if len(distinct) == 1:
        lines.append(f"  prompt: {snippet(prompts[shown[0]])!r}")
    for i in shown:
        if len(distinct) > 1:
            lines.append(f"  prompt {i}: {snippet(prompts[i])!r}")
        lines.append(f"  completion {i}: {snippet(completions[i])!r}")
    if len(indices) > len(shown):
        lines.append(f"  ... ({len(indices) - len(shown)} more)")
    return "\n".join(lines)


def call_reward(
    func: RewardFunc,
    name: str,
    prompts: list[Any],
    completions: list[str],
    columns: dict[str, list[Any]],
    timeout_s: float | None,
) -> Any:
    """``func(prompts, completions, **columns)``: in this thread without a timeout, else in a
    daemon thread waited for ``timeout_s`` seconds (:class:`RewardTimeoutError` after that; the
    thread is abandoned, and lingers until the call returns or the process exits)."""
    if timeout_s is None:
        return func(prompts, completions, **columns)
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            outcome["value"] = func(prompts, completions, **columns)
        except BaseException as error:  # noqa: BLE001 - handed to the caller below
            outcome["error"] = error
        finally:
            done.set()

    threading.Thread(target=run, name=f"periodic-rl-reward-{name}", daemon=True).start()
    if not done.wait(timeout_s):
        raise RewardTimeoutError(f"reward '{name}' did not return within {timeout_s} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class RewardModel:
    """A frozen sequence-classification model used as a reward: the score of prompt+completion.

    Loaded once from a local path (or hub id), frozen and in eval mode; runs without gradients on
    ``device``: its own device (``"cpu"`` while the policy trains on ``"cuda:0"``, or
    ``"cuda:1"``), or, when None, the training device, where the trainer moves it at set-up
    (``requested_device`` keeps the choice). Built outside a trainer without one, it stays on
    the CPU. Inputs follow the model wherever it is moved. It runs in the trainer's process (a
    model on a device is not sent to the reward pool: ``reward_in_process``).

    From YAML, on a device of its own::

        reward_funcs:
          - class_path: periodic_rl.rewards.RewardModel
            init_args: {path: /models/my-rm, device: cpu}
    """

    reward_in_process = True

    def __init__(
        self,
        path: str,
        dtype: torch.dtype = torch.float32,
        batch_size: int = 8,
        device: str | torch.device | None = None,
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.__name__ = "reward_model"
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.eval().requires_grad_(False)
        self.batch_size = batch_size
        self.requested_device = None if device is None else torch.device(device)
        if device is not None:
            self.to(device)

    @property
    def device(self) -> torch.device:
        """Where the model (and so each scoring batch) is."""
        return next(self.model.parameters()).device

    def to(self, device: str | torch.device) -> RewardModel:
        """Move the model to ``device`` (e.g. the trainer's); it stays frozen and in eval mode."""
        self.model.to(torch.device(device))
        return self

    @torch.no_grad()
    def __call__(self, prompts: list[Any], completions: list[str], **columns: Any) -> list[float]:
        texts = [as_text(p) + c for p, c in zip(prompts, completions, strict=True)]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                texts[start : start + self.batch_size], return_tensors="pt", padding=True
            ).to(self.device)
            logits = self.model(**batch).logits
            scores.extend(logits[:, 0].float().tolist())
        return scores


def as_text(prompt: Any) -> str:
    """A prompt as text: itself, or its chat messages' contents, one per line."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "")) for m in prompt)
