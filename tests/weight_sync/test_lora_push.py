"""LoRA adapter pushes: the payload, its size, and a merge bit-identical to policy_state_dict."""

from __future__ import annotations

import pytest
import torch
from lora_helpers import QV, peft_policy

from periodic_rl.weight_sync.export import (
    A_SUFFIX,
    SCALE_SUFFIX,
    adapted_names,
    lora_adapter_payload,
    lora_base_state_dict,
    payload_bytes,
    policy_state_dict,
)
from periodic_rl.weight_sync.fingerprint import adapter_fingerprint, weights_fingerprint
from periodic_rl.weight_sync.merge import merge_lora


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits (tells -0.0 from +0.0, unlike ``torch.equal``)."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return tensor.view(ints[tensor.element_size()])


@pytest.mark.parametrize(
    ("dtype", "targets"),
    [(torch.float32, QV), (torch.float32, "all-linear"), (torch.bfloat16, "all-linear")],
    ids=["fp32-qv", "fp32-all-linear", "bf16-all-linear"],
)
def test_merge_of_the_base_is_bit_identical_to_policy_state_dict(tiny_llama_path, dtype, targets):
    policy = peft_policy(tiny_llama_path, dtype, target_modules=targets)
    payload = lora_adapter_payload(policy)
    assert payload is not None
    base = lora_base_state_dict(policy)
    full = policy_state_dict(policy)
    merged = merge_lora(base, payload)
    assert base.keys() == full.keys() and "lm_head.weight" not in full  # tied: dropped
    assert sorted(merged) == adapted_names(payload) and merged
    max_diff = 0.0
    for name, expected in full.items():
        got = merged.get(name, base[name])
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(bits(got), bits(expected)), name
        max_diff = max(max_diff, (got.float() - expected.float()).abs().max().item())
    assert max_diff == 0.0
    assert all(not torch.equal(merged[name], base[name]) for name in merged)  # a real delta
    buffers: dict = {}  # the workers' path: merged into kept buffers, push after push
    for _ in range(2):
        reused = merge_lora(base, payload, buffers)
        assert all(torch.equal(bits(reused[n]), bits(full[n])) for n in merged)
    assert all(any(reused[n] is b for b in buffers.values()) for n in reused)


def test_adapter_payload_is_small_and_laid_out_by_weight_name(tiny_llama_path):
    policy = peft_policy(tiny_llama_path)
    payload = lora_adapter_payload(policy)
    full = policy_state_dict(policy)
    ratio = payload_bytes(payload) / payload_bytes(full)
    assert ratio < 1e-2, ratio  # ~7 KB of ~13 MB for this model
    expected = sorted(f"model.layers.{i}.self_attn.{m}.weight" for i in range(2) for m in QV)
    assert adapted_names(payload) == expected
    name = expected[0]
    assert payload[name + SCALE_SUFFIX].dtype == torch.float64
    assert payload[name + SCALE_SUFFIX].item() == 2.0  # lora_alpha / r
    assert payload[name + A_SUFFIX].shape == (4, full[name].shape[1])
    # Copies: a later optimizer step does not change a payload already taken.
    before = {k: v.clone() for k, v in payload.items()}
    with torch.no_grad():
        for param in policy.parameters():
            if param.requires_grad:
                param.add_(1.0)
    assert all(torch.equal(payload[k], before[k]) for k in payload)


def test_adapter_fingerprint_tells_bases_and_adapters_apart(tiny_llama_path):
    payload = lora_adapter_payload(peft_policy(tiny_llama_path))
    other = {k: v + 1 if k.endswith(A_SUFFIX) else v for k, v in payload.items()}
    fp = adapter_fingerprint("base-1", payload)
    assert fp == adapter_fingerprint("base-1", {k: v.clone() for k, v in payload.items()})
    assert fp != adapter_fingerprint("base-2", payload)
    assert fp != adapter_fingerprint("base-1", other)
    assert fp != weights_fingerprint(payload)


@pytest.mark.parametrize(
    "lora",
    [
        {"use_dora": True},
        {"lora_bias": True},
        {"modules_to_save": ["lm_head"]},
        {"target_modules": [*QV, "embed_tokens"]},  # an Embedding LoRA layer
    ],
    ids=["dora", "lora-bias", "modules-to-save", "embedding"],
)
def test_adapters_the_merge_cannot_reproduce_give_none(tiny_llama_path, lora):
    assert lora_adapter_payload(peft_policy(tiny_llama_path, **lora)) is None


def test_no_peft_or_trainable_base_gives_none(tiny_llama_path):
    from periodic_rl.models import load_causal_lm

    assert lora_adapter_payload(load_causal_lm(tiny_llama_path)) is None
    policy = peft_policy(tiny_llama_path)
    policy.get_base_model().model.norm.weight.requires_grad_(True)  # would change unpushed
    assert lora_adapter_payload(policy) is None


def test_merge_checks_names_and_shapes(tiny_llama_path):
    policy = peft_policy(tiny_llama_path)
    payload = lora_adapter_payload(policy)
    base = lora_base_state_dict(policy)
    name = adapted_names(payload)[0]
    with pytest.raises(KeyError, match="lack"):
        merge_lora({k: v for k, v in base.items() if k != name}, payload)
    with pytest.raises(ValueError, match="does not fit"):
        merge_lora({**base, name: base[name][:-1]}, payload)
