"""End to end, offline: a hub-format repository with a config name and a column mapping trains
through the CLI, and a reasoning-gym task trains with its verifier as the reward."""

from __future__ import annotations

import csv
import sys

import datasets
import huggingface_hub.constants
import lightning as L
import pytest

from periodic_rl import PeriodicAsyncStrategy, PromptDataModule, RLModule
from periodic_rl.cli import main

RUN = """
seed_everything: 0
trainer:
  max_steps: 2
  default_root_dir: {root}
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args: {{save_dir: {root}, name: csv}}
  log_every_n_steps: 1
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  strategy:
    class_path: periodic_rl.PeriodicAsyncStrategy
    init_args: {{engine: hf, use_ray: false, overlap: false}}
model:
  class_path: periodic_rl.RLModule
  init_args:
    model: {model}
    num_generations: 2
    micro_batch_size: 2
    max_new_tokens: 4
    shared_prompt: false
    reward_funcs: [{user_module}:exact]
data:
  class_path: periodic_rl.PromptDataModule
  init_args:
    source: {repo}
    name: socratic
    columns: {{question: prompt, answer: solution}}
    batch_size: 2
    num_val: 2
"""


@pytest.fixture
def offline(monkeypatch):
    """No network for `datasets` or the hub (the flags are read at import, so set them too)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_hub_repository_with_a_config_and_a_mapping_trains_through_the_cli(
    hub_repo, user_module, tiny_llama_path, tmp_path, offline, monkeypatch
):
    """The reward reads the mapped column ``solution`` and refuses any prompt that is not of
    the ``socratic`` config's train split (main's rows would fail the run)."""
    monkeypatch.setattr(sys, "argv", ["periodic-rl"])
    config = tmp_path / "run.yaml"
    root = tmp_path / "run"
    text = RUN.format(root=root, model=tiny_llama_path, user_module=user_module, repo=hub_repo)
    config.write_text(text)
    main(["fit", "--config", str(config)])
    (metrics,) = root.glob("csv/version_*/metrics.csv")
    with metrics.open() as f:
        rows = list(csv.DictReader(f))
    scored = [row for row in rows if row.get("rewards/exact")]
    assert len(scored) == 2  # one per iteration, scored by the user's reward on mapped columns
    assert len([row for row in rows if row.get("eval/exact")]) == 2  # held-out: start, end


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_reasoning_gym_task_trains_with_its_verifier_as_the_reward(tiny_llama_path, offline):
    pytest.importorskip(
        "reasoning_gym", reason="needs reasoning-gym: pip install 'periodic_rl[reasoning-gym]'"
    )
    L.seed_everything(0, verbose=False)
    module = RLModule(
        model=tiny_llama_path,
        num_generations=2,
        micro_batch_size=2,
        max_new_tokens=4,
        shared_prompt=False,
    )
    trainer = L.Trainer(
        strategy=PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = PromptDataModule("reasoning_gym:leg_counting", batch_size=2, num_train=8, num_val=2)
    trainer.fit(module, datamodule=data)
    logged = trainer.callback_metrics
    assert 0.0 <= float(logged["rewards/leg_counting"]) <= 1.0  # the task's verifier scored it
    assert float(logged["reward"]) == float(logged["rewards/leg_counting"])  # the only reward
    assert trainer.global_step == 2
