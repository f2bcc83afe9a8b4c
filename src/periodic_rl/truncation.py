"""Length limits: truncated completions (masked from the loss, or softly penalised) and long
prompts (cut from the left, or refused).

**Truncated completion.** A completion is truncated when it reached ``max_new_tokens`` without
an end-of-sequence token (the tokenizer's EOS and the model's ``generation_config`` ones, the
tokens the engines stop on): :func:`is_truncated`. TRL tests "the last token is neither EOS nor
pad"; the engines here return completions cut after their EOS, unpadded, so both rules agree,
and the length condition keeps a completion that stopped early for another reason from being
called truncated.

**mask_truncated_completions** (TRL's ``GRPOConfig.mask_truncated_completions``, DAPO's "overlong
filtering"): a truncated completion gets a zero loss mask, so it adds nothing to the loss and its
tokens leave the token normaliser, exactly as TRL does since its fix #6439 (``num_items_in_batch``
is the sum of the *masked* ``completion_mask``)::

    grpo     mean over ALL sequences of (masked token sum / masked length, at least 1)
    bnpo     masked token sum / masked tokens
    dr_grpo  masked token sum / (ALL sequences * max_new_tokens)
    dapo     masked token sum / masked tokens of the whole iteration

The sequence counts of ``grpo`` and ``dr_grpo`` keep the masked sequences (TRL's ``.mean()`` and
``per_token_loss.size(0)`` run over every row): a masked completion weighs 0 in their mean. Its
reward still enters its group's mean and std, so the advantages of its siblings are unchanged.
The normaliser counts are the iteration's, however it is split into micro-batches
(:meth:`~periodic_rl.iteration.IterationStats.loss_tokens`), so K micro-batches still equal one
batch.

**Soft overlong punishment** (DAPO, arXiv 2503.14476, Eq. 13; verl's ``overlong_buffer``
``len`` / ``penalty_factor``; TRL's ``get_soft_overlong_punishment``): with ``L`` the completion
length in tokens (its EOS included), ``L_max = max_new_tokens``, ``L_cache = overlong_buffer``
and ``f = overlong_penalty``::

    R_overlong(L) = 0                                  L <= L_max - L_cache
                  = f * ((L_max - L_cache) - L) / L_cache    L_max - L_cache < L <= L_max

i.e. verl's ``min(-(L - (L_max - L_cache)) / L_cache * f, 0)``; TRL's is the case ``f = 1``. It
is added to the weighted reward *before* the group advantages (:class:`~periodic_rl.scoring.Scorer`)
and logged as ``rewards/overlong``.

**max_prompt_length** (TRL's ``max_prompt_length`` up to 0.27, which kept the last tokens; verl's
``data.max_prompt_length`` with ``truncation: left | error``): ``"left"`` keeps the last
``max_prompt_length`` tokens of a longer prompt (the end of a chat template, where the
generation prompt is, survives), counted per iteration as ``prompts_truncated``; ``"error"``
refuses it before the iteration generates anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, get_args

import torch

PromptTruncation = Literal["left", "error"]
PROMPT_TRUNCATION: tuple[str, ...] = get_args(PromptTruncation)


def check_truncation_config(args: dict[str, Any]) -> None:
    """Refuse bad length settings of :class:`~periodic_rl.RLModule`, naming the fix."""
    if not isinstance(args["mask_truncated_completions"], bool):
        raise ValueError(
            "mask_truncated_completions must be true or false, got "
            f"{args['mask_truncated_completions']!r}"
        )
    cap, buffer = args["max_new_tokens"], args["overlong_buffer"]
    if buffer is not None and (
        isinstance(buffer, bool) or not isinstance(buffer, int) or not 0 < buffer < cap
    ):
        raise ValueError(
            f"overlong_buffer must be an integer in (0, max_new_tokens={cap}) tokens, or null, "
            f"got {buffer!r}: the penalty ramps from 0 at max_new_tokens - overlong_buffer to "
            "-overlong_penalty at max_new_tokens (DAPO uses 4096 of 20480)"
        )
    penalty = args["overlong_penalty"]
    if isinstance(penalty, bool) or not isinstance(penalty, int | float) or not 0 < penalty < 1e9:
        raise ValueError(f"overlong_penalty must be a finite number > 0, got {penalty!r}")
    length = args["max_prompt_length"]
    if length is not None and (isinstance(length, bool) or not isinstance(length, int)):
        raise ValueError(f"max_prompt_length must be an integer or null, got {length!r}")
    if length is not None and length < 1:
        raise ValueError(f"max_prompt_length must be >= 1 token, or null, got {length}")


# ---- completions ------------------------------------------------------------------------------
def eos_token_ids(tokenizer: Any, model: Any = None) -> tuple[int, ...]:
    """The tokens that end a completion, as the rollout engines stop on them: the tokenizer's
    EOS plus the model's ``generation_config.eos_token_id`` (an int or a list)."""
    ids: list[int] = []
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for candidate in (getattr(tokenizer, "eos_token_id", None), configured):
        values = candidate if isinstance(candidate, list | tuple) else [candidate]
        ids += [int(v) for v in values if v is not None and int(v) not in ids]
    return tuple(ids)


def is_truncated(completion: Sequence[int], max_new_tokens: int, eos: Sequence[int]) -> bool:
    """Whether ``completion`` hit ``max_new_tokens`` without ending on an EOS token."""
    return len(completion) >= max_new_tokens and (not completion or completion[-1] not in eos)


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment of a completion of ``length`` tokens (module docstring):
    0 up to ``max_new_tokens - buffer``, then linear down to ``-penalty`` at ``max_new_tokens``."""
    exceed = length - (max_new_tokens - buffer)
    return min(-exceed / buffer * penalty, 0.0)


def completion_keep(groups: Sequence[Any]) -> list[bool]:
    """Per completion of ``groups`` (group order), whether it keeps its loss weight: not
    truncated. Refuses groups scored without truncation flags rather than keep them all."""
    keep: list[bool] = []
    for group in groups:
        if len(group.truncated) != len(group.completion_ids):
            raise ValueError(
                f"group {group.index} has {len(group.truncated)} truncation flags for "
                f"{len(group.completion_ids)} completions: mask_truncated_completions needs a "
                "Scorer built with max_new_tokens (module_setup.build_scorer sets it)"
            )
        keep.extend(not t for t in group.truncated)
    return keep


def mask_truncated(mask: torch.Tensor, groups: Sequence[Any]) -> torch.Tensor:
    """The micro-batch's ``[N, T]`` loss mask with the rows of truncated completions zeroed."""
    keep = torch.tensor(completion_keep(groups), dtype=mask.dtype, device=mask.device)
    return mask * keep.unsqueeze(1)


# ---- prompts ----------------------------------------------------------------------------------
def fit_prompts(
    prompt_ids: list[list[int]],
    max_prompt_length: int | None,
    mode: str = "left",
    where: str = "training prompt",
) -> tuple[list[list[int]], int]:
    """``prompt_ids`` within ``max_prompt_length`` tokens, and how many were cut.

    ``mode="left"`` keeps the last ``max_prompt_length`` tokens of a longer prompt; ``"error"``
    raises ``ValueError`` naming the first long prompt (``where`` and its index), its length
    and the fixes. ``max_prompt_length=None`` returns the prompts unchanged.
    """
    if max_prompt_length is None:
        return prompt_ids, 0
    out, cut = [], 0
    for index, ids in enumerate(prompt_ids):
        if len(ids) <= max_prompt_length:
            out.append(ids)
            continue
        if mode == "error":
            raise ValueError(
                f"{where} {index} has {len(ids)} tokens, more than max_prompt_length="
                f"{max_prompt_length} (prompt_truncation='error'): filter long prompts out of "
                f"the data, raise max_prompt_length to at least {len(ids)}, or set "
                "prompt_truncation='left' to keep each prompt's last max_prompt_length tokens"
            )
        out.append(list(ids[-max_prompt_length:]))
        cut += 1
    return out, cut
