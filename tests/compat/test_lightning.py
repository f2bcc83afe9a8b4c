"""Pins of :mod:`periodic_rl.compat.lightning` (checked on lightning 2.6.6), and of the one
Lightning protocol the strategy relies on without calling it (``parallel_devices``).

Each test runs a real Trainer on a tiny module; a Lightning upgrade that changes a loop internal
fails the test named after the adapter that uses it.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader

from periodic_rl.compat.lightning import attached_trainer, is_last_batch, run_validation_loop


class Tiny(L.LightningModule):
    """Three training batches, two validation batches; records what each step saw."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.train_steps = 0
        self.validation_steps: list[dict] = []
        self.validation_epochs = 0

    def training_step(self, batch, batch_idx):
        self.train_steps += 1
        return self.layer(batch).sum()

    def validation_step(self, batch, batch_idx):
        self.validation_steps.append(
            {"validating": self.trainer.validating, "training": self.trainer.training}
        )
        self.log("val_out", self.layer(batch).sum(), on_epoch=True, batch_size=1)

    def on_validation_epoch_end(self):
        self.validation_epochs += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(torch.ones(3, 2), batch_size=1)

    def val_dataloader(self):
        return DataLoader(torch.ones(2, 2), batch_size=1)


def make_trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return L.Trainer(**{**defaults, **kwargs})


def test_run_validation_loop_runs_validation_from_inside_fit():
    """Guards ``trainer.fit_loop.epoch_loop.val_loop.run()``: called from ``on_train_start``
    (as the module's start evaluation is), it runs every validation batch in validation state,
    calls the epoch-end hook, logs, and leaves the trainer training as before."""
    after: dict = {}

    class StartValidation(L.Callback):
        def on_train_start(self, trainer, pl_module):
            run_validation_loop(trainer)
            after["training"] = trainer.training
            after["validation_steps"] = len(pl_module.validation_steps)
            after["metrics"] = dict(trainer.callback_metrics)

    module = Tiny()
    # no validation of Lightning's own during this fit: only the one the callback runs
    trainer = make_trainer(
        callbacks=[StartValidation()], check_val_every_n_epoch=None, val_check_interval=1000
    )
    trainer.fit(module)
    assert after["validation_steps"] == 2
    assert module.validation_steps == [{"validating": True, "training": False}] * 2
    assert module.validation_epochs == 1
    assert "val_out" in after["metrics"]
    assert after["training"] is True
    assert module.train_steps == 3 and trainer.global_step == 3


def test_is_last_batch_marks_the_last_training_batch_of_the_epoch():
    """Guards ``trainer.fit_loop.epoch_loop.batch_progress.is_last_batch``: read in the
    validation that follows each training batch (where the module's evaluation reads it), it is
    true after the epoch's last batch only."""
    seen: list[bool] = []

    class Record(L.Callback):
        def on_validation_epoch_end(self, trainer, pl_module):
            seen.append(is_last_batch(trainer))

    make_trainer(callbacks=[Record()], val_check_interval=1).fit(Tiny())
    assert seen == [False, False, True]


def test_attached_trainer_is_none_before_fit_and_the_trainer_after():
    """Guards ``LightningModule._trainer``: ``None`` until a Trainer attaches the module (when
    the public ``module.trainer`` raises), then that Trainer."""
    module = Tiny()
    assert attached_trainer(module) is None
    with pytest.raises(RuntimeError, match="not attached"):
        module.trainer  # noqa: B018 - the property raises
    trainer = make_trainer(limit_train_batches=1, limit_val_batches=0)
    trainer.fit(module)
    assert attached_trainer(module) is trainer


def test_accelerator_connector_hands_its_devices_to_a_strategy_with_parallel_devices():
    """Guards the protocol ``PeriodicAsyncStrategy.parallel_devices`` relies on: the Trainer's
    accelerator connector assigns the devices it picked (from ``accelerator`` and ``devices``)
    to a strategy that has an empty ``parallel_devices`` attribute (lightning 2.6.6,
    ``_AcceleratorConnector._lazy_init_strategy``)."""

    class Recording(SingleDeviceStrategy):
        parallel_devices = None

    strategy = Recording(device=torch.device("cpu"))
    make_trainer(strategy=strategy)
    assert strategy.parallel_devices == [torch.device("cpu")]
