"""The callbacks every :class:`~periodic_rl.RLModule` run gets unless the user gave their own.

``RLModule.configure_callbacks`` returns :func:`default_callbacks`, so a run started from Python
(``Trainer(...).fit(module, datamodule)``) writes the same artefacts as one started from the
example YAML: metrics, pipeline timings, timelines, rollout samples, the exported model and the
report, in the run's log folder. Lightning lets a module's callbacks replace the trainer's of
the same type; these are only returned for the types the trainer does not already hold, so a
callback the user passed (``HFExport(merged=True)``, ``RLMetrics(progress_bar=[...])``) is kept
as given. Without a logger (``logger=False``) the run has no log folder: only the metrics and
the progress bar are added.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback, RichProgressBar

from periodic_rl.callbacks.export import HFExport
from periodic_rl.callbacks.metrics import PipelineMetrics
from periodic_rl.callbacks.record import RolloutRecord
from periodic_rl.callbacks.report import FitReport
from periodic_rl.callbacks.rl_metrics import RLMetrics
from periodic_rl.callbacks.samples import RolloutSamples
from periodic_rl.callbacks.timeline import PipelineTimeline
from periodic_rl.extras import available

if TYPE_CHECKING:
    from lightning.pytorch import Trainer


def iteration_description(trainer: Trainer, steps_per_iteration: int = 1) -> str:
    """What the progress bar calls the training run's progress: ``Iteration i/n`` on a
    ``max_steps`` run (``max_steps`` counts optimizer steps, ``steps_per_iteration`` of them per
    iteration), else ``Epoch e`` (``/last`` when ``max_epochs`` is set)."""
    if trainer.max_steps is not None and trainer.max_steps > 0:
        done = trainer.global_step // steps_per_iteration
        return f"Iteration {done}/{trainer.max_steps // steps_per_iteration}"
    text = f"Epoch {trainer.current_epoch}"
    if trainer.max_epochs is not None and trainer.max_epochs > 0:
        text += f"/{trainer.max_epochs - 1}"
    return text


class RLProgressBar(RichProgressBar):
    """Lightning's Rich progress bar, described by :func:`iteration_description` (a
    ``max_steps`` run has no last epoch: Lightning's own reads ``Epoch 0/-2``)."""

    def on_train_epoch_start(self, trainer: Trainer, pl_module: Any) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._describe(trainer, pl_module)

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, *args: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args)
        self._describe(trainer, pl_module)

    def _describe(self, trainer: Trainer, pl_module: Any) -> None:
        if self.progress is None or self.train_progress_bar_id is None:
            return
        steps = getattr(pl_module, "hparams", {}).get("num_iterations", 1)
        text = iteration_description(trainer, steps)
        style = self.theme.description
        self.progress.update(
            self.train_progress_bar_id, description=f"[{style}]{text}" if style else text
        )


def default_callbacks(trainer: Trainer) -> list[Callback]:
    """The default callbacks (those ``examples/arithmetic.yaml`` lists, but the checkpoint
    Lightning adds itself), and the rollout record when the module asks for it, whose type
    ``trainer`` does not already hold."""
    wanted: list[Callback] = [RLMetrics()]
    module = trainer.lightning_module
    if module is not None and getattr(module, "hparams", {}).get("record_rollouts", False):
        wanted.append(RolloutRecord())  # RLModule(record_rollouts=True)
    if trainer.loggers:  # a log folder to write the artefacts to
        wanted += [
            PipelineMetrics(),
            *([PipelineTimeline()] if available("matplotlib") else []),  # charts: report extra
            RolloutSamples(),
            HFExport(),
            FitReport(),
        ]
    chosen = [
        cb for cb in wanted if not any(isinstance(given, type(cb)) for given in trainer.callbacks)
    ]
    bar = trainer.progress_bar_callback
    if type(bar) is RichProgressBar:  # Lightning's default one: the same, counting iterations
        chosen.append(RLProgressBar(refresh_rate=bar.refresh_rate, theme=bar.theme))
    return chosen
