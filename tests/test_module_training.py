"""RLModule training options end to end (tiny model, in-process HF engine, plain SGD): the KL
penalty to a reference, gradient checkpointing, and a bfloat16 policy."""

from __future__ import annotations

import pytest
import torch
from rl_helpers import ORDER_TOLERANCE, max_diff, train

from periodic_rl import RLModule
from periodic_rl.weight_sync.fingerprint import weights_fingerprint

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


def initial_parameters(model_path: str, **kwargs) -> dict[str, torch.Tensor]:
    module = RLModule(model=model_path, **kwargs)
    module.configure_model()
    return {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("lora", [None, LORA], ids=["reference-copy", "lora-disabled-adapter"])
def test_kl_to_the_reference_is_zero_until_the_policy_moves(tiny_llama_path, lora):
    """``beta > 0``: the reference is a frozen second copy (full fine-tuning) or the policy with
    its LoRA adapter disabled. At the first iteration policy and reference are the same model:
    the KL and its gradient are exactly 0, so the first step equals the ``beta = 0`` one. After
    it the KL is positive and changes the second step."""
    kwargs = dict(steps=2, lora=lora, learning_rate=0.5 if lora is None else 2.0)
    with_kl, module, _ = train(tiny_llama_path, beta=1.0, **kwargs)
    without, plain, _ = train(tiny_llama_path, beta=0.0, **kwargs)
    first, second = module.records
    assert (module.reference is None) == (lora is not None)  # LoRA needs no second copy
    assert first.loss["kl_sum"] == 0.0
    assert second.loss["kl_sum"] / second.loss["tokens"] > 1e-3
    assert "kl_sum" not in plain.records[0].loss  # beta = 0: no reference forward at all
    assert first.pushed == plain.records[0].pushed  # the same first step, bit for bit
    assert max_diff(with_kl, without) > 1e-4  # the KL term changed the second step


def test_gradient_checkpointing_takes_the_same_step(tiny_llama_path):
    """With packed shared-prompt forwards (the default), whose attention must stay packed
    through the recomputation in the backward."""
    kwargs = dict(steps=1, shared_prompt=True)
    checkpointed, module, _ = train(tiny_llama_path, gradient_checkpointing=True, **kwargs)
    plain, _, _ = train(tiny_llama_path, **kwargs)
    assert module.policy.is_gradient_checkpointing
    assert max_diff(plain, initial_parameters(tiny_llama_path)) > 1e-3  # it did move
    assert max_diff(checkpointed, plain) <= ORDER_TOLERANCE


def test_bfloat16_policy_trains_close_to_float32(tiny_llama_path):
    """A bf16 policy (the fp32 engine holds its weights widened, exactly) samples the same
    completions here and takes nearly the fp32 step; its pushes are confirmed and its
    rollouts pass the on-policy check."""
    bf16, module, run = train(tiny_llama_path, dtype="bfloat16")
    fp32, reference, _ = train(tiny_llama_path)
    assert all(p.dtype == torch.bfloat16 and p.isfinite().all() for p in bf16.values())
    for record in module.records:
        assert record.stamps == [(record.version, record.fingerprint)] * len(record.order)
    assert run.weights_fingerprint == weights_fingerprint(module.rollout_state_dict())
    assert module.records[0].completions == reference.records[0].completions
    start = initial_parameters(tiny_llama_path)
    step16 = torch.cat([(bf16[n].float() - start[n]).flatten() for n in start])
    step32 = torch.cat([(fp32[n] - start[n]).flatten() for n in start])
    assert step16.norm() > 1e-2  # the weights moved
    assert torch.nn.functional.cosine_similarity(step16, step32, dim=0) > 0.99  # measured 0.997
    assert (step16 - step32).norm() / step32.norm() < 0.25  # measured 0.08
