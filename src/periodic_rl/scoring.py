"""Turning generated token ids into scored groups: decode, reward, advantages."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from periodic_rl.algorithms.advantages import group_advantages
from periodic_rl.rewards import RewardFunc, check_rewards, reward_name
from periodic_rl.rollout.types import GeneratedGroup, RolloutGroup


@dataclass
class Scorer:
    """Scores generated groups with weighted reward functions.

    Group-scaled advantages (``scale_rewards`` "group" or "none") are computed per group as soon
    as it is scored, so groups can stream to the trainer; "batch" scaling needs every reward of
    the iteration and is applied by :meth:`scale_batch` once all groups are in.
    """

    tokenizer: Any
    reward_funcs: Sequence[RewardFunc]
    reward_weights: Sequence[float]
    scale_rewards: str = "group"
    baseline: str = "grpo"
    accuracy_func: RewardFunc | None = None

    def __post_init__(self) -> None:
        if len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(self.reward_weights)} entries for "
                f"{len(self.reward_funcs)} reward functions; give one weight per function"
            )
        names = [reward_name(f) for f in self.reward_funcs]
        if len(set(names)) != len(names):
            raise ValueError(f"reward functions need distinct names to be logged apart: {names}")

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
        self, generated: GeneratedGroup, row: dict[str, Any], prompt_ids: list[int]
    ) -> RolloutGroup:
        """A scored group from one job's output and the dataset row it came from."""
        n = len(generated.completion_ids)
        completions = self.tokenizer.batch_decode(
            generated.completion_ids, skip_special_tokens=True
        )
        columns = {k: [v] * n for k, v in row.items() if k != "prompt"}
        totals, components = self.rewards([row["prompt"]] * n, completions, columns)
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
