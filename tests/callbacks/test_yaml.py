"""Every callback is configurable from YAML ``trainer.callbacks`` by class_path."""

from __future__ import annotations

import sys

from periodic_rl.callbacks import (
    FitReport,
    HFExport,
    PipelineMetrics,
    PipelineTimeline,
    RolloutSamples,
)
from periodic_rl.cli import PeriodicRLCLI
from periodic_rl.data import PromptDataModule
from periodic_rl.module import RLModule

CONFIG = """
trainer:
  logger: false
  callbacks:
    - class_path: periodic_rl.callbacks.RolloutSamples
      init_args: {every_n_iterations: 5, max_groups: 2, jsonl_path: samples.jsonl}
    - class_path: periodic_rl.callbacks.PipelineTimeline
      init_args: {iterations: [1, 3]}
    - class_path: periodic_rl.callbacks.PipelineMetrics
    - class_path: periodic_rl.callbacks.HFExport
      init_args: {every_n_iterations: 10, merged: true}
    - class_path: periodic_rl.callbacks.FitReport
model:
  class_path: periodic_rl.RLModule
  init_args: {model: MODEL}
data:
  class_path: periodic_rl.PromptDataModule
"""


def test_callbacks_from_yaml(tmp_path, tiny_llama_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["periodic-rl"])  # not pytest's arguments
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG.replace("MODEL", tiny_llama_path))
    cli = PeriodicRLCLI(
        RLModule,
        PromptDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        args=["--config", str(config)],
        auto_configure_optimizers=False,
    )
    by_type = {type(cb): cb for cb in cli.trainer.callbacks}
    kinds = (RolloutSamples, PipelineTimeline, PipelineMetrics, HFExport, FitReport)
    assert all(k in by_type for k in kinds)
    assert by_type[RolloutSamples].max_groups == 2
    assert by_type[PipelineTimeline].iterations == {1, 3}
    assert by_type[HFExport].merged is True
