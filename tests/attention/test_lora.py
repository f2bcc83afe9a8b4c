"""peft LoRA: packed == padded with the adapter and without it (the reference), on one copy."""

from __future__ import annotations

import pytest
import torch
from sp_models import UNEQUAL, grads_of, make_model, max_grad_diff, random_groups

from periodic_rl.attention import completion_logprobs

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(arch: str):  # noqa: ANN201 - PeftModel
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    return get_peft_model(make_model(arch), config)


@pytest.fixture(scope="module")
def groups():
    return random_groups(1, UNEQUAL)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lora_packed_equals_padded(arch, groups):
    model = lora_model(arch)
    for backend in ("sdpa", "split"):
        ref_grads = grads_of(
            model, lambda: completion_logprobs(model, groups, shared_prompt=False)[0]
        )
        grads = grads_of(model, lambda b=backend: completion_logprobs(model, groups, backend=b)[0])
        assert ref_grads and all("lora_" in name for name in ref_grads)
        assert max_grad_diff(grads, ref_grads) < 2e-5
    with torch.no_grad():
        policy_ref, _ = completion_logprobs(model, groups, shared_prompt=False)
        policy, _ = completion_logprobs(model, groups)
        with model.disable_adapter():
            base_ref, _ = completion_logprobs(model, groups, shared_prompt=False)
            base, _ = completion_logprobs(model, groups)
        plain, _ = completion_logprobs(make_model(arch), groups, shared_prompt=False)
    assert (policy - policy_ref).abs().max().item() < 1e-5
    assert (base - base_ref).abs().max().item() < 1e-5
    assert (base - plain).abs().max().item() < 1e-5  # disabled adapter == the base model
    assert (policy - base).abs().max().item() > 1e-3  # the adapter does change the policy


def test_reference_forward_reads_the_same_base_weights(groups):
    """The reference (adapter disabled) is the policy's own base weights: no second copy.

    Every base Linear/Embedding records the storage of the weight it multiplies with; both
    forwards must use exactly the storages of the model's base parameters, and the model holds
    no parameter storage beyond base + LoRA.
    """
    model = lora_model("llama")
    base_ptrs = {p.data_ptr() for n, p in model.named_parameters() if "lora_" not in n}
    used: set[int] = set()

    def record(module: torch.nn.Module, args: object) -> None:
        used.add(module.weight.data_ptr())

    hooks = [
        m.register_forward_pre_hook(record)
        for name, m in model.named_modules()
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) and "lora_" not in name
    ]
    try:
        completion_logprobs(model, groups)  # policy, with grad
        policy_used = set(used)
        used.clear()
        with torch.no_grad(), model.disable_adapter():
            completion_logprobs(model, groups)
        reference_used = set(used)
    finally:
        for h in hooks:
            h.remove()
    assert policy_used == reference_used
    assert reference_used <= base_ptrs
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == len(list(model.parameters()))  # nothing duplicated or shared oddly
    assert {p.data_ptr() for n, p in model.named_parameters() if "lora_" not in n} == base_ptrs
