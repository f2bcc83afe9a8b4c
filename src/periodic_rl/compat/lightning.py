"""Lightning internals the module and its evaluation rely on (checked on lightning 2.6.6).

Pinned by ``tests/compat/test_lightning.py``.
"""

from __future__ import annotations

from typing import Any


def attached_trainer(module: Any) -> Any | None:
    """The Trainer ``module`` is attached to, or ``None`` before it is attached.

    Relies on the private attribute ``LightningModule._trainer`` (lightning 2.6.6): the public
    ``module.trainer`` raises ``RuntimeError`` when no Trainer is attached.
    """
    return module._trainer


def run_validation_loop(trainer: Any) -> None:
    """Run the trainer's validation loop now, from inside ``fit``, as its training loop does
    every ``val_check_interval`` batches: validation state on, the loop, training state back.

    Relies on the undocumented loop chain ``trainer.fit_loop.epoch_loop.val_loop`` and its
    ``run()`` (lightning 2.6.6, ``loops/training_epoch_loop.py``, ``on_advance_end``), with the
    public ``trainer.validating``/``trainer.training`` switches around it.
    """
    trainer.validating = True
    try:
        trainer.fit_loop.epoch_loop.val_loop.run()
    finally:
        trainer.training = True


def is_last_batch(trainer: Any) -> bool:
    """Whether the training batch that just ran is the last of its epoch (the dataloader is
    exhausted).

    Relies on the undocumented progress record
    ``trainer.fit_loop.epoch_loop.batch_progress.is_last_batch`` (lightning 2.6.6), set when the
    batch is fetched and still true during the validation that follows it.
    """
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
