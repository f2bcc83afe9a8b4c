"""Held-out evaluation, as Lightning validation.

- Data: :meth:`PromptDataModule.val_dataloader <periodic_rl.PromptDataModule.val_dataloader>`
  holds every held-out row in one batch, so a worker generates them in one engine call.
- Step: :meth:`RLModule.validation_step <periodic_rl.RLModule.validation_step>` completes each
  held-out prompt greedily (temperature 0) through the strategy's rollout workers, with the
  weights they hold now (the strategy pushes after every optimizer step, so they are the
  current ones), scores the completions with the module's rewards, and logs ``eval/reward``,
  ``eval/<reward function>`` and ``eval/accuracy`` (when the task has an accuracy function)
  with ``self.log(..., on_epoch=True)``: ``ModelCheckpoint(monitor="eval/reward")``,
  ``EarlyStopping(monitor="eval/reward")`` and ``periodic-rl validate`` (its results table) see
  them. The generation is no iteration's generation time (``generate_groups``).
- When: one training batch is one iteration, so ``Trainer(val_check_interval=10)`` evaluates
  every 10 iterations (within an epoch of the prompt loader; with
  ``check_val_every_n_epoch=None`` the count runs across epochs). Besides, the module's
  ``eval_at_start`` evaluates before the first iteration and ``eval_at_end`` after the last one
  (unless a periodic evaluation just did), by running the trainer's own validation loop then.
- Record: every evaluation appends ``{"tag", "step", "reward", <component>...}`` to
  ``module.eval_history`` (saved in checkpoints; the ``FitReport`` callback reads the ``start``
  and ``end`` entries) and logs one INFO line (the ``periodic_rl`` logger). ``tag`` is
  ``start``, ``end``, ``iteration`` (a periodic one) or ``validate`` (``trainer.validate``);
  ``step`` is the number of iterations trained (the policy version evaluated), also the step
  the loggers record the metrics at.

Lightning's sanity check (``num_sanity_val_steps``, 0 from the CLI) runs the step on the first
held-out prompt only: it checks that evaluation works, and Lightning discards what it logs.
"""

from __future__ import annotations

import logging
from typing import Any

from periodic_rl.compat.lightning import is_last_batch, run_validation_loop
from periodic_rl.rollout.types import GroupJob, SamplingConfig

TAGS = ("start", "end", "iteration", "validate")

log = logging.getLogger(__name__)


class HeldOutEvaluation:
    """The module's held-out evaluation: the running validation epoch and the history."""

    def __init__(self) -> None:
        self.history: list[dict[str, Any]] = []
        self._tag: str | None = None  # set while a start/end evaluation runs
        self._sums: dict[str, float] = {}
        self._count = 0

    # ---- the validation hooks --------------------------------------------------------------
    def epoch_start(self) -> None:
        self._sums, self._count = {}, 0

    def step(self, module: Any, rows: list[dict[str, Any]]) -> dict[str, float]:
        """Greedy completions of ``rows``, scored; logs the batch means and returns them."""
        if module.trainer.sanity_checking:
            rows = rows[:1]  # a check that evaluation runs; Lightning discards its metrics
        if not rows:
            return {}
        scores = held_out_scores(module, rows)
        means = {}
        for name, values in scores.items():
            self._sums[name] = self._sums.get(name, 0.0) + sum(values)
            means[name] = sum(values) / len(values)
            module.log(
                f"eval/{name}",
                means[name],
                on_step=False,
                on_epoch=True,
                prog_bar=name == "reward",
                batch_size=len(values),
                sync_dist=True,  # every rank holds the same value (rank 0 generated for all)
            )
        # The x-axis of these metrics in the loggers: the policy version evaluated, as for the
        # training metrics (Lightning takes a logged "step" as the step; :meth:`end` keeps it
        # from naming later checkpoints).
        module.log("step", float(evaluated_version(module)), on_step=False, on_epoch=True,
                   batch_size=len(rows), sync_dist=True)  # fmt: skip
        self._count += len(rows)
        return means

    def epoch_end(self, module: Any) -> dict[str, Any] | None:
        """Record the epoch's means in :attr:`history` and log them (not the sanity check)."""
        trainer = module.trainer
        if trainer.sanity_checking or self._count == 0:
            return None
        if self._tag is not None:
            tag = self._tag
        elif trainer.state.fn != "fit":
            tag = "validate"
        else:
            tag = "end" if is_last_iteration(trainer) else "iteration"
        step = evaluated_version(module)
        result = {k: v / self._count for k, v in self._sums.items()}
        entry = {"tag": tag, **result, "step": float(step)}
        self.history.append(entry)
        summary = ", ".join(f"{k} {v:.3f}" for k, v in result.items())
        if trainer.is_global_zero:  # every rank records the same evaluation; one logs it
            log.info("held-out (%s, iteration %d): %s", tag, step, summary)
        return entry

    def end(self, trainer: Any) -> None:
        """After the evaluation's callbacks (its checkpoint among them) ran: forget the logged
        ``step``, which ModelCheckpoint reads as the step of every later file it names (a
        checkpoint holding iteration 10 named ``step=0`` after an evaluation at the start)."""
        trainer.callback_metrics.pop("step", None)

    # ---- evaluations outside the training loop's own schedule ------------------------------
    def at_train_start(self, trainer: Any) -> None:
        """The evaluation before the first iteration (not on resume: the run has its start)."""
        if trainer.global_step == 0:
            self.run_now(trainer, "start")

    def at_train_end(self, trainer: Any) -> None:
        """The evaluation after the last iteration, unless one ran at this step already (a
        periodic one, e.g. ``val_check_interval`` dividing ``max_steps``, or before early
        stopping): that one is the end evaluation then."""
        last = self.history[-1] if self.history else None
        if last is not None and last["step"] == trainer.global_step and last["tag"] != "validate":
            if last["tag"] == "iteration":
                last["tag"] = "end"
            return
        self.run_now(trainer, "end")

    def run_now(self, trainer: Any, tag: str) -> None:
        """Run the trainer's validation loop now, as its training loop does every
        ``val_check_interval`` iterations (validation state on, then training state back)."""
        self._tag = tag
        try:
            run_validation_loop(trainer)
        finally:
            self._tag = None


def held_out_scores(module: Any, rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per-row reward and reward components of greedy completions of ``rows``, in row order,
    generated by the strategy's rollout workers with their current weights."""
    strategy = module.rollout_strategy()
    prompt_ids, _ = module.encode_prompts(rows, "held-out prompt")
    jobs = [
        GroupJob(index=i, prompt_ids=ids, n=1, seed=i, row=module.rollout_row(rows[i]))
        for i, ids in enumerate(prompt_ids)
    ]
    h = module.hparams
    cap = h.eval_max_new_tokens or h.max_new_tokens
    greedy = SamplingConfig(max_new_tokens=cap, temperature=0.0)
    groups = [
        module.scorer.score(g, rows[g.index], prompt_ids[g.index], held_out=True)
        for g in strategy.generate_groups(jobs, greedy)
    ]
    groups.sort(key=lambda g: g.index)
    scores = {"reward": [g.rewards[0] for g in groups]}
    # Every component column, named components included; one a row lacks (a reward that
    # failed before its components were known, under reward_on_error: zero) scores 0 there.
    names = dict.fromkeys(name for g in groups for name in g.reward_components)
    for name in names:
        scores[name] = [g.reward_components.get(name, [0.0])[0] for g in groups]
    return scores


def evaluated_version(module: Any) -> int:
    """The policy version evaluated: iterations trained so far, or the checkpoint's in
    ``trainer.validate`` (its loop does not restore the global step)."""
    trainer = module.trainer
    return trainer.global_step if trainer.state.fn == "fit" else module.loaded_policy_version


def is_last_iteration(trainer: Any) -> bool:
    """Whether the iteration that just ended is the run's last (``max_steps`` reached, or the
    last batch of the last epoch)."""
    if trainer.max_steps is not None and trainer.max_steps >= 0:
        if trainer.global_step >= trainer.max_steps:
            return True
    max_epochs = trainer.max_epochs
    if max_epochs is None or max_epochs < 0:
        return False
    return is_last_batch(trainer) and trainer.current_epoch + 1 >= max_epochs
