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
    ({"max_new_tokens": 32, "overlong_buffer": 32}, "overlong_buffer"),  # not below the cap
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


# ---- choices: typed as Literal, one generic check ------------------------------------------
def test_every_choice_is_a_literal():
    """The choices of the module and the rollout options are closed Literal types (so the CLI
    validates and lists them); engine and attention_backend are open (class paths, a registry)
    but list their built-in values."""
    import typing

    from periodic_rl.choices import choice_arguments
    from periodic_rl.rollout.options import RolloutOptions
    from periodic_rl.strategies.rollouts_mixin import RolloutsMixin

    module = choice_arguments(RLModule.__init__)
    for name in ("loss_type", "scale_rewards", "advantage_baseline", "prompt_truncation"):
        assert name in module, name
    for name in ("reward_on_error", "lr_scheduler", "dtype"):
        assert name in module, name
    assert module["loss_type"] == ("grpo", "bnpo", "dr_grpo", "dapo")
    assert set(choice_arguments(RolloutOptions)) == {"placement_strategy", "push_transport"}
    hints = typing.get_type_hints(RolloutsMixin.__init__)
    assert "Literal['vllm', 'hf']" in str(hints["engine"])
    assert "Literal['auto', 'sdpa', 'split', 'flex', 'flash']" in str(
        typing.get_type_hints(RLModule.__init__)["attention_backend"]
    )


def test_lr_scheduler_choices_are_the_schedules_of_transformers():
    from transformers.trainer_utils import SchedulerType

    from periodic_rl.optim import REFUSED, scheduler_names

    assert sorted(scheduler_names()) == sorted(s.value for s in SchedulerType if s not in REFUSED)


def _every_module_choice():
    from periodic_rl.choices import choice_arguments

    return sorted(choice_arguments(RLModule.__init__).items())


@pytest.mark.parametrize(("name", "allowed"), _every_module_choice(), ids=lambda v: str(v)[:20])
def test_python_api_refuses_a_value_outside_the_literal(tiny_llama_path, name, allowed):
    """No jsonargparse from Python: the one generic check refuses it, listing the values."""
    with pytest.raises(ValueError) as err:
        RLModule(model=tiny_llama_path, **{name: "not-a-choice"})
    message = str(err.value)
    assert message.startswith(f"{name} must be one of ")
    assert all(repr(value) in message for value in allowed if value is not None), message
    assert "got 'not-a-choice'" in message


@pytest.mark.parametrize("name", ["placement_strategy", "push_transport"])
def test_strategy_refuses_a_value_outside_the_literal(name):
    with pytest.raises(ValueError, match=rf"^{name} must be one of .*; got 'nope'"):
        PeriodicAsyncStrategy(engine="hf", **{name: "nope"})


def test_choice_check_tells_bools_from_ints():
    from typing import Literal

    from periodic_rl.choices import check_choices

    def f(level: Literal[0, 1] | None = None) -> None: ...

    check_choices(f, {"level": 1})
    check_choices(f, {"level": None})
    with pytest.raises(ValueError, match="level must be one of 0, 1, null; got True"):
        check_choices(f, {"level": True})


# ---- model_init_kwargs: from_pretrained's own arguments --------------------------------------
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_model_init_kwargs_reach_the_policy_and_the_reference(tiny_llama_path, attn):
    module = RLModule(
        model=tiny_llama_path, beta=0.1, model_init_kwargs={"attn_implementation": attn}
    )
    module.configure_model()
    assert module.policy.config._attn_implementation == attn
    assert module.reference.config._attn_implementation == attn


@pytest.fixture
def hub_cache(tmp_path, tiny_llama_path, monkeypatch):
    """A hub cache holding ``acme/tiny`` at two revisions, ``main`` (2 layers) and ``v2`` (1
    layer), laid out as huggingface_hub writes it (refs -> snapshots); offline."""
    import shutil

    import huggingface_hub.constants as hub
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    repo = tmp_path / "models--acme--tiny"
    for revision, commit in (("main", "a" * 40), ("v2", "b" * 40)):
        snapshot = repo / "snapshots" / commit
        if revision == "main":
            shutil.copytree(tiny_llama_path, snapshot)
        else:
            config = AutoConfig.from_pretrained(tiny_llama_path, num_hidden_layers=1)
            model = AutoModelForCausalLM.from_config(config)
            model.save_pretrained(snapshot)
            AutoTokenizer.from_pretrained(tiny_llama_path).save_pretrained(snapshot)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / revision).write_text(commit)
    return str(tmp_path)


@pytest.mark.parametrize(("revision", "layers"), [("main", 2), ("v2", 1), ("b" * 40, 1)])
def test_model_init_kwargs_revision_picks_the_snapshot(hub_cache, revision, layers):
    """A local directory has no revisions (from_pretrained ignores ``revision`` there), so the
    model is a hub id resolved offline from a cache with two revisions of different depth."""
    kwargs = {"revision": revision, "cache_dir": hub_cache}
    module = RLModule(model="acme/tiny", model_init_kwargs=kwargs)
    module.configure_model()
    assert module.policy.config.num_hidden_layers == layers
    assert module.tokenizer is not None  # from the same snapshot: the kwargs reached it too


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ("attn_implementation=eager", "must be a dict"),
        ({"dtype": "bfloat16"}, "must not set 'dtype'"),
        ({"device_map": "auto"}, "must not set 'device_map'"),
    ],
)
def test_model_init_kwargs_that_cannot_work_are_refused(tiny_llama_path, kwargs, needle):
    with pytest.raises(ValueError, match=rf"model_init_kwargs {needle}"):
        RLModule(model=tiny_llama_path, model_init_kwargs=kwargs)
