"""Short CPU runs with every callback attached; each runs once and serves many tests.

A tiny random Llama, the in-process transformers engine (no Ray, no overlap), the built-in
arithmetic prompts with a length reward (so advantages are non-zero and the weights move) and
four held-out prompts; TensorBoard and CSV loggers in a temporary folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from rl_helpers import length_reward

from periodic_rl import PeriodicAsyncStrategy, PromptDataModule, RLModule
from periodic_rl.callbacks import (
    FitReport,
    HFExport,
    PipelineMetrics,
    PipelineTimeline,
    RolloutSamples,
)

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
STEPS = 3


class _TracedLocalRollouts:
    """The in-process rollouts plus the per-call "generate" span on ``worker-0`` that the Ray
    fabric records for its workers, so the timeline has a worker lane without starting Ray."""

    def __init__(self, inner: Any, spans: Any) -> None:
        self.inner = inner
        self.spans = spans

    def generate(self, jobs, sampling, version):
        groups = list(self.inner.generate(jobs, sampling, version))
        if groups:
            self.spans.add("generate", "worker-0", groups[0].started, groups[0].finished)
        yield from groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class TracedStrategy(PeriodicAsyncStrategy):
    def _start_rollouts(self, model_path: str) -> Any:
        return _TracedLocalRollouts(super()._start_rollouts(model_path), self.spans)


@dataclass
class Run:
    root: Path
    module: RLModule
    trainer: L.Trainer
    strategy: PeriodicAsyncStrategy
    callbacks: dict[str, Any] = field(default_factory=dict)
    printed: str = ""


def fit(model_path: str, root: Path, callbacks: list[Any], steps: int, **module_kwargs: Any) -> Run:
    L.seed_everything(0, verbose=False)
    kwargs: dict[str, Any] = dict(
        model=model_path,
        num_generations=4,
        micro_batch_size=4,
        max_new_tokens=6,
        learning_rate=1e-2,
        reward_funcs=[length_reward],
        shared_prompt=False,
    )
    kwargs.update(module_kwargs)
    module = RLModule(**kwargs)
    strategy = TracedStrategy(engine="hf", use_ray=False, overlap=False)
    trainer = L.Trainer(
        strategy=strategy,
        max_steps=steps,
        default_root_dir=root,
        logger=[TensorBoardLogger(root, name="tb"), CSVLogger(root, name="csv")],
        log_every_n_steps=1,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = PromptDataModule(batch_size=2, num_train=16, num_val=4)
    trainer.fit(module, datamodule=data)
    return Run(root, module, trainer, strategy, {type(cb).__name__: cb for cb in callbacks})


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
