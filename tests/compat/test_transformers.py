"""Pins of :mod:`periodic_rl.compat.transformers` (checked on transformers 5.19.0).

Each test exercises, on a real tiny Llama, the private behaviour one adapter relies on; a
transformers upgrade that changes it fails the test named after that adapter.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import (
    AttentionInterface,
    AttentionMaskInterface,
    AutoModelForCausalLM,
    GPTJForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.models.llama import modeling_llama

from periodic_rl.compat.transformers import (
    attention_implementation,
    original_attention_function,
    registered_mask_function,
    set_attention_implementation,
    uses_attention_interface,
)

_names = itertools.count()
EAGER = modeling_llama.eager_attention_forward


def tiny_llama(attn_implementation: str = "eager") -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.eval()


def recording_attention(calls: list[dict]):
    """An attention function that records each call and computes eager attention."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        calls.append({"layer": module.layer_idx, "mask": attention_mask})
        return EAGER(module, query, key, value, attention_mask, **kwargs)

    return attention


def fresh_name() -> str:
    """A new attention implementation name (the interfaces are process-wide registries)."""
    return f"periodic_rl_compat_probe_{next(_names)}"


def forward(model) -> None:
    with torch.no_grad():
        model(torch.tensor([[1, 5, 9, 3]]))


def test_attention_implementation_reads_what_the_layers_dispatch_on():
    """Guards ``PretrainedConfig._attn_implementation`` (read by every attention forward)."""
    model = tiny_llama("eager")
    assert attention_implementation(model.config) == "eager"
    model.set_attn_implementation("sdpa")  # the public switch
    assert attention_implementation(model.config) == "sdpa"


def test_set_attention_implementation_switches_the_dispatch_and_returns_the_previous():
    """Guards ``PretrainedConfig._attn_implementation_internal``: writing it directly makes the
    layers call the function registered under the new name, and writing the old value back
    restores them (what ``shared_prompt_attention`` does on enter and exit)."""
    calls: list[dict] = []
    name = fresh_name()
    AttentionInterface.register(name, recording_attention(calls))
    model = tiny_llama("eager")

    previous = set_attention_implementation(model.config, name)
    assert previous == "eager"
    assert attention_implementation(model.config) == name
    forward(model)
    assert [c["layer"] for c in calls] == [0, 1]

    assert set_attention_implementation(model.config, previous) == name
    assert attention_implementation(model.config) == "eager"
    forward(model)
    assert len(calls) == 2  # back on eager: the recorder is no longer called


def test_uses_attention_interface_tells_interface_models_from_hand_written_ones():
    """Guards ``PreTrainedModel._can_set_attn_implementation()``: Llama computes its attention
    through ``AttentionInterface``, GPT-J (its own attention code in 5.19) does not."""
    assert uses_attention_interface(LlamaForCausalLM) is True
    assert uses_attention_interface(GPTJForCausalLM) is False


def test_registered_mask_function_is_the_one_transformers_builds_masks_with():
    """Guards ``AttentionMaskInterface._global_mapping``: a name registered there has its mask
    function called by the model's forward; a name absent from it gets no mask at all (the
    attention function receives ``attention_mask=None``), which is what ``None`` stands for."""
    from transformers.masking_utils import sdpa_mask

    assert registered_mask_function("sdpa") is sdpa_mask

    # attention registered without a mask function: transformers builds no mask
    calls: list[dict] = []
    bare = fresh_name()
    AttentionInterface.register(bare, recording_attention(calls))
    assert registered_mask_function(bare) is None
    model = tiny_llama("eager")
    set_attention_implementation(model.config, bare)
    forward(model)
    assert calls and all(c["mask"] is None for c in calls)

    # with a mask function registered: the adapter returns it and the forward calls it
    masked = fresh_name()
    mask_calls = []

    def mask_function(*args, **kwargs):
        mask_calls.append(kwargs.get("config"))
        return sdpa_mask(*args, **kwargs)

    AttentionInterface.register(masked, recording_attention(calls))
    AttentionMaskInterface.register(masked, mask_function)
    assert registered_mask_function(masked) is mask_function
    set_attention_implementation(model.config, masked)
    forward(model)
    assert mask_calls and mask_calls[0] is model.config


def test_original_attention_function_is_what_the_layer_would_call(monkeypatch):
    """Guards the modeling-file convention: a module-level ``eager_attention_forward`` that the
    attention forward passes to ``ALL_ATTENTION_FUNCTIONS.get_interface`` as the default, and
    registered implementations resolved through that same interface."""
    calls: list[dict] = []
    spy = recording_attention(calls)
    monkeypatch.setattr(modeling_llama, "eager_attention_forward", spy)
    model = tiny_llama("eager")
    layer = model.model.layers[0].self_attn

    assert original_attention_function(layer, "eager") is spy
    forward(model)  # the layers call the module-level function the adapter returned
    assert [c["layer"] for c in calls] == [0, 1]

    assert original_attention_function(layer, "sdpa") is AttentionInterface()["sdpa"]
    with pytest.raises(KeyError):
        original_attention_function(layer, "no_such_attention_implementation")
