"""Per-token KL penalty to the reference policy."""

from __future__ import annotations

import torch


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Schulman's "k3" estimator of KL(policy || reference), per token.

    ``exp(ref - logp) - (ref - logp) - 1``, evaluated at tokens sampled from the policy. It is an
    unbiased estimate of the KL, never negative (``e^x >= 1 + x``), and has lower variance than the
    plain ``logp - ref``. It is the estimator of DeepSeekMath's GRPO and of TRL's GRPOTrainer.

    Args:
        logps: policy log-probs of the sampled tokens, any shape (gradient flows through these).
        ref_logps: reference log-probs of the same tokens, same shape (normally detached).

    Returns:
        The per-token estimate, shaped like ``logps``.
    """
    if logps.shape != ref_logps.shape:
        raise ValueError(
            f"logps {tuple(logps.shape)} and ref_logps {tuple(ref_logps.shape)} differ in shape"
        )
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1
