"""Engine/trainer mismatch: the rollout engine's behaviour log-probs against the trainer's.

Even with the same weights (``k = 0`` staleness), the engine that sampled a token (vLLM's kernels,
another dtype, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``) and the trainer's forward
give it slightly different log-probs. Every
iteration logs, over the completion tokens whose engine reported log-probs:

- ``mismatch/abs_logp``: mean ``|logp_trainer - logp_behaviour|``;
- ``mismatch/kl``: mean of the k3 estimate of ``KL(behaviour || trainer)`` at the sampled tokens,
  ``exp(d) - d - 1`` with ``d = logp_trainer - logp_behaviour`` (:func:`~periodic_rl.algorithms.
  kl.k3_kl` with the behaviour policy in the sampling role: unbiased, never negative);
- ``mismatch/ratio_mean``, ``mismatch/ratio_max``, ``mismatch/ratio_min``: the importance
  ratio ``w = exp(logp_trainer - logp_behaviour)`` of the sampled tokens (1 everywhere when the
  engine samples exactly the trainer's distribution);
- ``mismatch/ess``: the normalised effective sample size of those ratios, ``(sum w)^2 / (n sum
  w^2)`` over the ``n`` tokens, in ``(0, 1]``: 1 when every ratio is equal, small when a few
  tokens carry most of the weight;
- ``mismatch/missing_tokens``: loss tokens whose behaviour log-prob is missing (a group the
  engine returned without log-probs, or a row shorter than its completion); they are left out
  of every other ``mismatch/*`` metric;
- with ``tis_cap``: ``mismatch/tis_weight`` (mean truncated importance weight) and
  ``mismatch/tis_capped_frac`` (fraction of tokens whose weight hit the cap).

They are summed (and the extremes kept) over the iteration's micro-batches on each rank; each
rank logs its own.

The trainer's log-probs are those of ``softmax(logits / temperature)`` (no ``top_p``, ``top_k``,
``min_p`` or ``repetition_penalty``); the engines report the distribution they drew from (all of
them applied), so any of these knobs away from its "off" value shows up here as mismatch too.
:func:`~periodic_rl.algorithms.losses.truncated_is_weights` corrects for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from periodic_rl.algorithms.kl import k3_kl

if TYPE_CHECKING:
    from periodic_rl.rollout.types import RolloutGroup


def behaviour_logps(
    groups: Sequence[RolloutGroup], like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The groups' behaviour log-probs laid out like the trainer's ``[N, T]`` log-probs of
    :func:`~periodic_rl.attention.completion_logprobs` (completion ``i`` of the micro-batch, in
    group order, in row ``i``; its tokens from column 0), and a ``[N, T]`` bool tensor that is
    True where a behaviour log-prob is present. ``None`` when no group carries any."""
    rows = [
        group.logprobs[i] if group.logprobs else None
        for group in groups
        for i in range(len(group.completion_ids))
    ]
    if all(row is None for row in rows):
        return None
    if len(rows) != like.shape[0]:
        raise ValueError(f"{len(rows)} completions for {like.shape[0]} rows of log-probs")
    values = torch.zeros(like.shape, dtype=torch.float32)
    present = torch.zeros(like.shape, dtype=torch.bool)
    for i, row in enumerate(rows):
        if row:
            if len(row) > like.shape[1]:
                raise ValueError(
                    f"completion {i}: {len(row)} log-probs for {like.shape[1]} columns"
                )
            values[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
            present[i, : len(row)] = True
    return values.to(like.device, like.dtype), present.to(like.device)


def missing_behaviour(groups: Sequence[RolloutGroup]) -> list[int]:
    """Indices of the groups that have completion tokens but no behaviour log-probs."""
    return [g.index for g in groups if not g.logprobs and any(g.completion_ids)]


def mismatch_sums(
    logps: torch.Tensor,
    behaviour: torch.Tensor,
    present: torch.Tensor,
    tis_weights: torch.Tensor | None = None,
    tis_cap: float | None = None,
    loss_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Detached sums over the tokens where ``present`` is True (sum them over micro-batches,
    divide by ``mismatch_tokens``): ``mismatch_tokens``, ``mismatch_abs_sum`` (of
    ``|logps - behaviour|``), ``mismatch_kl_sum`` (k3 of ``KL(behaviour || trainer)``),
    ``mismatch_ratio_sum`` and ``mismatch_ratio_sq_sum`` (of the importance ratio and its
    square); the extremes ``mismatch_ratio_max`` and ``mismatch_ratio_min`` (combine those with
    max and min, not a sum); with ``loss_mask``: ``mismatch_missing_tokens`` (in the mask, not
    in ``present``); with ``tis_weights``: ``tis_weight_sum`` and ``tis_capped_tokens`` (weight
    ``>= tis_cap``)."""
    with torch.no_grad():
        on = present.bool()
        # float64: the k3 term of a 1e-5 difference is 5e-11, below float32's rounding of exp.
        zeros = torch.zeros(behaviour.shape, dtype=torch.float64, device=behaviour.device)
        trainer = torch.where(on, logps.detach().double(), zeros)
        sampled = torch.where(on, behaviour.double(), zeros)
        ratios = torch.where(on, torch.exp(trainer - sampled), zeros)
        sums = {
            "mismatch_tokens": on.sum().to(torch.float64),
            "mismatch_abs_sum": (trainer - sampled).abs().sum(),
            "mismatch_kl_sum": torch.where(on, k3_kl(sampled, trainer), zeros).sum(),
            "mismatch_ratio_sum": ratios.sum(),
            "mismatch_ratio_sq_sum": (ratios * ratios).sum(),
        }
        if on.any():
            sums["mismatch_ratio_max"] = ratios[on].max()
            sums["mismatch_ratio_min"] = ratios[on].min()
        if loss_mask is not None:
            missing = loss_mask.bool() & ~on
            sums["mismatch_missing_tokens"] = missing.sum().to(torch.float64)
        if tis_weights is not None:
            sums["tis_weight_sum"] = torch.where(on, tis_weights.double(), zeros).sum()
            if tis_cap is not None:
                sums["tis_capped_tokens"] = ((tis_weights >= tis_cap) & on).sum().to(zeros.dtype)
    return sums


def mismatch_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The ``mismatch/*`` metrics from an iteration's summed :func:`mismatch_sums` (none when no
    token had a behaviour log-prob)."""
    tokens = sums.get("mismatch_tokens", 0.0)
    out = {}
    if "mismatch_missing_tokens" in sums:
        out["mismatch/missing_tokens"] = sums["mismatch_missing_tokens"]
    if not tokens:
        return out
    ratio_sum = sums["mismatch_ratio_sum"]
    out |= {
        "mismatch/abs_logp": sums["mismatch_abs_sum"] / tokens,
        "mismatch/kl": sums["mismatch_kl_sum"] / tokens,
        "mismatch/ratio_mean": ratio_sum / tokens,
        "mismatch/ratio_max": sums["mismatch_ratio_max"],
        "mismatch/ratio_min": sums["mismatch_ratio_min"],
        "mismatch/ess": ratio_sum * ratio_sum / (tokens * sums["mismatch_ratio_sq_sum"]),
    }
    if "tis_weight_sum" in sums:
        out["mismatch/tis_weight"] = sums["tis_weight_sum"] / tokens
    if "tis_capped_tokens" in sums:
        out["mismatch/tis_capped_frac"] = sums["tis_capped_tokens"] / tokens
    return out


STALE_IS_CAP = 2.0  # the truncation cap used with bounded staleness when tis_cap is not set


def importance_cap(tis_cap: float | None, max_staleness: int) -> float | None:
    """The truncation cap of the importance weights: ``tis_cap``; with bounded staleness
    (``max_staleness >= 1``) the correction is part of the objective, with cap
    :data:`STALE_IS_CAP` unless ``tis_cap`` says otherwise."""
    if tis_cap is None and max_staleness > 0:
        return STALE_IS_CAP
    return tis_cap


def behaviour_for_loss(
    groups: Sequence[RolloutGroup],
    logps: torch.Tensor,
    mask: torch.Tensor,
    tis_cap: float | None,
    engine: str,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The groups' behaviour log-probs laid out like ``logps``, and where they count (present
    and in the loss ``mask``); None when no group carries any. With ``tis_cap`` a group without
    them is refused, naming the rollout ``engine``."""
    missing = missing_behaviour(groups) if tis_cap is not None else []
    if missing:
        raise ValueError(
            f"tis_cap={tis_cap} needs behaviour log-probs, but engine {engine!r} returned none "
            f"(groups {missing[:5]}): use an engine that reports them ('hf', 'vllm'), "
            "implement InferenceEngine.generate_with_logprobs in yours, or set tis_cap to null"
        )
    found = behaviour_logps(groups, logps)
    if found is None:
        return None
    values, present = found
    return values, present & mask.bool()
