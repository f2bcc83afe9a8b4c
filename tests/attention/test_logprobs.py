"""Packed (shared-prompt) log-probs and gradients equal the padded forward's, per architecture."""

from __future__ import annotations

import pytest
import torch
from sp_models import UNEQUAL, grads_of, make_model, max_grad_diff, random_groups

from periodic_rl.attention import completion_logprobs, pack_groups

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2"]
ATOL = 1e-5


@pytest.fixture(scope="module")
def groups():
    return random_groups(0, UNEQUAL)


def test_padded_path_matches_one_forward_per_completion(groups):
    """The reference itself: padded rows give what an unpadded single-sequence forward gives."""
    model = make_model("llama")
    logps, mask = completion_logprobs(model, groups, shared_prompt=False, pad_token_id=5)
    n = 0
    with torch.no_grad():
        for prompt, completions in groups:
            for c in completions:
                ids = torch.tensor([prompt + c])
                logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
                expected = logits.log_softmax(-1).gather(-1, torch.tensor(c)[:, None])[:, 0]
                torch.testing.assert_close(logps[n, : len(c)], expected, atol=ATOL, rtol=0)
                assert mask[n].sum() == len(c) and (logps[n, len(c) :] == 0).all()
                n += 1
    assert logps.dtype == torch.float32 and logps.shape == (9, 9)


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_equals_padded_logps_and_grads(arch, groups):
    model = make_model(arch)
    ref_grads = grads_of(model, lambda: completion_logprobs(model, groups, shared_prompt=False)[0])
    with torch.no_grad():
        ref, ref_mask = completion_logprobs(model, groups, shared_prompt=False)
    for backend in ("sdpa", "split"):
        logps, mask = completion_logprobs(model, groups, backend=backend)
        assert torch.equal(mask, ref_mask)
        diff = (logps - ref).abs().max().item()
        assert diff < ATOL, f"{arch}/{backend}: max |packed - padded| = {diff:.2e}"
        grads = grads_of(model, lambda b=backend: completion_logprobs(model, groups, backend=b)[0])
        gdiff = max_grad_diff(grads, ref_grads)
        assert gdiff < 2e-5, f"{arch}/{backend}: max grad diff {gdiff:.2e}"


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_flex_forward_on_cpu_matches(arch, groups):
    """FlexAttention runs forward on the CPU (no backward there): check its mask logic."""
    model = make_model(arch)
    with torch.no_grad():
        ref, _ = completion_logprobs(model, groups, shared_prompt=False)
        logps, _ = completion_logprobs(model, groups, backend="flex")
    assert (logps - ref).abs().max().item() < ATOL


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_applies_attention_softcapping(groups):
    """Gemma 2 softcapping: flex (forward on the CPU) against the eager padded reference."""
    model = make_model("gemma2", attn_logit_softcapping=0.5)
    model.set_attn_implementation("eager")  # transformers' sdpa silently ignores softcap
    with torch.no_grad():
        ref, _ = completion_logprobs(model, groups, shared_prompt=False)
        logps, _ = completion_logprobs(model, groups, backend="flex")
    assert (logps - ref).abs().max().item() < ATOL


def test_flex_refuses_cpu_backward(groups):
    model = make_model("llama")
    with pytest.raises(NotImplementedError, match="no CPU backward"):
        completion_logprobs(model, groups, backend="flex")


def test_entropy_matches_padded(groups):
    model = make_model("qwen2")
    with torch.no_grad():
        _, mask, ref = completion_logprobs(model, groups, shared_prompt=False, return_entropy=True)
        lp, _, ent = completion_logprobs(model, groups, backend="split", return_entropy=True)
    assert (ent - ref).abs().max().item() < ATOL
    assert (ent[mask > 0] > 0).all() and (ent[mask == 0] == 0).all()
    assert not ent.requires_grad and lp.shape == ent.shape


def test_auto_backend_on_cpu_is_split_and_projects_only_needed_rows(groups):
    batch = pack_groups(groups)
    # tokens: every prompt once + every completion; rows: one per group + (len - 1) per completion
    assert batch.input_ids.shape == (1, sum(len(p) + sum(map(len, cs)) for p, cs in groups))
    assert batch.logits_to_keep.numel() == len(groups) + sum(
        len(c) - 1 for _, cs in groups for c in cs
    )
    model = make_model("llama")
    with torch.no_grad():
        auto, _ = completion_logprobs(model, groups)
        split, _ = completion_logprobs(model, groups, backend="split")
    assert torch.equal(auto, split)


def test_empty_completions_and_groups_are_masked():
    groups = random_groups(3, [(5, [4, 0, 2]), (3, [0])])
    model = make_model("llama")
    with torch.no_grad():
        ref, mask = completion_logprobs(model, groups, shared_prompt=False)
        logps, mask2 = completion_logprobs(model, groups)
    assert torch.equal(mask, mask2) and mask.sum(-1).tolist() == [4, 0, 2, 0]
    assert (logps - ref).abs().max().item() < ATOL


def test_config_is_restored_and_plain_forwards_unchanged(groups):
    model = make_model("llama")
    before = model.config._attn_implementation
    ids = torch.tensor([groups[0][0]])
    with torch.no_grad():
        plain = model(ids).logits
        completion_logprobs(model, groups)
        after = model(ids).logits
    assert model.config._attn_implementation == before
    assert torch.equal(plain, after)


def test_gradient_checkpointing_needs_the_session(groups):
    from periodic_rl.attention import shared_prompt_attention

    model = make_model("llama")
    model.gradient_checkpointing_enable()
    model.train()
    ref = grads_of(model, lambda: completion_logprobs(model, groups, shared_prompt=False)[0])
    with pytest.raises(RuntimeError, match="gradient checkpointing"):
        completion_logprobs(model, groups)
    with shared_prompt_attention(model):
        grads = grads_of(model, lambda: completion_logprobs(model, groups)[0])
        # an ordinary padded forward inside the session still gets its usual masks
        inside = grads_of(model, lambda: completion_logprobs(model, groups, shared_prompt=False)[0])
    assert max_grad_diff(grads, ref) < 2e-5
    assert max_grad_diff(inside, ref) < 1e-6


@pytest.mark.pretrained
def test_smollm2_packed_equals_padded(smollm2_path):
    """The real SmolLM2-135M (30 layers, 9 query / 3 KV heads, tied embeddings)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    prompt = tok("What is 17 + 25? Answer briefly.")["input_ids"]
    replies = [tok(t)["input_ids"] for t in (" 42.", " It is 42, because 17 + 25 = 42.", " 32")]
    groups = [(prompt, replies), (tok("Name a colour.")["input_ids"], replies[:2])]
    with torch.no_grad():
        ref, _ = completion_logprobs(model, groups, shared_prompt=False)
        logps, _ = completion_logprobs(model, groups)
    # 30 fp32 layers, different summation order: measured 9.5e-6 on the tiny test batch
    assert (logps - ref).abs().max().item() < 2 * ATOL
