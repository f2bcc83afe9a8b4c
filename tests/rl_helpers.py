"""Small training runs shared by the invariance tests."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from periodic_rl import PeriodicAsyncStrategy, PromptDataModule, RLModule


def length_reward(prompts, completions, **columns):
    """A reward with spread inside every group, so every advantage is non-zero."""
    return [len(c) / 10.0 for c in completions]


class SGDModule(RLModule):
    """Plain SGD, no clipping: the update is the gradient itself, so any normalisation error
    shows (Adam would hide a constant factor)."""

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        return torch.optim.SGD(params, lr=self.hparams.learning_rate)


def train(
    model_path: str,
    steps: int = 2,
    strategy: dict[str, Any] | None = None,
    batch_size: int = 3,
    **module_kwargs: Any,
) -> tuple[dict[str, torch.Tensor], RLModule, PeriodicAsyncStrategy]:
    """Train ``steps`` iterations; return the trainable parameters, the module and the strategy."""
    L.seed_everything(0, verbose=False)
    kwargs: dict[str, Any] = dict(
        model=model_path,
        num_generations=4,
        micro_batch_size=4,
        max_new_tokens=8,
        learning_rate=0.5,
        max_grad_norm=None,
        reward_funcs=[length_reward],
        shared_prompt=False,
    )
    kwargs.update(module_kwargs)
    module = SGDModule(**kwargs)
    strategy_obj = PeriodicAsyncStrategy(
        **(strategy or {"engine": "hf", "use_ray": False, "overlap": False})
    )
    trainer = L.Trainer(
        strategy=strategy_obj,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        module,
        datamodule=PromptDataModule(batch_size=batch_size, num_train=4 * batch_size, num_val=0),
    )
    params = {
        name: p.detach().clone() for name, p in module.policy.named_parameters() if p.requires_grad
    }
    return params, module, strategy_obj


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)
