"""RL algorithms in plain torch: group advantages, the k3 KL, streaming-exact GRPO-family losses."""

from periodic_rl.algorithms.advantages import BASELINES, SCALE_REWARDS, group_advantages
from periodic_rl.algorithms.kl import k3_kl
from periodic_rl.algorithms.losses import (
    LOSS_TYPES,
    check_loss_type,
    loss_denominator,
    loss_numerator,
    per_token_policy_loss,
    reference_loss,
)

__all__ = [
    "BASELINES",
    "LOSS_TYPES",
    "SCALE_REWARDS",
    "check_loss_type",
    "group_advantages",
    "k3_kl",
    "loss_denominator",
    "loss_numerator",
    "per_token_policy_loss",
    "reference_loss",
]
