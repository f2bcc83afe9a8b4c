"""Every numeric range and every enum of the settings is refused at construction, naming the
field and what it must be (docs/troubleshooting.md, "Bad input")."""

import pytest
from rl_helpers import with_tuning

from periodic_rl import PeriodicAsyncStrategy, PromptDataModule, RLModule

MUST = ("must be", "one of", "allowed values", "choose from", "expected one of", "give one")

# (bad settings, the field the error must name)
MODULE_RANGES = [
    ({"num_generations": 1}, "num_generations"),
    ({"num_generations": 4, "micro_batch_size": 6}, "micro_batch_size"),
    ({"micro_batch_size": 0}, "micro_batch_size"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"overlong_buffer": 32}, "overlong_buffer"),  # not below max_new_tokens (32)
    ({"overlong_buffer": 8, "overlong_penalty": 0.0}, "overlong_penalty"),
    ({"max_prompt_length": 0}, "max_prompt_length"),
    ({"temperature": 0.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"min_p": 1.0}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"num_iterations": 0}, "num_iterations"),
    ({"dynamic_sampling_max_batches": 0}, "dynamic_sampling_max_batches"),
    ({"dynamic_sampling_spares_ahead": -1}, "dynamic_sampling_spares_ahead"),
    ({"epsilon": 0.0}, "epsilon"),
    ({"epsilon_high": -0.1}, "epsilon_high"),
    ({"beta": -0.1}, "beta"),
    ({"tis_cap": 0.0}, "tis_cap"),
    ({"learning_rate": 0.0}, "learning_rate"),
    ({"weight_decay": -0.1}, "weight_decay"),
    ({"max_grad_norm": 0.0}, "max_grad_norm"),
    ({"warmup_steps": -1, "lr_scheduler": "linear"}, "warmup_steps"),
    ({"warmup_ratio": 1.0, "lr_scheduler": "linear"}, "warmup_ratio"),
    ({"eval_max_new_tokens": 0}, "eval_max_new_tokens"),
]
MODULE_ENUMS = [
    ({"loss_type": "ppo"}, "loss_type"),
    ({"scale_rewards": "global"}, "scale_rewards"),
    ({"advantage_baseline": "mean"}, "advantage_baseline"),
    ({"prompt_truncation": "right"}, "prompt_truncation"),
    ({"lr_scheduler": "triangle"}, "lr_scheduler"),
    ({"dtype": "int8"}, "dtype"),
    ({"attention_backend": "flash3"}, "attention_backend"),
    ({"mask_truncated_completions": "yes"}, "mask_truncated_completions"),
]
MODULE_SHAPES = [
    ({"lora": "r=16"}, "lora"),
    ({"lr_scheduler_kwargs": "min_lr_rate=0.1"}, "lr_scheduler_kwargs"),
    ({"reward_funcs": ["math:floor"], "reward_weights": [1.0, 2.0]}, "reward_weights"),
]


def _ids(cases):
    return [f"{field}={list(kwargs.values())[-1]!r}" for kwargs, field in cases]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    MODULE_RANGES + MODULE_ENUMS + MODULE_SHAPES,
    ids=_ids(MODULE_RANGES + MODULE_ENUMS + MODULE_SHAPES),
)
def test_module_setting_out_of_range_names_the_field(tiny_llama_path, kwargs, field):
    with pytest.raises(ValueError) as err:
        RLModule(model=tiny_llama_path, **kwargs)
    message = str(err.value)
    assert field in message and any(word in message for word in MUST), message


STRATEGY = [
    ({"engine": "tgi"}, "engine kind"),
    ({"num_workers": 0}, "num_workers"),
    ({"max_staleness": -1}, "max_staleness"),
    ({"groups_per_call": 0}, "groups_per_call"),
    ({"cpus_per_worker": 0}, "cpus_per_worker"),
    ({"gpus_per_worker": -1}, "gpus_per_worker"),
    ({"num_workers": 2, "worker_cores": [[0]]}, "worker_cores"),
    ({"use_ray": False}, "use_ray=False"),  # overlap needs workers in their own processes
]


@pytest.mark.parametrize(("kwargs", "field"), STRATEGY, ids=_ids(STRATEGY))
def test_strategy_setting_out_of_range_names_the_field(kwargs, field):
    with pytest.raises(ValueError) as err:
        PeriodicAsyncStrategy(**with_tuning({"engine": "hf", **kwargs}))
    message = str(err.value)
    assert field in message, message
    assert any(word in message for word in (*MUST, "needs", "entries for")), message


DATA = [
    ({"batch_size": 0}, "batch_size"),
    ({"val_fraction": 1.0}, "val_fraction"),
    ({"num_val": -1}, "num_val"),
    ({"num_train": 0}, "num_train"),
]


@pytest.mark.parametrize(("kwargs", "field"), DATA, ids=_ids(DATA))
def test_data_setting_out_of_range_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"{field} must be"):
        PromptDataModule(**kwargs)
