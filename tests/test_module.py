"""RLModule: configuration errors surface before any engine starts, naming the field."""

import lightning as L
import pytest

from periodic_rl import PeriodicAsyncStrategy, PromptDataModule, RLModule


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_generations": 1}, "num_generations"),
        ({"num_generations": 4, "micro_batch_size": 6}, "micro_batch_size"),
        ({"loss_type": "ppo"}, "loss_type"),
        ({"scale_rewards": "global"}, "scale_rewards"),
        ({"advantage_baseline": "mean"}, "advantage_baseline"),
        ({"temperature": 0.0}, "temperature"),
        ({"dtype": "int8"}, "dtype"),
        ({"reward_funcs": ["math:nope"]}, "reward_funcs"),
        ({"reward_funcs": ["math:floor"], "reward_weights": [1.0, 2.0]}, "reward_weights"),
    ],
)
def test_bad_config_names_the_field(tiny_llama_path, kwargs, field):
    with pytest.raises(ValueError, match=field):
        RLModule(model=tiny_llama_path, **kwargs)


def _wrong_length(prompts, completions, **columns):
    return [1.0]


def _nan_reward(prompts, completions, **columns):
    return [float("nan")] * len(completions)


@pytest.mark.parametrize(
    ("reward", "message"),
    [(_wrong_length, "returned 1 values for 2 completions"), (_nan_reward, "NaN")],
)
def test_bad_reward_fails_before_engines_start(tiny_llama_path, reward, message):
    module = RLModule(
        model=tiny_llama_path, num_generations=2, micro_batch_size=2, reward_funcs=[reward]
    )
    strategy = PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False)
    trainer = L.Trainer(strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False)
    data = PromptDataModule(batch_size=2, num_train=8, num_val=2)
    with pytest.raises(ValueError, match=message):
        trainer.fit(module, datamodule=data)
    assert strategy.rollouts is None  # nothing expensive was started


def test_missing_prompt_in_rows_fails_before_engines_start(tiny_llama_path, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"question": "hi"}\n')
    module = RLModule(
        model=tiny_llama_path, num_generations=2, micro_batch_size=2, reward_funcs=[_nan_reward]
    )
    strategy = PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False)
    trainer = L.Trainer(strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match="'prompt' column"):
        trainer.fit(module, datamodule=PromptDataModule(source=str(path), batch_size=1))
    assert strategy.rollouts is None


def test_module_without_our_strategy_says_what_to_do(tiny_llama_path):
    module = RLModule(model=tiny_llama_path, num_generations=2, micro_batch_size=2)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, accelerator="cpu")
    with pytest.raises(TypeError, match="PeriodicAsyncStrategy"):
        trainer.fit(module, datamodule=PromptDataModule(batch_size=2, num_train=4, num_val=0))
