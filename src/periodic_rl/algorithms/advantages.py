"""Group-relative advantages (GRPO, and the RLOO leave-one-out baseline).

An advantage tells the policy gradient how much better one completion was than its siblings:
each prompt is sampled ``G`` times (a *group*) and every reward is compared with a baseline built
from the same group, so no value network is needed.

What TRL 1.16's ``GRPOTrainer`` does (``_generate_and_score_completions``), and what this module
reproduces exactly for ``baseline="grpo"``::

    mean = rewards.view(-1, G).mean(dim=1).repeat_interleave(G)
    advantages = rewards - mean
    if scale_rewards == "group": std = rewards.view(-1, G).std(dim=1).repeat_interleave(G)
    if scale_rewards == "batch": std = rewards.std()          # over the gathered batch
    if scale_rewards != "none":  advantages = advantages / (std + 1e-4)

``torch.std`` is the unbiased (Bessel-corrected) estimator. A group of one has no spread; like
recent TRL we treat its std as 0 rather than NaN (its advantage is 0 anyway). In TRL the "batch"
std is taken over the rewards gathered from *all* processes for the generation batch; here it is
over the tensor you pass, so pass the whole iteration's rewards (every group, every rank).

``baseline="rloo"`` is not a GRPOTrainer option in TRL: it is the REINFORCE leave-one-out baseline
of TRL's ``RLOOTrainer`` (Ahmadian et al. 2024), the mean of the *other* ``G - 1`` rewards of the
group. It equals ``G / (G - 1)`` times the group-mean advantage, and it is unbiased because a
completion's own reward never enters its baseline. The same ``scale_rewards`` options then apply,
dividing by the std of the *rewards* exactly as for GRPO.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

ScaleRewards = Literal["group", "batch", "none"]
AdvantageBaseline = Literal["grpo", "rloo"]
SCALE_REWARDS: tuple[str, ...] = get_args(ScaleRewards)
BASELINES: tuple[str, ...] = get_args(AdvantageBaseline)

# TRL's constant: keeps a group whose rewards are all equal (std 0) at advantage 0 instead of NaN.
STD_EPS = 1e-4


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; allowed values: {', '.join(allowed)}")


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    scale_rewards: str = "group",
    baseline: str = "grpo",
) -> torch.Tensor:
    """Advantages of rewards laid out group after group (``G = group_size`` samples per prompt).

    Args:
        rewards: 1-D tensor ``[num_groups * group_size]``; ``rewards[g*G:(g+1)*G]`` is group ``g``.
        group_size: ``G``, samples per prompt (``>= 1``; ``>= 2`` for ``rloo``).
        scale_rewards: ``"group"`` divides by the group's reward std + 1e-4, ``"batch"`` by the
            std of every reward in ``rewards`` + 1e-4, ``"none"`` does not divide (Dr. GRPO's
            advice: std scaling up-weights groups that are nearly solved or nearly hopeless).
        baseline: ``"grpo"`` subtracts the group mean, ``"rloo"`` the mean of the other rewards.

    Returns:
        A tensor shaped and typed like ``rewards``.

    Raises:
        ValueError: bad shape, a length not divisible by ``group_size``, or an unknown option.
    """
    _check_choice("scale_rewards", scale_rewards, SCALE_REWARDS)
    _check_choice("baseline", baseline, BASELINES)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards has {rewards.numel()} entries, not divisible by group_size={group_size}: "
            "rewards must be laid out as whole groups"
        )
    if baseline == "rloo" and group_size < 2:
        raise ValueError("the rloo baseline needs group_size >= 2 (there are no other rewards)")
    if not rewards.is_floating_point():
        rewards = rewards.float()

    grouped = rewards.view(-1, group_size)
    if baseline == "grpo":
        base = grouped.mean(dim=1, keepdim=True)
    else:
        base = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    advantages = (grouped - base).reshape(-1)

    if scale_rewards == "none":
        return advantages
    if scale_rewards == "group":
        if group_size > 1:
            std = grouped.std(dim=1).repeat_interleave(group_size)
        else:
            std = torch.zeros_like(rewards)
    else:
        std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
    return advantages / (std + STD_EPS)
