"""End-to-end invariants of the RL iteration, on a tiny model with the in-process HF engine."""

import lightning as L
import pytest
import torch

from periodic_rl import PeriodicAsyncStrategy, PromptDataModule, RLModule


def _length_reward(prompts, completions, **columns):
    """A reward with spread inside every group, so every advantage is non-zero."""
    return [len(c) / 10.0 for c in completions]


class SGDModule(RLModule):
    """Plain SGD, no clipping: the update is the gradient itself, so any normalisation error
    shows (Adam would hide a constant factor)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.policy.parameters(), lr=self.hparams.learning_rate)


def _train(model_path: str, steps: int = 2, **module_kwargs) -> dict[str, torch.Tensor]:
    L.seed_everything(0, verbose=False)
    kwargs = dict(
        model=model_path,
        num_generations=4,
        micro_batch_size=4,
        max_new_tokens=8,
        learning_rate=0.5,
        max_grad_norm=None,
        reward_funcs=[_length_reward],
        shared_prompt=False,
    )
    kwargs.update(module_kwargs)
    module = SGDModule(**kwargs)
    trainer = L.Trainer(
        strategy=PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=PromptDataModule(batch_size=3, num_train=12, num_val=0))
    return {k: v.detach().clone() for k, v in module.policy.state_dict().items()}


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_k_micro_batches_equal_one_batch(tiny_llama_path, loss_type):
    one = _train(tiny_llama_path, loss_type=loss_type, micro_batch_size=12)
    three = _train(tiny_llama_path, loss_type=loss_type, micro_batch_size=4)
    initial = RLModule(model=tiny_llama_path)
    initial.configure_model()
    moved = _max_diff(one, {k: v for k, v in initial.policy.state_dict().items()})
    assert moved > 1e-3  # training really changed the weights
    assert _max_diff(one, three) < 1e-6
