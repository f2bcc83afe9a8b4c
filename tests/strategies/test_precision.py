"""float16 training is refused for every periodic-async strategy, before any model loads: with
manual optimisation the clip would read loss-scaled gradients (Lightning #18089), and DeepSpeed's
fp16 adds a dynamic loss scaler (:func:`periodic_rl.config_checks.check_precision`)."""

from __future__ import annotations

import lightning as L
import pytest
from rl_helpers import length_reward

from periodic_rl import PeriodicAsyncStrategy, PromptDataModule, RLModule
from periodic_rl.config_checks import check_precision


@pytest.mark.parametrize("precision", ["16-mixed", "16-true"])
def test_fp16_precisions_are_refused_naming_bf16(precision):
    with pytest.raises(ValueError, match=rf"precision='{precision}'.*'bf16-mixed'"):
        check_precision(precision)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_other_precisions_pass(precision):
    check_precision(precision)


def test_fit_in_fp16_fails_before_the_model_loads(tiny_llama_path):
    module = RLModule(model=tiny_llama_path, reward_funcs=[length_reward])
    trainer = L.Trainer(
        strategy=PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False),
        precision="16-true",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(ValueError, match="bf16-mixed"):
        trainer.fit(module, datamodule=PromptDataModule(batch_size=2, num_train=4, num_val=0))
    assert module.policy is None and module.tokenizer is None
