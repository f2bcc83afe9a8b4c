"""Attention kernels for a packed shared-prompt row, and the registry that picks one.

Every backend computes the same thing: for a packed row ``[prompt | r1 | ... | rG]`` (several
groups back to back), prompt tokens attend causally to their prompt, response tokens attend to the
whole prompt of their group and causally to their own response. They differ in cost:

- ``sdpa``: one SDPA call with a dense ``L x L`` float additive mask. O(L^2) memory; the simple
  correctness reference. Any device, forward and backward.
- ``split``: prompts attend causally among themselves (one batched SDPA, ``is_causal``);
  responses attend to ``[prompt keys ; own keys]`` gathered per response, with a small
  ``Rmax x (Pmax + Rmax)`` mask (causal aligned bottom-right). No ``L x L`` anything. Any device,
  forward and backward. The default off-GPU.
- ``flex``: FlexAttention with a block mask (``mask_mod`` on segment ids). CUDA for training
  (torch 2.13 has no CPU backward); CPU forward works and is used in tests.
- ``flash``: flash-attn ``flash_attn_varlen_func`` with separate query/key boundaries and a key
  gather. CUDA, fp16/bf16, when ``flash_attn`` is installed. The default on GPU when present.

A backend takes ``q [1, H, L, D]`` and ``k, v [1, Hkv, L, D]`` (transformers' layout, after RoPE)
and returns ``[1, L, H, D]`` (what transformers' attention functions return).

On the CPU, ``sdpa`` and ``split`` compute in float32 when given bf16/fp16 (a bf16 model, or
autocast) and cast the output back: torch's CPU attention kernels run half precision slower than
float32, and float32 is the more exact of the two.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, wraps
from typing import Literal

import torch
import torch.nn.functional as F

from periodic_rl.attention.layout import SharedPromptLayout


@dataclass(frozen=True)
class AttentionOptions:
    """Per-call settings forwarded by the model's attention module."""

    scaling: float | None = None
    dropout: float = 0.0
    softcap: float | None = None


BackendFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, SharedPromptLayout, AttentionOptions], torch.Tensor
]


@dataclass(frozen=True)
class AttentionBackend:
    """A registered kernel and what it can do (checked before it is used, never silently skipped).

    Attributes:
        name: registry key (``backend=`` argument of ``completion_logprobs``).
        fn: the kernel, see the module docstring for shapes.
        unavailable: returns why the backend cannot run on ``device`` (None when it can).
        softcap: supports attention-logit softcapping (Gemma 2).
        dropout: supports attention dropout.
        cpu_backward: has a backward pass on the CPU.
    """

    name: str
    fn: BackendFn
    unavailable: Callable[[torch.device], str | None]
    softcap: bool = False
    dropout: bool = True
    cpu_backward: bool = True


BACKENDS: dict[str, AttentionBackend] = {}
#: The backends that ship with the library, and ``auto``; :func:`register_backend` adds more.
BuiltinBackend = Literal["auto", "sdpa", "split", "flex", "flash"]


def register_backend(backend: AttentionBackend) -> AttentionBackend:
    """Add (or replace) a backend in the registry; returns it so it can be used as a value."""
    BACKENDS[backend.name] = backend
    return backend


def _any_device(device: torch.device) -> str | None:
    return None


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
    """SDPA with grouped-query heads: native ``enable_gqa`` on the CPU (its flash kernel takes it
    with a mask, and faster than repeating K/V), repeated K/V elsewhere (CUDA's
    memory-efficient kernel, the one that takes a mask, has no GQA)."""
    rep = q.shape[1] // k.shape[1]
    native = rep > 1 and q.device.type == "cpu"
    if rep > 1 and not native:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=native, **kwargs)


HALF = (torch.bfloat16, torch.float16)


def cpu_float32(fn: BackendFn) -> BackendFn:
    """``fn`` computing in float32 on the CPU when given half precision or called under autocast,
    its output in the dtype SDPA would have returned (the module docstring says why); autocast
    is off inside, or it would cast the inputs back down."""

    @wraps(fn)
    def wrapped(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: SharedPromptLayout,
        opt: AttentionOptions,
    ) -> torch.Tensor:
        if q.device.type != "cpu":
            return fn(q, k, v, layout, opt)
        if torch.is_autocast_enabled("cpu"):  # q, k leave RoPE in float32, v in autocast's dtype
            dtype = torch.get_autocast_dtype("cpu")
        elif q.dtype in HALF:
            dtype = q.dtype
        else:
            return fn(q, k, v, layout, opt)
        with torch.autocast("cpu", enabled=False):
            out = fn(q.float(), k.float(), v.float(), layout, opt)
        return out.to(dtype)

    return wrapped


@cpu_float32
def _sdpa_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: SharedPromptLayout,
    opt: AttentionOptions,
) -> torch.Tensor:
    """Reference: the whole packed row against a dense ``L x L`` float additive mask."""
    mask = layout.dense_mask(q.device, q.dtype)
    out = _sdpa(q, k, v, attn_mask=mask, dropout_p=opt.dropout, scale=opt.scaling)
    return out.transpose(1, 2)


@cpu_float32
def _split(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: SharedPromptLayout,
    opt: AttentionOptions,
) -> torch.Tensor:
    """Prompts causal among themselves; each response against [its prompt ; itself] (gathered).

    Two batched SDPA calls per layer whatever the number of groups; the only masks are
    ``N x Rmax x (Pmax + Rmax)``. The prompt's keys are copied per response, not recomputed.
    """
    idx = layout.split_indices(q.device, q.dtype)
    # token-major views [L, H, D]; index_select along tokens gives contiguous gathers
    qt, kt, vt = (x[0].transpose(0, 1) for x in (q, k, v))
    heads, dim = qt.shape[1], qt.shape[2]

    def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        # [B, S] token indices -> [B, heads, S, D]
        return (
            x.index_select(0, index.reshape(-1)).view(*index.shape, x.shape[1], dim).transpose(1, 2)
        )

    pq = idx["prompt_q"]
    out_prompt = _sdpa(
        take(qt, pq),
        take(kt, pq),
        take(vt, pq),
        dropout_p=opt.dropout,
        is_causal=True,  # prompts are right padded: real queries never see the padding
        scale=opt.scaling,
    )
    out_resp = _sdpa(
        take(qt, idx["resp_q"]),
        take(kt, idx["resp_kv"]),
        take(vt, idx["resp_kv"]),
        attn_mask=idx["resp_mask"],
        dropout_p=opt.dropout,
        scale=opt.scaling,
    )
    flat = torch.cat(
        [
            out_prompt.transpose(1, 2).reshape(-1, heads, dim),
            out_resp.transpose(1, 2).reshape(-1, heads, dim),
        ]
    )
    return flat.index_select(0, idx["inverse"]).unsqueeze(0)


# ---- FlexAttention ----------------------------------------------------------------------------


def _flex_unavailable(device: torch.device) -> str | None:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:  # pragma: no cover - torch < 2.5
        return "torch.nn.attention.flex_attention is not available in this torch"
    return None


@cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    # default dynamic=None: the first new sequence length recompiles with dynamic shapes, later
    # ones reuse that graph (every micro-batch has its own packed length)
    return torch.compile(flex_attention)


def _flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: SharedPromptLayout,
    opt: AttentionOptions,
) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if q.device.type == "cpu" and torch.is_grad_enabled() and q.requires_grad:
        raise NotImplementedError(
            "backend 'flex': FlexAttention has no CPU backward in torch 2.13; use backend='split' "
            "(or 'sdpa') on the CPU, or run under torch.no_grad()"
        )

    def build():  # noqa: ANN202 - BlockMask
        seg, pseg = layout.segment_ids(q.device)

        def mask_mod(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202 - traced by flex
            same = (seg[kv_idx] == seg[q_idx]) | (seg[kv_idx] == pseg[q_idx])
            return same & (kv_idx <= q_idx)

        n = layout.total_len
        return create_block_mask(mask_mod, 1, None, n, n, device=q.device, _compile=q.is_cuda)

    block_mask = layout.cached(("flex_block_mask", q.device), build)
    score_mod = None
    if opt.softcap is not None:
        cap = float(opt.softcap)

        def score_mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
            return torch.tanh(score / cap) * cap

    attend = _compiled_flex() if q.is_cuda else flex_attention
    out = attend(
        q, k, v, score_mod=score_mod, block_mask=block_mask, scale=opt.scaling, enable_gqa=True
    )
    return out.transpose(1, 2)


# ---- flash-attn varlen ------------------------------------------------------------------------


def _flash_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "flash-attn needs a CUDA device"
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed (pip install flash-attn)"
    return None


def _flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: SharedPromptLayout,
    opt: AttentionOptions,
) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(
            f"backend 'flash': flash-attn computes in fp16/bf16 only, got {q.dtype}; "
            "load the model in bf16, use torch.autocast, or choose backend='flex'/'split'"
        )
    meta = layout.varlen_indices(q.device)
    qt = q[0].transpose(0, 1)  # [L, H, D]
    kt = k[0].transpose(0, 1).index_select(0, meta["kv_index"])  # [sum k_len, Hkv, D]
    vt = v[0].transpose(0, 1).index_select(0, meta["kv_index"])
    extra = {} if opt.softcap is None else {"softcap": float(opt.softcap)}  # flash-attn >= 2.6
    out = flash_attn_varlen_func(
        qt.contiguous(),
        kt,
        vt,
        meta["cu_seqlens_q"],
        meta["cu_seqlens_k"],
        meta["max_seqlen_q"],
        meta["max_seqlen_k"],
        dropout_p=opt.dropout,
        softmax_scale=opt.scaling,
        causal=True,  # bottom-right aligned when k_len > q_len (flash-attn >= 2.1)
        **extra,
    )
    return out.unsqueeze(0)


register_backend(AttentionBackend("sdpa", _sdpa_dense, _any_device))
register_backend(AttentionBackend("split", _split, _any_device))
register_backend(
    AttentionBackend(
        "flex", _flex, _flex_unavailable, softcap=True, dropout=False, cpu_backward=False
    )
)
register_backend(AttentionBackend("flash", _flash, _flash_unavailable, softcap=True))


def select_backend(
    requested: str, device: torch.device, dtype: torch.dtype, *, needs_backward: bool
) -> AttentionBackend:
    """Resolve ``requested`` ("auto" or a registry name) to a backend that can run here.

    ``auto``: on CUDA, ``flash`` when flash-attn is installed and the model is fp16/bf16, else
    ``flex``; elsewhere ``split``. An explicit name that cannot run raises with the reason.
    """
    device = torch.device(device)
    if requested == "auto":
        if device.type == "cuda":
            if _flash_unavailable(device) is None and dtype in (torch.float16, torch.bfloat16):
                return BACKENDS["flash"]
            if _flex_unavailable(device) is None:
                return BACKENDS["flex"]
        return BACKENDS["split"]
    if requested not in BACKENDS:
        raise ValueError(f"unknown attention backend {requested!r}; choose from {sorted(BACKENDS)}")
    backend = BACKENDS[requested]
    reason = backend.unavailable(device)
    if reason is not None:
        raise RuntimeError(f"attention backend {requested!r} cannot run on {device}: {reason}")
    if needs_backward and device.type == "cpu" and not backend.cpu_backward:
        raise NotImplementedError(
            f"attention backend {requested!r} has no CPU backward (FlexAttention in torch 2.13); "
            "use backend='split' or 'sdpa' for training on the CPU"
        )
    return backend


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Names of the registered backends that can run on ``device``."""
    device = torch.device(device)
    return [name for name, b in BACKENDS.items() if b.unavailable(device) is None]
