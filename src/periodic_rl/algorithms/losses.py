"""The clipped policy surrogate and TRL 1.16's four loss aggregations, computed streaming-exact.

An iteration's completions reach the trainer in micro-batches, in completion order, while other
groups are still being generated, so the loss normaliser of the whole iteration (its number of
sequences or tokens) is unknown while gradients are already accumulating. The way out: every
micro-batch backpropagates an *unnormalised sum*, :func:`loss_numerator`; once the iteration's
last micro-batch is in, the accumulated gradients are divided once by :func:`loss_denominator`.
Gradient accumulation is a sum, so the result equals the one-shot loss of :func:`reference_loss`
on the whole iteration, for any split into micro-batches and any order.

The loss types (TRL 1.16 ``GRPOConfig.loss_type``), with ``l`` the masked per-token loss::

    grpo     mean over sequences of (sequence token sum / sequence length)   DeepSeekMath GRPO
    bnpo     token sum / tokens in the batch
    dr_grpo  token sum / (sequences * max_completion_length)                 Dr. GRPO
    dapo     token sum / tokens in the whole generation batch, all ranks     DAPO

How this differs from TRL: TRL normalises ``grpo``, ``bnpo`` and ``dr_grpo`` per micro-batch
(``per_device_train_batch_size``) and divides by the gradient-accumulation steps, so with
micro-batches of unequal size or token count its result depends on how the batch was split (for
``bnpo`` this is the norm: token counts differ between micro-batches). Here the whole iteration
is "the batch": each value equals TRL's when the iteration is a single micro-batch (for ``grpo``
and ``dr_grpo`` also whenever micro-batches hold equally many sequences), and it does not change
with the split. ``dapo`` is already iteration-level in TRL (``num_items_in_batch``), and equal.

Truncated importance sampling (TIS), ``RLModule(tis_cap=C)``: the rollout engine samples from its
own numerics (vLLM's kernels, another dtype), so a token's behaviour log-prob ``logp_b`` (what the
engine reported while sampling it) differs slightly from the trainer's ``logp_old`` for the same
weights. Each token's policy-gradient term is multiplied by the detached weight::

    w = min(exp(logp_old - logp_b), C)          per token, C = tis_cap
    l = -w * min(ratio * A, clamp(ratio, 1 - epsilon, 1 + epsilon_high) * A) + beta * kl

(:func:`truncated_is_weights`, ``is_weights`` of :func:`per_token_policy_loss`); the KL term and
the loss normalisers are unchanged. This is TRL's ``vllm_importance_sampling_correction`` with
``vllm_importance_sampling_cap`` (``GRPOTrainer``: ``importance_sampling_ratio = clamp(exp(
old_per_token_logps - sampling_per_token_logps), max=cap)``, then ``per_token_loss =
per_token_loss * importance_sampling_ratio`` before ``+ beta * per_token_kl``; TRL's
``"token_truncate"`` mode where it has modes) and verl's ``actor.tis_imp_ratio_cap``
(``compute_policy_loss_vanilla``: ``pg_losses = pg_losses * clamp(exp(old_log_prob -
rollout_log_probs), max=cap)``), both after Yao et al., "Your Efficient RL Framework Secretly
Brings You Off-Policy RL Training" (2025). Here ``logp_old`` is the trainer's own detached
log-prob (one optimizer step per iteration), so the weight corrects only the engine/trainer
mismatch (and ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty``, which the engine
applies when sampling and the trainer does not).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from periodic_rl.algorithms.kl import k3_kl

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
LOSS_TYPES: tuple[str, ...] = get_args(LossType)


def check_loss_type(name: str) -> str:
    """Return ``name`` if it is one of :data:`LOSS_TYPES`, else raise ``ValueError``."""
    if name not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {name!r}; allowed values: {', '.join(LOSS_TYPES)}")
    return name


def truncated_is_weights(
    old_logps: torch.Tensor, behaviour_logps: torch.Tensor, mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """TIS weights ``min(exp(old_logps - behaviour_logps), cap)`` per token, detached, 0 where
    ``mask == 0`` (see the module docstring for the formula and where TRL and verl use it).

    Args:
        old_logps: ``[B, T]`` trainer log-probs of the sampled tokens (of the policy that the
            ratio is taken against).
        behaviour_logps: ``[B, T]`` log-probs the rollout engine sampled the tokens with.
        mask: ``[B, T]``, 1 (or True) on completion tokens.
        cap: the truncation ``C > 0``.
    """
    if not cap > 0:
        raise ValueError(f"the TIS cap must be > 0, got {cap}")
    if old_logps.shape != behaviour_logps.shape or old_logps.shape != mask.shape:
        raise ValueError(
            f"old_logps {tuple(old_logps.shape)}, behaviour_logps "
            f"{tuple(behaviour_logps.shape)} and mask {tuple(mask.shape)} differ in shape"
        )
    valid = mask.bool()
    zeros = torch.zeros_like(old_logps)
    delta = torch.where(valid, old_logps.detach() - behaviour_logps.detach(), zeros)
    return torch.where(valid, torch.exp(delta).clamp(max=cap), zeros)


def _check_shapes(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logps: torch.Tensor | None,
    is_weights: torch.Tensor | None = None,
) -> None:
    if logps.dim() != 2:
        raise ValueError(f"logps must be [B, T], got shape {tuple(logps.shape)}")
    named = {"old_logps": old_logps, "mask": mask}
    if ref_logps is not None:
        named["ref_logps"] = ref_logps
    if is_weights is not None:
        named["is_weights"] = is_weights
    for name, tensor in named.items():
        if tensor.shape != logps.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, logps has {tuple(logps.shape)}"
            )
    if advantages.shape != logps.shape[:1]:
        raise ValueError(
            f"advantages must be [B] = [{logps.shape[0]}], got shape {tuple(advantages.shape)}"
        )


def per_token_policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon: float,
    epsilon_high: float,
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-style clipped surrogate per token, as in TRL's GRPOTrainer, plus the k3 KL penalty.

    ``ratio = exp(logps - old_logps)``; ``loss = -min(ratio * A, clamp(ratio, 1 - epsilon,
    1 + epsilon_high) * A)``, plus ``beta * k3_kl(logps, ref_logps)`` when ``beta > 0``. With
    ``epsilon_high > epsilon`` this is DAPO's "clip-higher". With one optimizer step per
    iteration, ``old_logps`` is ``logps.detach()``: the ratio is 1 but its gradient is not zero.

    Args:
        logps: ``[B, T]`` policy log-probs of the completion tokens (differentiable).
        old_logps: ``[B, T]`` log-probs of the policy that sampled them (treated as constants).
        advantages: ``[B]``, one per sequence, broadcast over its tokens.
        mask: ``[B, T]``, 1 (or True) on completion tokens, 0 on padding.
        epsilon, epsilon_high: the clip range ``[1 - epsilon, 1 + epsilon_high]``.
        beta: KL weight; ``ref_logps`` is required when it is positive.
        ref_logps: ``[B, T]`` reference log-probs; when given, ``kl_sum`` is reported even if
            ``beta == 0``.
        is_weights: ``[B, T]`` importance weights (treated as constants) multiplying each
            token's clipped surrogate, not the KL term: :func:`truncated_is_weights` for TIS.
            None leaves the loss exactly as without it.

    Returns:
        ``(per_token_loss, stats)``. ``per_token_loss`` is ``[B, T]`` and exactly 0 where
        ``mask == 0``. ``stats`` holds detached scalar *sums over masked tokens*, so that summing
        them over micro-batches gives the iteration's totals (divide by ``tokens`` for a mean):
        ``tokens``; ``clipped_low_tokens`` (ratio < 1 - epsilon and A < 0, where the clip stops
        the ratio from falling further), ``clipped_high_tokens`` (ratio > 1 + epsilon_high and
        A > 0), ``clipped_tokens`` (their sum; TRL's ``clip_ratio/low_mean``, ``high_mean`` and
        ``region_mean`` are these over ``tokens``); ``kl_sum`` when a reference is present.
    """
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and ref_logps is None:
        raise ValueError("beta > 0 needs ref_logps (the reference policy's log-probs)")
    _check_shapes(logps, old_logps, advantages, mask, ref_logps, is_weights)
    valid = mask.bool()
    adv = advantages.to(logps.dtype).unsqueeze(1)
    # Padding may hold any value (even -inf); neutralise it before exp so that neither the
    # forward sums nor the backward (0 * inf = nan) can be poisoned by it.
    zeros = torch.zeros_like(logps)
    old_logps = torch.where(valid, old_logps.detach(), zeros)
    if ref_logps is not None:
        ref_logps = torch.where(valid, ref_logps.detach(), zeros)
    logps = torch.where(valid, logps, zeros)

    ratio = torch.exp(logps - old_logps)
    clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    per_token = -torch.min(ratio * adv, clipped_ratio * adv)
    if is_weights is not None:  # TIS: before the KL term, as TRL and verl
        per_token = per_token * torch.where(valid, is_weights.detach(), zeros)
    kl = None
    if ref_logps is not None:
        kl = k3_kl(logps, ref_logps)
        if beta > 0:
            per_token = per_token + beta * kl
    per_token = torch.where(valid, per_token, zeros)

    with torch.no_grad():
        low = (ratio < 1 - epsilon) & (adv < 0) & valid
        high = (ratio > 1 + epsilon_high) & (adv > 0) & valid
        stats = {
            "tokens": valid.sum().to(logps.dtype),
            "clipped_low_tokens": low.sum().to(logps.dtype),
            "clipped_high_tokens": high.sum().to(logps.dtype),
        }
        stats["clipped_tokens"] = stats["clipped_low_tokens"] + stats["clipped_high_tokens"]
        if kl is not None:
            stats["kl_sum"] = torch.where(valid, kl, zeros).sum()
    return per_token, stats


def loss_numerator(
    per_token_loss: torch.Tensor, mask: torch.Tensor, loss_type: str
) -> torch.Tensor:
    """A micro-batch's share of the iteration loss, before the iteration-level normalisation.

    ``grpo``: the sum over sequences of (sequence token sum / its token count, at least 1);
    ``bnpo``, ``dr_grpo``, ``dapo``: the sum of the masked per-token losses. Backpropagate this;
    the gradients of all micro-batches add up, and :func:`loss_denominator` divides them once.
    """
    check_loss_type(loss_type)
    if per_token_loss.shape != mask.shape:
        raise ValueError(
            f"per_token_loss {tuple(per_token_loss.shape)} and mask {tuple(mask.shape)} differ"
        )
    valid = mask.bool()
    masked = torch.where(valid, per_token_loss, torch.zeros_like(per_token_loss))
    if loss_type == "grpo":
        lengths = valid.sum(dim=1).clamp(min=1).to(per_token_loss.dtype)
        return (masked.sum(dim=1) / lengths).sum()
    return masked.sum()


def loss_denominator(
    loss_type: str,
    num_sequences: int,
    num_tokens: int,
    max_new_tokens: int,
    world_size: int = 1,
) -> float:
    """The iteration-level normaliser that turns the summed numerators into the loss.

    Args:
        loss_type: one of :data:`LOSS_TYPES`.
        num_sequences: completions of the whole iteration, over *all* processes (the caller
            all-reduces, sums, the per-process counts).
        num_tokens: completion tokens (mask sum) of the whole iteration, over all processes.
            Clamped to at least 1, as TRL does.
        max_new_tokens: the completion length cap (TRL's ``max_completion_length``), ``dr_grpo``.
        world_size: the number of processes whose gradients are *averaged* afterwards (DDP's
            all-reduce mean, FSDP's reduce-scatter mean). The result is divided by it, so that
            after the averaging the gradient is the one of the whole iteration's loss. Leave it
            1 on one process, or when the gradient reduction sums.

    Returns:
        ``grpo``: ``num_sequences``; ``bnpo`` and ``dapo``: ``num_tokens``; ``dr_grpo``:
        ``num_sequences * max_new_tokens``; each divided by ``world_size``.

    Every type is the loss of the whole iteration as one batch, whatever the number of
    processes (for ``dapo`` this is TRL's ``num_items_in_batch / num_processes``; for ``bnpo``
    TRL normalises each process by its own tokens, which is the one-batch loss on one process
    only: here N ranks equal one rank).
    """
    check_loss_type(loss_type)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if loss_type in ("grpo", "dr_grpo") and num_sequences < 1:
        raise ValueError(f"{loss_type} needs num_sequences >= 1, got {num_sequences}")
    if loss_type == "grpo":
        return num_sequences / world_size
    if loss_type == "dr_grpo":
        if max_new_tokens < 1:
            raise ValueError(f"dr_grpo needs max_new_tokens >= 1, got {max_new_tokens}")
        return num_sequences * max_new_tokens / world_size
    return max(num_tokens, 1) / world_size


def reference_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    epsilon: float,
    epsilon_high: float,
    max_new_tokens: int,
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
) -> torch.Tensor:
    """The loss of a whole iteration in one shot, written the way TRL writes it.

    This is what the streamed numerators and denominator must reproduce; it serves the tests and
    documents the meaning of each ``loss_type`` (one process, the iteration as one micro-batch).
    """
    check_loss_type(loss_type)
    per_token, _ = per_token_policy_loss(
        logps, old_logps, advantages, mask, epsilon, epsilon_high, beta=beta, ref_logps=ref_logps
    )
    m = mask.to(per_token.dtype)
    if loss_type == "grpo":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "dr_grpo":
        return (per_token * m).sum() / (per_token.size(0) * max_new_tokens)
    # bnpo and dapo coincide on a single process when the iteration is one batch.
    return (per_token * m).sum() / m.sum().clamp(min=1.0)
