"""`PipelineMetrics`: the strategy's per-iteration timing summary as logged metrics.

The module logs what the rollouts were (reward, lengths, KL, throughput); this logs where the
time went (generating, training, waiting, pushing weights) and how much of the generation the
trainer overlapped, so a slow run can be read off the same dashboard.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

from periodic_rl.callbacks._common import finished_iteration, span_recorder

PREFIX = "pipeline/"
KEYS = (
    "generation_time",
    "training_time",
    "trainer_idle_time",
    "worker_idle_time",
    "push_time",
    "overlap_ratio",
    "wall_time",
)


class PipelineMetrics(Callback):
    """Log ``pipeline/<key>`` for each iteration from ``strategy.spans.summary(iteration)``.

    Keys: generation_time, training_time, trainer_idle_time, worker_idle_time, push_time
    (seconds), overlap_ratio (fraction of generation time the trainer spent training) and
    wall_time. They are logged with ``pl_module.log`` in ``on_train_batch_end``, so they land in
    the same logger row as the module's own metrics (and follow ``log_every_n_steps``).

    The iteration's weight push is complete at that point: it runs in the optimizer step inside
    ``training_step`` and is tagged with the iteration it ends. ``history`` keeps every
    iteration's full summary (all keys of :meth:`SpanRecorder.summary`).
    """

    def __init__(self) -> None:
        self.history: list[dict[str, float]] = []

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        recorder = span_recorder(trainer)
        if recorder is None:
            return
        iteration = recorder.iteration
        if iteration is None:
            iteration = finished_iteration(trainer)
        summary = recorder.summary(iteration)
        self.history.append({"iteration": float(iteration), **summary})
        for key in KEYS:
            pl_module.log(
                PREFIX + key,
                float(summary[key]),
                on_step=True,
                on_epoch=False,
                batch_size=1,
            )
