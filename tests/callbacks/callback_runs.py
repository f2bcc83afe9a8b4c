"""Short CPU runs with callbacks attached, shared by the callback tests (fixtures: conftest).

A tiny random Llama, the in-process transformers engine (no Ray, no overlap), the built-in
arithmetic prompts with a length reward (so advantages are non-zero and the weights move) and
four held-out prompts; TensorBoard and CSV loggers in a temporary folder unless the caller
passes its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from rl_helpers import length_reward

from periodic_rl import PeriodicAsyncStrategy, PromptDataModule, RLModule

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
STEPS = 3


@dataclass
class Run:
    root: Path
    module: RLModule
    trainer: L.Trainer
    strategy: PeriodicAsyncStrategy
    callbacks: dict[str, Any] = field(default_factory=dict)


def fit(
    model_path: str,
    root: Path,
    callbacks: list[Any],
    steps: int,
    loggers: list[Logger] | None = None,
    **module_kwargs: Any,
) -> Run:
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
    strategy = PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False)
    trainer = L.Trainer(
        strategy=strategy,
        max_steps=steps,
        default_root_dir=root,
        logger=loggers or [TensorBoardLogger(root, name="tb"), CSVLogger(root, name="csv")],
        log_every_n_steps=1,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = PromptDataModule(batch_size=2, num_train=16, num_val=4)
    trainer.fit(module, datamodule=data)
    return Run(root, module, trainer, strategy, {type(cb).__name__: cb for cb in callbacks})
