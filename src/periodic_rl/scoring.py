"""Turning generated token ids into scored groups: decode, reward, advantages.

Where each reward call runs (the reward pool or the trainer's process) is
:mod:`periodic_rl.reward_pool`'s rule; what a failing call does is :mod:`periodic_rl.rewards`'.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from periodic_rl.algorithms.advantages import group_advantages
from periodic_rl.loss_mask import check_trajectories
from periodic_rl.models import TOKENIZER_LOCK
from periodic_rl.reward_pool import RewardPool
from periodic_rl.rewards import (
    ZERO_HINT,
    RewardError,
    RewardFunc,
    RewardTimeoutError,
    call_context,
    call_reward,
    check_reward_policy,
    inspect_rewards,
    reward_name,
    split_components,
)
from periodic_rl.rollout.types import GeneratedGroup, RolloutGroup, Trajectory
from periodic_rl.truncation import is_truncated, overlong_penalty

#: The reward component of the environment's own rewards in a multi-turn group.
ENVIRONMENT = "environment"
#: How a trajectory ends when a length limit cut it (``Trajectory.stop``): truncated.
TRUNCATING_STOPS = ("length", "token_budget")

#: Under ``reward_on_error: zero``, a reward whose every call failed for this many iterations in
#: a row stops the run (:meth:`Scorer.end_iteration`): it is broken, not flaky.
STOP_AFTER_FAILED_ITERATIONS = 3


@dataclass
class Scorer:
    """Scores generated groups with weighted reward functions.

    Group-scaled advantages (``scale_rewards`` "group" or "none") are computed per group as soon
    as it is scored, so groups can stream to the trainer; "batch" scaling needs every reward of
    the iteration and is applied by :meth:`scale_batch` once all groups are in.

    With ``max_new_tokens`` set, :meth:`score` flags each completion that hit it without one of
    ``eos_token_ids`` (``RolloutGroup.truncated``); with ``overlong_buffer`` set too, it adds
    DAPO's soft overlong penalty (:func:`~periodic_rl.truncation.overlong_penalty`) to each total
    reward before the advantages, as the component ``overlong``.

    **Multi-turn groups** (``GeneratedGroup.trajectories``, one
    :class:`~periodic_rl.rollout.types.Trajectory` per completion) are scored the same way,
    the completion text being the decoded response (the model's and the environment's tokens),
    with two additions: the reward functions get the column ``messages``, each trajectory's
    conversation after the prompt; and when any trajectory carries an environment reward
    (``env_reward``), it is the component ``environment`` (``None``: 0.0), *added* to the
    weighted sum of the reward functions, with weight 1, like ``overlong`` (a run whose only
    reward is the environment's has no reward functions: their sum is then 0). A trajectory is
    truncated when a length limit ended it (``stop`` is ``"length"`` or ``"token_budget"``),
    whatever its length; the overlong penalty counts its model tokens over all turns
    (``max_new_tokens`` is a trajectory's budget of model tokens), not the environment's. The
    trajectories travel on in the :class:`~periodic_rl.rollout.types.RolloutGroup`, whose loss
    masks keep the environment's tokens out of the loss (:mod:`periodic_rl.loss_mask`).

    With ``reward_workers > 0`` the rewards that can run in another process do so, in a
    :class:`~periodic_rl.reward_pool.RewardPool` started at the first call; :meth:`close` stops
    it.
    """

    tokenizer: Any
    reward_funcs: Sequence[RewardFunc]
    reward_weights: Sequence[float]
    scale_rewards: str = "group"
    baseline: str = "grpo"
    accuracy_func: RewardFunc | None = None
    max_new_tokens: int | None = None
    eos_token_ids: Sequence[int] = ()
    overlong_buffer: int | None = None
    overlong_penalty: float = 1.0
    reward_timeout_s: float | None = None
    reward_on_error: str = "raise"
    reward_workers: int = 0
    pool: RewardPool = field(init=False, repr=False)  # the pooled rewards' workers
    _failures: Counter = field(default_factory=Counter, init=False, repr=False)
    _calls: Counter = field(default_factory=Counter, init=False, repr=False)
    _streaks: Counter = field(default_factory=Counter, init=False, repr=False)
    _first_failure: dict = field(default_factory=dict, init=False, repr=False)
    _component_names: dict = field(default_factory=dict, init=False, repr=False)
    _warned: set = field(default_factory=set, init=False, repr=False)
    _lock: Any = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        check_reward_policy(self.reward_on_error, self.reward_timeout_s)
        if len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(self.reward_weights)} entries for "
                f"{len(self.reward_funcs)} reward functions; give one weight per function"
            )
        names = [reward_name(f) for f in self.reward_funcs]
        if len(set(names)) != len(names):
            raise ValueError(f"reward functions need distinct names to be logged apart: {names}")
        if self.overlong_buffer is not None and "overlong" in names:
            raise ValueError("a reward function named 'overlong' clashes with overlong_buffer's")
        if self.overlong_buffer is not None and self.max_new_tokens is None:
            raise ValueError("overlong_buffer needs max_new_tokens (the length it counts from)")
        if self.reward_on_error == "zero" and "failures" in names:
            raise ValueError("a reward function named 'failures' clashes with rewards/failures")
        extra = [self.accuracy_func] if self.accuracy_func is not None else []
        self.pool = RewardPool([*self.reward_funcs, *extra], self.reward_workers)

    def close(self) -> None:
        """Stop the reward pool's workers (the next call would start new ones)."""
        self.pool.close()

    def rewards(
        self,
        prompts: list[Any],
        completions: list[str],
        columns: dict[str, list[Any]],
        count: bool = True,
    ) -> tuple[list[float], dict[str, list[float]]]:
        """The weighted total per completion, and each function's own values.

        ``count``: count failing calls (under ``reward_on_error: zero``) for
        :meth:`take_failures`; the set-up probe and held-out evaluation do not."""
        components: dict[str, list[float]] = {}
        totals = [0.0] * len(completions)
        for func, weight in zip(self.reward_funcs, self.reward_weights, strict=True):
            name = reward_name(func)
            parts = self._call(func, name, prompts, completions, columns, count)
            for part, values in parts.items():
                if part in components:
                    raise RewardError(
                        f"reward '{name}' returned a component named '{part}', a name another "
                        "reward or component already has; give every reward and component its "
                        "own name (each is logged as rewards/<name>)"
                    )
                components[part] = values
                totals = [t + weight * v for t, v in zip(totals, values, strict=True)]
        if self.accuracy_func is not None and "accuracy" not in components:
            parts = self._call(self.accuracy_func, "accuracy", prompts, completions, columns, count)
            components.update(parts)
        return totals, components

    def failure_names(self) -> list[str]:
        """The names failures are counted under: each reward, and ``accuracy`` when separate."""
        names = [reward_name(f) for f in self.reward_funcs]
        if self.accuracy_func is not None and "accuracy" not in names:
            names.append("accuracy")
        return names

    def take_failures(self) -> dict[str, int]:
        """Failing reward calls per reward name since the last take (every name, 0 included),
        and reset: what ``rewards/<name>/failures`` logs each iteration."""
        return self._take()[0]

    def end_iteration(self) -> dict[str, int]:
        """:meth:`take_failures`, at the end of an iteration; raises :class:`RewardError` (and
        stops the pool) once a reward's every call failed for
        :data:`STOP_AFTER_FAILED_ITERATIONS` iterations in a row, naming it and its first
        failure. An iteration in which a reward was not called leaves its count as it was."""
        failures, calls = self._take()
        for name, called in calls.items():
            if called and failures[name] == called:
                self._streaks[name] += 1
            elif called:
                self._streaks.pop(name, None)
                self._first_failure.pop(name, None)
        for name, streak in self._streaks.items():
            if streak >= STOP_AFTER_FAILED_ITERATIONS:
                self.close()
                raise RewardError(
                    f"reward '{name}' failed on every call for {streak} iterations in a row: "
                    "under reward_on_error: zero its samples all scored 0, so the run learnt "
                    "nothing from it; the run stops. Fix the reward; its first failure in this "
                    f"run of failures:\n{self._first_failure.get(name, '')}"
                )
        return failures

    def _take(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            names = self.failure_names()
            taken = {name: self._failures[name] for name in names}
            calls = {name: self._calls[name] for name in names}
            self._failures.clear()
            self._calls.clear()
        return taken, calls

    def _call(
        self,
        func: RewardFunc,
        name: str,
        prompts: list[Any],
        completions: list[str],
        columns: dict[str, list[Any]],
        count: bool,
    ) -> dict[str, list[float]]:
        """One reward call, checked, with the timeout and the failure policy applied: its
        values by name (the reward's, or each named component's)."""
        n = len(completions)
        everyone = range(n)
        if count:
            with self._lock:
                self._calls[name] += 1
        zeros = {k: [0.0] * n for k in self._component_names.get(name, [name])}
        pooled = self.pool.runs(name)
        try:
            if pooled:
                values = self.pool.call(name, prompts, completions, columns, self.reward_timeout_s)
            else:
                values = call_reward(
                    func, name, prompts, completions, columns, self.reward_timeout_s
                )
            parts = split_components(name, values)
        except RewardTimeoutError as error:
            what = (
                "the call was stopped (its worker process killed)"
                if pooled
                else "the call is abandoned (it runs in the trainer's process, where its thread "
                "lingers until it returns; a module-level function given as reward_funcs runs "
                "in the reward pool, where a timeout stops it)"
            )
            message = (
                f"reward '{name}' did not return within reward_timeout_s={self.reward_timeout_s}"
                f" s on a call with {n} completions; {what}. Make the reward faster, raise "
                f"reward_timeout_s, or {ZERO_HINT}"
            )
            self._fail(name, message, prompts, completions, everyone, count, error, True)
            return zeros
        except Exception as error:  # noqa: BLE001 - the policy decides
            message = (
                f"reward '{name}' raised {type(error).__name__}: {error} (a call with {n} "
                "completions); fix the reward or have it return 0.0 for what it cannot score, "
                f"or {ZERO_HINT}"
            )
            self._fail(name, message, prompts, completions, everyone, count, error)
            return zeros
        if parts.keys() != {name}:
            self._component_names[name] = list(parts)
        out: dict[str, list[float]] = {}
        problem, shown = None, []
        for part, part_values in parts.items():
            check = inspect_rewards(part_values, n)
            out[part] = check.values  # under "zero": the bad entries (or all of them) are 0.0
            if not check.ok and problem is None:
                problem = check.problem(name, n, part if part != name else None)
                shown = everyone if check.whole is not None else sorted(check.entries)
        if problem is not None:
            self._fail(name, f"{problem}, or {ZERO_HINT}", prompts, completions, shown, count)
        return out

    def _fail(
        self,
        name: str,
        message: str,
        prompts: list[Any],
        completions: list[str],
        shown: Sequence[int],
        count: bool,
        cause: BaseException | None = None,
        timed_out: bool = False,
    ) -> list[float]:
        """Raise (``reward_on_error: raise``) or count the failing call and score it 0."""
        text = f"{message}\n{call_context(prompts, completions, shown)}"
        if self.reward_on_error == "raise":
            raise (RewardTimeoutError if timed_out else RewardError)(text) from cause
        with self._lock:
            if count:
                self._failures[name] += 1
                self._first_failure.setdefault(name, text)
            first = name not in self._warned
            self._warned.add(name)
        if first:  # once per reward: the counters say how often
            warnings.warn(
                f"{text}\nScored 0 (reward_on_error: zero); later failures of '{name}' are only "
                f"counted (rewards/{name}/failures)",
                RuntimeWarning,
                stacklevel=2,
            )
        return [0.0] * len(completions)

    def score(
        self,
        generated: GeneratedGroup,
        row: dict[str, Any],
        prompt_ids: list[int],
        held_out: bool = False,
    ) -> RolloutGroup:
        """A scored group from one job's output and the dataset row it came from.

        ``held_out``: a held-out evaluation group (its own length cap): the task rewards (and
        the environment's) only, no truncation flags and no overlong penalty."""
        n = len(generated.completion_ids)
        trajectories = list(generated.trajectories)
        if trajectories:
            check_trajectories(trajectories, generated.completion_ids)
        with TOKENIZER_LOCK:  # the rollout thread; the trainer's may be encoding
            completions = self.tokenizer.batch_decode(
                generated.completion_ids, skip_special_tokens=True
            )
        columns = {k: [v] * n for k, v in row.items() if k != "prompt"}
        if trajectories:
            if "messages" in columns:
                raise ValueError(
                    "the data row has a column 'messages', the name under which the rewards "
                    "get each trajectory's conversation: rename the column"
                )
            columns["messages"] = [t.messages for t in trajectories]
        totals, components = self.rewards(
            [row["prompt"]] * n, completions, columns, count=not held_out
        )
        if any(t.env_reward is not None for t in trajectories):
            totals = self._add_environment(trajectories, totals, components)
        truncated = []
        if not held_out and trajectories:
            truncated = [t.stop in TRUNCATING_STOPS for t in trajectories]
        elif self.max_new_tokens is not None and not held_out:
            cap, eos = self.max_new_tokens, set(self.eos_token_ids)
            truncated = [is_truncated(c, cap, eos) for c in generated.completion_ids]
        if self.overlong_buffer is not None and self.max_new_tokens is not None and not held_out:
            cap = self.max_new_tokens  # part of the reward, before the advantages
            lengths = [len(c) for c in generated.completion_ids]
            if trajectories:
                lengths = [sum(t.loss_mask) for t in trajectories]
            components["overlong"] = [
                overlong_penalty(length, cap, self.overlong_buffer, self.overlong_penalty)
                for length in lengths
            ]
            totals = [t + p for t, p in zip(totals, components["overlong"], strict=True)]
        group = RolloutGroup(
            index=generated.index,
            prompt=row["prompt"],
            prompt_ids=prompt_ids,
            completion_ids=generated.completion_ids,
            completions=completions,
            columns={k: v for k, v in row.items() if k != "prompt"},
            rewards=totals,
            reward_components=components,
            version=generated.version,
            fingerprint=generated.fingerprint,
            seed=generated.seed,
            worker=generated.worker,
            logprobs=generated.logprobs,
            truncated=truncated,
            trajectories=trajectories,
            agent_s=generated.agent_s,
            engine_idle_s=generated.engine_idle_s,
            token_versions=generated.token_versions,
            version_fingerprints=generated.version_fingerprints,
        )
        if self.scale_rewards != "batch":
            group.advantages = group_advantages(
                torch.tensor(totals, dtype=torch.float64), n, self.scale_rewards, self.baseline
            ).tolist()
        return group

    @staticmethod
    def _add_environment(
        trajectories: list[Trajectory], totals: list[float], components: dict[str, list[float]]
    ) -> list[float]:
        """Record the environment's rewards as the component ``environment`` and return the
        totals with them added."""
        if ENVIRONMENT in components:
            raise RewardError(
                f"a reward or component named '{ENVIRONMENT}' clashes with the environment's "
                f"own rewards (logged as rewards/{ENVIRONMENT}): rename it"
            )
        values = [0.0 if t.env_reward is None else float(t.env_reward) for t in trajectories]
        if not all(math.isfinite(v) for v in values):
            raise RewardError(f"the environment returned a non-finite reward: {values}")
        components[ENVIRONMENT] = values
        return [t + v for t, v in zip(totals, values, strict=True)]

    def scale_batch(self, groups: list[RolloutGroup]) -> None:
        """Fill in advantages with the whole iteration's reward std ("batch" scaling)."""
        ordered = sorted(groups, key=lambda g: g.index)
        sizes = {len(g.rewards) for g in ordered}
        if len(sizes) != 1:
            raise ValueError("batch-scaled advantages need groups of one size")
        rewards = torch.tensor([r for g in ordered for r in g.rewards], dtype=torch.float64)
        advantages = group_advantages(rewards, sizes.pop(), "batch", self.baseline).tolist()
        offset = 0
        for group in ordered:
            group.advantages = advantages[offset : offset + len(group.rewards)]
            offset += len(group.rewards)
