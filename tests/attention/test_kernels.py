"""Backend kernels against a naive per-sequence reference, directly on q/k/v (no model)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from periodic_rl.attention import BACKENDS, AttentionOptions, SharedPromptLayout, pack_groups
from periodic_rl.attention.backends import select_backend

LAYOUT = ([6, 3, 9], [[4, 1, 7], [5], [2, 6]])
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def naive(q, k, v, layout: SharedPromptLayout, opt: AttentionOptions) -> torch.Tensor:
    """Each response as its own sequence [prompt | response], plain causal softmax attention."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[-1]
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scale = opt.scaling if opt.scaling is not None else dim**-0.5
    out = torch.zeros(q.shape[2], heads, dim, dtype=torch.float32)

    def attend(qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        s = torch.einsum("hqd,hkd->hqk", q[0][:, qi].float(), k[0][:, ki].float()) * scale
        if opt.softcap is not None:
            s = torch.tanh(s / opt.softcap) * opt.softcap
        causal = torch.ones(len(qi), len(ki), dtype=torch.bool).tril(len(ki) - len(qi))
        s = s.masked_fill(~causal, float("-inf"))
        return torch.einsum("hqk,hkd->qhd", s.softmax(-1), v[0][:, ki].float())

    prompt = None
    for start, length, _, kind in layout.segments():
        own = torch.arange(start, start + length)
        if kind == 0:
            prompt = own
            out[own] = attend(own, own)
        else:
            out[own] = attend(own, torch.cat([prompt, own]))
    return out.unsqueeze(0)


def qkv(layout: SharedPromptLayout, heads=4, kv_heads=2, dim=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = layout.total_len
    shapes = [(1, heads, n, dim), (1, kv_heads, n, dim), (1, kv_heads, n, dim)]
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]


@pytest.mark.parametrize("backend", ["sdpa", "split", "flex"])
@pytest.mark.parametrize("kv_heads,scaling", [(4, None), (2, 0.3), (1, None)])
def test_backend_matches_naive(backend, kv_heads, scaling):
    layout = SharedPromptLayout(*LAYOUT, backend=backend)
    q, k, v = qkv(layout, kv_heads=kv_heads)
    opt = AttentionOptions(scaling=scaling)
    expected = naive(q, k, v, layout, opt)
    if backend == "flex":
        got = BACKENDS[backend].fn(q.detach(), k.detach(), v.detach(), layout, opt)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        return
    got = BACKENDS[backend].fn(q, k, v, layout, opt)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    w = torch.randn_like(expected)
    grads = torch.autograd.grad((got * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((expected * w).sum(), (q, k, v))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "split"])
@pytest.mark.parametrize("autocast", [False, True])
def test_cpu_half_precision_attends_in_float32(backend, autocast, monkeypatch):
    """bf16 in (a bf16 model, or autocast, where RoPE leaves q and k in float32): torch's CPU
    kernel is called in float32 with autocast off (half precision is 2-3x slower there), and
    the output comes back in the dtype SDPA would have returned."""
    import periodic_rl.attention.backends as backends

    seen = []
    sdpa = backends.F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype, torch.is_autocast_enabled("cpu")))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(backends.F, "scaled_dot_product_attention", spy)
    layout = SharedPromptLayout(*LAYOUT, backend=backend)
    q, k, v = qkv(layout, dtype=torch.bfloat16)
    opt = AttentionOptions()
    if autocast:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = BACKENDS[backend].fn(q.float(), k.float(), v, layout, opt)
    else:
        got = BACKENDS[backend].fn(q, k, v, layout, opt)
    assert seen and all(s == (torch.float32,) * 3 + (False,) for s in seen), seen
    assert got.dtype == torch.bfloat16
    expected = naive(q, k, v, layout, opt).to(torch.bfloat16)
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)
    grads = torch.autograd.grad(got.float().sum(), (q, k, v))
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3


def test_flex_softcap_forward():
    layout = SharedPromptLayout(*LAYOUT, backend="flex")
    q, k, v = (x.detach() * 4 for x in qkv(layout))
    opt = AttentionOptions(softcap=2.0)
    with torch.no_grad():
        got = BACKENDS["flex"].fn(q, k, v, layout, opt)
    torch.testing.assert_close(got, naive(q, k, v, layout, opt), atol=1e-5, rtol=1e-5)


def _fake_flash_attn_varlen_func(
    q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False, softcap=0.0
):
    """flash-attn's documented semantics in plain torch: per segment, causal bottom-right."""
    assert causal and dropout_p == 0.0 and q.dtype in (torch.float16, torch.bfloat16)
    out = torch.empty_like(q)
    rep = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        assert cu_q[i + 1] - cu_q[i] <= max_q and cu_k[i + 1] - cu_k[i] <= max_k
        qi, ki = q[qs].float(), k[ks].float().repeat_interleave(rep, 1)
        vi = v[ks].float().repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", qi, ki) * softmax_scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        lq, lk = qi.shape[0], ki.shape[0]
        s = s.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq), float("-inf"))
        out[qs] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vi).to(q.dtype)
    return out


def test_flash_varlen_boundaries_and_key_gather(monkeypatch):
    """The flash backend's cu_seqlens/key gather, checked with a pure-torch stand-in kernel."""
    monkeypatch.setitem(
        sys.modules,
        "flash_attn",
        types.SimpleNamespace(flash_attn_varlen_func=_fake_flash_attn_varlen_func),
    )
    layout = SharedPromptLayout(*LAYOUT, backend="flash")
    q, k, v = (x.detach() for x in qkv(layout, dtype=torch.bfloat16))
    for softcap in (None, 1.5):
        opt = AttentionOptions(scaling=0.35, softcap=softcap)
        got = BACKENDS["flash"].fn(q, k, v, layout, opt).float()
        torch.testing.assert_close(got, naive(q, k, v, layout, opt), atol=2e-2, rtol=2e-2)
    with pytest.raises(TypeError, match="fp16/bf16"):
        BACKENDS["flash"].fn(q.float(), k.float(), v.float(), layout, AttentionOptions())


def test_layout_geometry_and_positions():
    layout = SharedPromptLayout([3, 2], [[2, 1], [3]])
    assert layout.total_len == 11 and layout.max_span == 5
    assert layout.position_ids().tolist() == [[0, 1, 2, 3, 4, 3, 0, 1, 2, 3, 4]]
    assert [s[:2] for s in layout.segments()] == [(0, 3), (3, 2), (5, 1), (6, 2), (8, 3)]
    dense = layout.dense_mask(torch.device("cpu"), torch.float32)[0, 0] == 0
    assert dense[5, :3].all() and not dense[5, 3:5].any() and dense[5, 5]  # r2 sees p, not r1
    assert not dense[6:, :6].any()  # the second group sees nothing of the first


def test_pack_groups_rows_point_at_the_predicting_token():
    groups = [([10, 11, 12], [[20, 21], [30]]), ([40], [[50, 51, 52]])]
    batch = pack_groups(groups)
    assert batch.input_ids.tolist() == [[10, 11, 12, 20, 21, 30, 40, 50, 51, 52]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1, 2, 3]]
    kept = batch.logits_to_keep[batch.rows]  # sequence position predicting each target
    assert kept[0, :2].tolist() == [2, 3]  # 20 from the last prompt token, 21 from 20
    assert kept[1, 0].item() == 2  # 30: also from the shared last prompt token
    assert kept[2].tolist() == [6, 7, 8]
    assert batch.targets.tolist() == [[20, 21, 0], [30, 0, 0], [50, 51, 52]]


def test_backend_selection():
    cpu = torch.device("cpu")
    assert select_backend("auto", cpu, torch.float32, needs_backward=True).name == "split"
    with pytest.raises(NotImplementedError, match="no CPU backward"):
        select_backend("flex", cpu, torch.float32, needs_backward=True)
    with pytest.raises(RuntimeError, match="CUDA"):
        select_backend("flash", cpu, torch.bfloat16, needs_backward=False)
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("nope", cpu, torch.float32, needs_backward=False)


def test_selected_logprobs_gradcheck():
    """The chunked log-softmax gather (repeated rows: a shared prompt row read by G targets)."""
    from periodic_rl.attention import logprobs

    x = torch.randn(150, 7, dtype=torch.float64, requires_grad=True)  # > one chunk of rows
    rows = torch.tensor([0, 0, 0, 5, 149, 70])
    targets = torch.tensor([1, 2, 2, 6, 0, 3])
    picked, entropy = logprobs._SelectedLogProbs.apply(x, rows, targets, True)
    ref = x.log_softmax(-1)
    torch.testing.assert_close(picked, ref[rows, targets])
    torch.testing.assert_close(entropy, -(ref.exp() * ref).sum(-1))
    assert torch.autograd.gradcheck(
        lambda t: logprobs._SelectedLogProbs.apply(t, rows, targets, False)[0], (x,)
    )
