"""A first run from Python reads well: the module's default callbacks write the artefacts the
guide promises, a callback the user passed is kept, the checkpoint is named after the step it
holds, the progress bar counts iterations, only the metrics of features in use are logged, and a
resume with nothing left to do says so without starting an engine."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from rl_helpers import length_reward

from periodic_rl import PeriodicAsyncStrategy, PromptDataModule, RLModule
from periodic_rl.callbacks import FitReport, HFExport, RLMetrics, RolloutSamples
from periodic_rl.callbacks.defaults import RLProgressBar, iteration_description

STEPS = 2


def fit(root: Path, callbacks=(), ckpt_path=None, **trainer_kwargs):
    """Two iterations from the Python API, with Lightning's own logger and progress bar."""
    L.seed_everything(0, verbose=False)
    module = RLModule(
        model=trainer_kwargs.pop("model"),
        num_generations=2,
        max_new_tokens=4,
        learning_rate=1e-2,
        reward_funcs=[length_reward],
        shared_prompt=False,
    )
    strategy = PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False)
    trainer = L.Trainer(
        strategy=strategy,
        max_steps=STEPS,
        default_root_dir=root,
        callbacks=list(callbacks),
        enable_model_summary=False,
        **trainer_kwargs,
    )
    data = PromptDataModule(batch_size=2, num_train=8, num_val=2)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module, trainer, strategy


@pytest.fixture(scope="module")
def python_run(tiny_llama_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("python-run")
    export = HFExport(output_dir=str(root / "mine"))  # the user's own: kept as given
    module, trainer, strategy = fit(root, [export], model=tiny_llama_path, log_every_n_steps=1)
    return root, module, trainer, export


def test_a_python_api_run_writes_the_artefacts_the_guide_promises(python_run):
    root, _, trainer, _ = python_run
    log_dir = Path(trainer.log_dir)
    assert log_dir == root / "lightning_logs" / "version_0"
    assert (log_dir / "report.md").is_file() and (log_dir / "reward_curve.png").is_file()
    assert (log_dir / "rollout_samples.jsonl").is_file()
    assert any((log_dir / "timeline").iterdir())
    for kind in (RLMetrics, RolloutSamples, FitReport):
        assert sum(isinstance(cb, kind) for cb in trainer.callbacks) == 1, kind


def test_a_callback_the_user_passed_is_kept(python_run):
    root, _, trainer, export = python_run
    exports = [cb for cb in trainer.callbacks if isinstance(cb, HFExport)]
    assert exports == [export]
    assert (root / "mine" / "final" / "config.json").is_file()


def test_the_checkpoint_is_named_after_the_step_it_holds(python_run):
    _, module, trainer, _ = python_run
    assert module.eval_history[0]["tag"] == "start"  # a held-out evaluation at step 0 ran
    (path,) = Path(trainer.checkpoint_callback.dirpath).glob("*.ckpt")
    assert path.name == f"epoch=0-step={STEPS}.ckpt"
    assert torch.load(path, weights_only=False)["global_step"] == STEPS


def test_the_progress_bar_counts_iterations(python_run):
    _, _, trainer, _ = python_run
    assert isinstance(trainer.progress_bar_callback, RLProgressBar)
    assert iteration_description(trainer) == f"Iteration {STEPS}/{STEPS}"
    assert iteration_description(trainer, steps_per_iteration=2) == f"Iteration 1/{STEPS // 2}"


def test_only_the_metrics_of_features_in_use_are_logged(python_run):
    _, _, trainer, _ = python_run
    logged = set(trainer.logged_metrics)
    assert "reward" in logged
    assert not any(name.startswith(("staleness/", "split/")) for name in logged)


def test_a_resume_with_nothing_left_to_do_says_so_and_starts_no_engine(
    tiny_llama_path, tmp_path, caplog
):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit(tmp_path, [checkpoint], model=tiny_llama_path, logger=False)
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.is_file()
    caplog.set_level(logging.INFO, logger="periodic_rl")
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    module, trainer, strategy = fit(
        tmp_path, [checkpoint], ckpt_path=str(last), model=tiny_llama_path, logger=False
    )
    assert module.nothing_to_train and trainer.global_step == STEPS
    assert strategy.rollouts.backend is None and strategy.tuning is None  # nothing started
    said = [r.getMessage() for r in caplog.records if "nothing left to train" in r.getMessage()]
    assert len(said) == 1 and f"at step {STEPS}" in said[0]
