"""Models whose attention cannot take the shared-prompt layout are refused with a clear error."""

from __future__ import annotations

import pytest
import torch
from sp_models import UNEQUAL, make_model, random_groups

from periodic_rl.attention import ATTN_NAME, SharedPromptUnsupportedError, completion_logprobs


@pytest.fixture(scope="module")
def groups():
    return random_groups(2, UNEQUAL)


def test_sliding_window_shorter_than_prompt_plus_response_is_refused(groups):
    model = make_model("mistral", sliding_window=8)  # spans here reach 11 + 8 = 19 tokens
    with torch.no_grad():
        completion_logprobs(model, groups, shared_prompt=False)  # the padded path is fine
        with pytest.raises(SharedPromptUnsupportedError, match="sliding window of 8 tokens"):
            completion_logprobs(model, groups)
    assert model.config._attn_implementation != ATTN_NAME  # restored after the error


def test_sliding_window_covering_everything_is_accepted(groups):
    model = make_model("mistral", sliding_window=19)
    with torch.no_grad():
        ref, _ = completion_logprobs(model, groups, shared_prompt=False)
        logps, _ = completion_logprobs(model, groups)
    assert (logps - ref).abs().max().item() < 1e-5


def test_attention_softcapping_is_refused_on_cpu_backends(groups):
    model = make_model("gemma2", attn_logit_softcapping=50.0)
    with torch.no_grad(), pytest.raises(SharedPromptUnsupportedError, match="softcapping"):
        completion_logprobs(model, groups, backend="split")


def test_hybrid_model_with_conv_layers_is_refused(groups):
    import transformers as tf

    config = tf.Lfm2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, full_attn_idxs=[1],
    )  # fmt: skip
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad(), pytest.raises(SharedPromptUnsupportedError, match=r"\['conv'\]"):
        completion_logprobs(model, groups)


def test_model_without_attention_interface_is_refused(groups):
    from transformers import LlamaForCausalLM

    class HandWrittenAttention(LlamaForCausalLM):
        _can_set_attn_implementation_cached_value = False

    model = HandWrittenAttention(make_model("llama").config).eval()
    with torch.no_grad(), pytest.raises(SharedPromptUnsupportedError, match="AttentionInterface"):
        completion_logprobs(model, groups)


def test_layer_bypassing_the_interface_is_caught_after_the_forward(groups):
    model = make_model("llama")
    attn = model.model.layers[1].self_attn
    attn.forward = lambda hidden_states, **kw: (torch.zeros_like(hidden_states), None)
    with torch.no_grad(), pytest.raises(SharedPromptUnsupportedError, match="1 attention calls"):
        completion_logprobs(model, groups)


def test_prompt_learning_adapters_are_refused(groups):
    from peft import PrefixTuningConfig, get_peft_model

    model = get_peft_model(
        make_model("llama"), PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)
    )
    with torch.no_grad(), pytest.raises(SharedPromptUnsupportedError, match="prompt-learning"):
        completion_logprobs(model, groups)


def test_selecting_the_dispatcher_by_hand_is_an_error(groups):
    model = make_model("llama")
    model.config._attn_implementation = ATTN_NAME
    with torch.no_grad(), pytest.raises(RuntimeError, match="outside shared_prompt_attention"):
        model(torch.tensor([groups[0][0]]))
