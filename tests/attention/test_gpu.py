"""FlexAttention and flash-attn backends on a real GPU: forward and backward against padded."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from sp_models import UNEQUAL, grads_of, make_model, max_grad_diff, random_groups

from periodic_rl.attention import completion_logprobs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU: FlexAttention has no CPU backward; flash-attn needs CUDA",
    ),
]


@pytest.fixture(scope="module")
def groups():
    return random_groups(4, UNEQUAL + [(40, [33, 17, 64, 5])])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_flex_matches_padded_fp32(arch, groups):
    extra = {"attn_logit_softcapping": 20.0} if arch == "gemma2" else {}
    model = make_model(arch, **extra).cuda()
    if extra:
        model.set_attn_implementation("eager")  # transformers' sdpa ignores softcap: bad reference
    ref_grads = grads_of(model, lambda: completion_logprobs(model, groups, shared_prompt=False)[0])
    grads = grads_of(model, lambda: completion_logprobs(model, groups, backend="flex")[0])
    with torch.no_grad():
        ref, _ = completion_logprobs(model, groups, shared_prompt=False)
        logps, _ = completion_logprobs(model, groups, backend="flex")
    # TF32 may be on for matmuls: a looser bound than the CPU tests' 1e-5
    assert (logps - ref).abs().max().item() < 1e-3
    assert max_grad_diff(grads, ref_grads) < 1e-2


@pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is None, reason="flash-attn not installed"
)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_flash_matches_padded_bf16(arch, groups):
    model = make_model(arch).cuda().to(torch.bfloat16)
    ref_grads = grads_of(model, lambda: completion_logprobs(model, groups, shared_prompt=False)[0])
    grads = grads_of(model, lambda: completion_logprobs(model, groups, backend="flash")[0])
    with torch.no_grad():
        ref, _ = completion_logprobs(model, groups, shared_prompt=False)
        logps, _ = completion_logprobs(model, groups, backend="flash")
        auto, _ = completion_logprobs(model, groups)  # auto picks flash on CUDA + bf16
    assert (logps - ref).abs().max().item() < 0.1  # bf16 rounding, not layout errors
    assert torch.equal(auto, logps)
    rel = max_grad_diff(grads, ref_grads) / max(g.abs().max().item() for g in ref_grads.values())
    assert rel < 0.05
