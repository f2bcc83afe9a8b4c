"""`RLMetrics`: what each iteration's rollouts were, logged; the key few in the progress bar.

Every :class:`~periodic_rl.RLModule` adds this callback by default (``configure_callbacks``);
pass your own instance in ``trainer.callbacks`` to change what the progress bar shows.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback
from torchmetrics.aggregation import MeanMetric

from periodic_rl.callbacks._common import last_iteration

PROGRESS_BAR = ("reward", "rewards/accuracy", "rollouts_per_s")


class RLMetrics(Callback):
    """Log the iteration's metrics: reward mean/std (total and per function as
    ``rewards/<name>``), accuracy (when the task has one), completion length, clip fraction,
    KL (``beta > 0``), entropy, fraction of groups whose rewards are all equal (no learning
    signal), fraction of completions truncated at ``max_new_tokens`` (``frac_truncated``),
    prompts cut to ``max_prompt_length`` (``prompts_truncated``, when set), the engine/trainer
    log-prob mismatch when the engine reports behaviour log-probs (``mismatch/abs_logp``,
    ``mismatch/kl``, the importance ratio's ``mismatch/ratio_mean``, ``_max``, ``_min`` and
    effective sample size ``mismatch/ess``, ``mismatch/missing_tokens``; with ``tis_cap`` also
    ``mismatch/tis_weight`` and ``mismatch/tis_capped_frac``; see the module
    ``periodic_rl.algorithms.mismatch``), and throughput (rollouts/s, tokens/s); with the
    strategy's ``max_staleness >= 1`` the groups' lag (``staleness/*``); with multi-turn
    trajectories the environment tokens kept out of the loss (``rollout/masked_tokens``) and
    the agent's turns, tool calls, errors, timeouts, latency and stop reasons (``agent/*``;
    :class:`~periodic_rl.iteration.AgentTotals`). ``reward_running`` is
    the mean training reward over the run so far (a torchmetrics ``MeanMetric``, weighted by
    completions).

    Args:
        progress_bar: metric names also shown in the progress bar.
    """

    def __init__(self, progress_bar: list[str] | tuple[str, ...] = PROGRESS_BAR) -> None:
        self.progress_bar = tuple(progress_bar)
        self.running_reward = MeanMetric()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stats = last_iteration(pl_module)
        if stats is None:
            return
        metrics = stats.metrics()
        if getattr(trainer.strategy, "max_staleness", 0) == 0:  # on-policy: no lag to show
            metrics = {k: v for k, v in metrics.items() if not k.startswith("staleness/")}
        self.running_reward.update(metrics["reward"], weight=stats.num_sequences)
        metrics["reward_running"] = float(self.running_reward.compute())
        for name, value in metrics.items():
            pl_module.log(
                name,
                float(value),
                prog_bar=name in self.progress_bar,
                on_step=True,
                on_epoch=False,
                batch_size=stats.num_sequences,
            )
