"""Loss masks of multi-turn trajectories: the environment's tokens are context, not trained.

A multi-turn completion holds the model's tokens of every turn and, between them, the tokens
of the environment's replies (:class:`~periodic_rl.rollout.types.Trajectory`). The policy did
not sample the latter, so they must not enter the policy gradient, and nothing computed per
token may count them: :func:`apply_loss_masks` zeroes them in the micro-batch's ``[N, T]``
token mask right after the forward, so the loss, its normalisers (``grpo``'s per-sequence
lengths; the iteration's token count of ``bnpo`` and ``dapo``, which
:meth:`~periodic_rl.iteration.IterationStats.loss_tokens` counts the same way), the entropy,
the KL, the clip fraction, the engine/trainer mismatch metrics and the truncated importance
weights all see the model's tokens only. ``dr_grpo``'s normaliser (sequences times
``max_new_tokens``) counts no tokens.

A single-turn group (no trajectories) is all model tokens: its rows are left as they are, so a
run without trajectories trains exactly as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from periodic_rl.rollout.types import RolloutGroup, Trajectory


def check_trajectories(trajectories: Sequence[Trajectory], completion_ids: list[list[int]]) -> None:
    """Refuse trajectories that do not line up with their completions: one per completion, each
    loss mask as long as its token ids and made of 0 and 1 only."""
    if len(trajectories) != len(completion_ids):
        raise ValueError(
            f"{len(trajectories)} trajectories for {len(completion_ids)} completions: a "
            "multi-turn group carries one trajectory per completion"
        )
    for i, (trajectory, ids) in enumerate(zip(trajectories, completion_ids, strict=True)):
        if len(trajectory.loss_mask) != len(ids):
            raise ValueError(
                f"completion {i}: a loss mask of {len(trajectory.loss_mask)} entries for "
                f"{len(ids)} tokens (one entry per response token: 1 model, 0 environment)"
            )
        if any(m not in (0, 1) for m in trajectory.loss_mask):
            raise ValueError(f"completion {i}: a loss mask holds only 0 and 1")


def environment_tokens(group: RolloutGroup) -> list[int]:
    """Per completion of ``group``, its tokens whose loss mask is 0 (0 for a single-turn
    group)."""
    masks = group.loss_masks()
    if masks is None:
        return [0] * len(group.completion_ids)
    return [len(m) - sum(m) for m in masks]


def loss_mask_tensor(groups: Sequence[RolloutGroup], like: torch.Tensor) -> torch.Tensor | None:
    """The groups' loss masks laid out like the ``[N, T]`` tensors of
    :func:`~periodic_rl.attention.completion_logprobs` (completion ``i`` of the micro-batch, in
    group order, in row ``i``, its tokens from column 0, padding on the right): 1 on model
    tokens and on every token of a single-turn group's rows, 0 on environment tokens and on
    the padding of trajectory rows. ``None`` when no group has trajectories."""
    if not any(group.trajectories for group in groups):
        return None
    rows, columns = like.shape
    out = torch.ones((rows, columns), dtype=like.dtype)
    row = 0
    for group in groups:
        masks = group.loss_masks()
        for i, ids in enumerate(group.completion_ids):
            if masks is not None:
                if len(masks[i]) != len(ids) or len(ids) > columns:
                    raise ValueError(
                        f"group {group.index} completion {i}: a loss mask of {len(masks[i])} "
                        f"entries for {len(ids)} tokens ({columns} columns)"
                    )
                out[row] = 0
                out[row, : len(ids)] = torch.tensor(masks[i], dtype=like.dtype)
            row += 1
    if row != rows:
        raise ValueError(f"{row} completions for {rows} rows of the token mask")
    return out.to(like.device)


def apply_loss_masks(mask: torch.Tensor, groups: Sequence[RolloutGroup]) -> torch.Tensor:
    """The micro-batch's ``[N, T]`` token mask with every environment token zeroed; the same
    tensor when no group has trajectories."""
    loss = loss_mask_tensor(groups, mask)
    if loss is None:
        return mask
    return mask * loss
