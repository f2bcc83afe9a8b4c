"""Turning generated token ids into scored groups: decode, reward, advantages."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from periodic_rl.algorithms.advantages import group_advantages
from periodic_rl.models import TOKENIZER_LOCK
from periodic_rl.rewards import RewardFunc, check_rewards, reward_name
from periodic_rl.rollout.types import GeneratedGroup, RolloutGroup
from periodic_rl.truncation import is_truncated, overlong_penalty


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

    def __post_init__(self) -> None:
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

    def rewards(
        self, prompts: list[Any], completions: list[str], columns: dict[str, list[Any]]
    ) -> tuple[list[float], dict[str, list[float]]]:
        """The weighted total per completion, and each function's own values."""
        components = {}
        for func in self.reward_funcs:
            name = reward_name(func)
            values = func(prompts, completions, **columns)
            components[name] = check_rewards(name, values, len(completions))
        totals = [
            sum(
                w * components[reward_name(f)][i]
                for f, w in zip(self.reward_funcs, self.reward_weights, strict=True)
            )
            for i in range(len(completions))
        ]
        if self.accuracy_func is not None and "accuracy" not in components:
            values = self.accuracy_func(prompts, completions, **columns)
            components["accuracy"] = check_rewards("accuracy", values, len(completions))
        return totals, components

    def score(
        self,
        generated: GeneratedGroup,
        row: dict[str, Any],
        prompt_ids: list[int],
        held_out: bool = False,
    ) -> RolloutGroup:
        """A scored group from one job's output and the dataset row it came from.

        ``held_out``: a held-out evaluation group (its own length cap): the task rewards only,
        no truncation flags and no overlong penalty."""
        n = len(generated.completion_ids)
        with TOKENIZER_LOCK:  # the rollout thread; the trainer's may be encoding
            completions = self.tokenizer.batch_decode(
                generated.completion_ids, skip_special_tokens=True
            )
        columns = {k: [v] * n for k, v in row.items() if k != "prompt"}
        totals, components = self.rewards([row["prompt"]] * n, completions, columns)
        truncated = []
        if self.max_new_tokens is not None and not held_out:
            cap, eos = self.max_new_tokens, set(self.eos_token_ids)
            truncated = [is_truncated(c, cap, eos) for c in generated.completion_ids]
            if self.overlong_buffer is not None:  # part of the reward, before the advantages
                components["overlong"] = [
                    overlong_penalty(len(c), cap, self.overlong_buffer, self.overlong_penalty)
                    for c in generated.completion_ids
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
        )
        if self.scale_rewards != "batch":
            group.advantages = group_advantages(
                torch.tensor(totals, dtype=torch.float64), n, self.scale_rewards, self.baseline
            ).tolist()
        return group

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
