"""One micro-batch of an iteration: what the rollouts are turned into, and its backward.

:func:`rollout_request` turns an iteration's prompt rows into the jobs the rollout side
generates and the scoring of each finished group; :func:`backward_micro_batch` forwards the
policy (and the reference) on a packed micro-batch of scored groups and back-propagates the sum
of its token losses (normalised for the whole iteration later, by ``RLModule``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from lightning.pytorch import Trainer

from periodic_rl.algorithms.losses import (
    loss_numerator,
    per_token_policy_loss,
    truncated_is_weights,
)
from periodic_rl.algorithms.mismatch import behaviour_for_loss, importance_cap, mismatch_sums
from periodic_rl.attention import completion_logprobs, shared_prompt_attention
from periodic_rl.data.loader import IndexedPrompts, SparePrompts
from periodic_rl.iteration import micro_batch_tensors
from periodic_rl.loss_mask import apply_loss_masks
from periodic_rl.rollout.dynamic_sampling import DynamicSampling, SpareJobs
from periodic_rl.rollout.pipeline import RolloutRequest
from periodic_rl.rollout.types import GroupJob, RolloutGroup, SamplingConfig
from periodic_rl.scoring import Scorer
from periodic_rl.strategies.protocol import RolloutStrategy
from periodic_rl.truncation import mask_truncated


class TrainingModule(Protocol):
    """What the helpers here use of :class:`~periodic_rl.module.RLModule` (declared here, so
    that this module does not import the one that imports it)."""

    hparams: Any  # Lightning's AttributeDict of the module's arguments
    policy: torch.nn.Module
    tokenizer: Any  # a transformers tokenizer
    scorer: Scorer
    device: torch.device

    @property
    def trainer(self) -> Trainer: ...

    @property
    def sampling(self) -> SamplingConfig: ...

    def encode_prompts(
        self, rows: list[dict[str, Any]], where: str
    ) -> tuple[list[list[int]], int]: ...

    def group_seed(self, iteration: int, index: int) -> int: ...

    def rollout_row(self, row: dict[str, Any]) -> dict[str, Any] | None: ...

    @property
    def resolved_tis_cap(self) -> float | None:
        """``tis_cap`` with ``auto`` resolved for the run's engine and dtypes."""
        ...

    def reference_policy(self) -> AbstractContextManager[torch.nn.Module]: ...

    def rollout_strategy(self) -> RolloutStrategy: ...

    def manual_backward(self, loss: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class FirstPass:
    """What the first update of an iteration keeps of a micro-batch for the later ones
    (``num_iterations > 1``): the old policy's log-probs, the importance weights, the reference
    log-probs (all ``[N, T]``, detached; None when unused)."""

    old_logps: torch.Tensor
    is_weights: torch.Tensor | None
    ref_logps: torch.Tensor | None


def rollout_request(
    module: TrainingModule, strategy: RolloutStrategy, iteration: int, rows: list[dict[str, Any]]
) -> tuple[RolloutRequest, int]:
    """Iteration ``iteration``'s rollouts for every rank's ``rows`` (a collective), and how many
    of its prompts were cut to ``max_prompt_length``."""
    share = strategy.share_prompts(rows)  # every rank's prompts; rank 0 generates them all
    prompt_ids, cut = module.encode_prompts(share.rows, f"iteration {iteration}: prompt")
    h = module.hparams
    n = h.num_generations
    jobs = [
        GroupJob(
            index=i,
            prompt_ids=ids,
            n=n,
            seed=module.group_seed(iteration, i),
            row=module.rollout_row(share.rows[i]),
        )
        for i, ids in enumerate(prompt_ids)
    ]
    spares = dynamic = None
    if h.get("dynamic_sampling", False):  # DAPO: zero-variance groups replaced by spares
        spares = spare_jobs(module, iteration, first_index=len(jobs))
        dynamic = DynamicSampling(
            spares,
            max_spares=h.dynamic_sampling_max_batches * len(jobs),
            spares_ahead=h.dynamic_sampling_spares_ahead,
        )

    def score(generated):  # runs off the trainer's critical path in overlapped mode
        index = generated.index
        if spares is not None and spares.is_spare(index):
            row, ids = spares.row(index)
            return module.scorer.score(generated, row, ids)
        return module.scorer.score(generated, share.rows[index], prompt_ids[index])

    on_all_scored = module.scorer.scale_batch if h.scale_rewards == "batch" else None
    request = RolloutRequest(
        iteration, jobs, share.owners, module.sampling, score, on_all_scored, dynamic,
        eos_token_ids=tuple(module.scorer.eos_token_ids),
    )  # fmt: skip
    return request, cut


def spare_jobs(module: TrainingModule, iteration: int, first_index: int) -> SpareJobs:
    """The spare prompt groups of dynamic sampling, drawn in a seeded order from the train
    loader (the same list for every rank: N ranks train the groups one rank would)."""
    loader = module.trainer.train_dataloader
    if not isinstance(loader, SparePrompts):
        raise TypeError(
            f"dynamic_sampling draws spare prompts from the train loader: "
            f"{type(loader).__name__} has no spare_rows(iteration, count, start). Use "
            "PromptDataModule (its PromptLoader has it) or add the method to yours"
        )
    where = f"iteration {iteration}: spare prompt"
    return SpareJobs(
        first_index=first_index,  # after every rank's originals
        row=lambda s: loader.spare_rows(iteration, 1, start=s)[0],
        encode=lambda row: module.encode_prompts([row], where)[0][0],
        n=module.hparams.num_generations,
        seed=lambda index: module.group_seed(iteration, index),
        job_row=module.rollout_row,
    )


def prompts_of_iteration(trainer: Trainer, iteration: int) -> list[dict[str, Any]]:
    """This rank's rows of a later iteration, from the train loader (bounded staleness)."""
    loader = trainer.train_dataloader
    if not isinstance(loader, IndexedPrompts):
        raise TypeError(
            f"max_staleness >= 1 generates later iterations' prompts ahead, so the train loader "
            f"must tell them: {type(loader).__name__} has no rows_of_iteration(i). Use "
            "PromptDataModule (its PromptLoader has it) or add the method to yours"
        )
    return loader.rows_of_iteration(iteration)


def backward_micro_batch(
    module: TrainingModule, groups: list[RolloutGroup], first: FirstPass | None = None
) -> tuple[dict[str, float], FirstPass]:
    """Forward and backward one micro-batch; returns its loss sums and what later updates of
    the iteration reuse. ``first`` (``num_iterations > 1``): the first update's log-probs are
    the old policy of the clipped ratio, its importance weights and reference log-probs are
    reused. The environment tokens of multi-turn groups are out of the token mask from the
    start (:mod:`periodic_rl.loss_mask`): out of the loss, the entropy, the KL, the importance
    weights and the mismatch sums."""
    h = module.hparams
    pairs = [(g.prompt_ids, g.completion_ids) for g in groups]
    forward = dict(
        shared_prompt=h.shared_prompt,
        backend=h.attention_backend,
        pad_token_id=module.tokenizer.pad_token_id,
        temperature=h.temperature,  # train on the distribution the rollouts sampled from
    )
    advantages, _ = micro_batch_tensors(groups, module.device)
    first_update = first is None
    behaviour = cap = None
    with ExitStack() as stack:
        if h.shared_prompt:  # keeps attention packed through checkpointed recomputation
            stack.enter_context(shared_prompt_attention(module.policy))
        logps, mask, entropy = completion_logprobs(
            module.policy, pairs, return_entropy=True, **forward
        )
        if h.mask_truncated_completions:  # zero loss weight (periodic_rl.truncation)
            mask = mask_truncated(mask, groups)
        mask = apply_loss_masks(mask, groups)  # environment tokens (periodic_rl.loss_mask)
        if first_update:
            ref_logps = None
            if h.beta > 0:
                with torch.no_grad(), module.reference_policy() as reference:
                    ref_logps, _ = completion_logprobs(reference, pairs, **forward)
            strategy = module.rollout_strategy()
            cap = importance_cap(module.resolved_tis_cap, strategy.max_staleness)
            behaviour = behaviour_for_loss(groups, logps, mask, cap, strategy.rollout_engine)
            weights = None
            if behaviour is not None and cap is not None:
                weights = truncated_is_weights(logps, behaviour[0], mask, cap)
            # the first update's old policy is the current one: ratio 1, gradient not 0
            first = FirstPass(logps.detach(), weights, ref_logps)
        per_token, stats = per_token_policy_loss(
            logps,
            first.old_logps,
            advantages,
            mask,
            epsilon=h.epsilon,
            epsilon_high=h.epsilon_high if h.epsilon_high is not None else h.epsilon,
            beta=h.beta,
            ref_logps=first.ref_logps,
            is_weights=first.is_weights,  # None without a cap: exactly the plain loss
        )
        numerator = loss_numerator(per_token, mask, h.loss_type)
        module.manual_backward(numerator)
    stats["entropy_sum"] = (entropy * mask).sum()
    if behaviour is not None:  # the engine/trainer mismatch (periodic_rl.algorithms.mismatch)
        stats.update(mismatch_sums(logps, *behaviour, first.is_weights, cap, mask))
    elif first_update:  # no group of this micro-batch has behaviour log-probs
        stats["mismatch_missing_tokens"] = mask.sum()
    out = {k: float(v) for k, v in stats.items()}
    out["loss_sum"] = float(numerator.detach())
    return out, first
