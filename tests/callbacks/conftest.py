"""Fixtures: a full fine-tuning run with every callback and a LoRA export run, once each."""

from __future__ import annotations

import pytest
from callback_runs import LORA, STEPS, Run, fit

from periodic_rl.callbacks import (
    FitReport,
    HFExport,
    PipelineMetrics,
    PipelineTimeline,
    RolloutSamples,
)


@pytest.fixture(scope="session")
def full_run(tiny_llama_path, tmp_path_factory) -> Run:
    """Full fine-tuning, 3 iterations, every callback."""
    root = tmp_path_factory.mktemp("full-run")
    callbacks = [
        RolloutSamples(every_n_iterations=1, max_groups=1),
        PipelineTimeline(iterations=[1], every_n_iterations=2),
        PipelineMetrics(),
        HFExport(every_n_iterations=2),
        FitReport(print_report=False),
    ]
    return fit(tiny_llama_path, root, callbacks, STEPS)


@pytest.fixture(scope="session")
def lora_run(tiny_llama_path, tmp_path_factory) -> Run:
    """LoRA, 2 iterations, exporting the adapter and the merged model."""
    root = tmp_path_factory.mktemp("lora-run")
    callbacks = [HFExport(output_dir=str(root / "export"), merged=True)]
    return fit(tiny_llama_path, root, callbacks, 2, lora=LORA, learning_rate=5e-2)
