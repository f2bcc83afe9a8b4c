"""Per-token log-probabilities of completions: the function the trainer calls.

``completion_logprobs(model, groups)`` encodes each prompt once per group (packed layout,
shared-prompt attention) and projects through ``lm_head`` only the hidden states that predict a
completion token (``logits_to_keep``). ``shared_prompt=False`` is the ordinary padded forward, the
reference both paths are tested against.

The model is called as a whole (``model(input_ids=..., logits_to_keep=...)``), not its decoder
plus ``lm_head`` by hand, so whatever the causal-LM head does (final-logit softcapping, logit
scaling, a peft wrapper's forward, ``disable_adapter()``) is kept.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Literal, overload

import torch

from periodic_rl.attention.backends import select_backend
from periodic_rl.attention.integration import (
    LAYOUT_KWARG,
    accepts_kwarg,
    check_layout_consumed,
    check_model_supported,
    is_shared_prompt_active,
    needs_checkpoint_session,
    refusals_name_the_model,
    shared_forward,
    shared_prompt_attention,
)
from periodic_rl.attention.packing import Group, ModelBatch, pack_groups, pad_groups
from periodic_rl.attention.support import ensure_exact

_CHUNK = 64  # rows of the [K, V] logits processed at a time (a few MiB: stays in cache)


def _model_device_dtype(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    weight = model.get_input_embeddings().weight
    dtype = weight.dtype
    if weight.device.type in ("cuda", "cpu") and torch.is_autocast_enabled(weight.device.type):
        dtype = torch.get_autocast_dtype(weight.device.type)
    return weight.device, dtype


def _needs_backward(model: torch.nn.Module) -> bool:
    return torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters())


class _SelectedLogProbs(torch.autograd.Function):
    """``log softmax(x)[rows, targets]`` for a few (row, target) pairs of ``x [K, V]``.

    Why not ``x.log_softmax(-1)[rows, targets]``: that materialises a second ``[K, V]`` tensor and
    its backward makes several full passes. Here the forward keeps only the per-row log-normaliser,
    and the backward writes ``-softmax(x) * (sum of row grads)`` plus the one-hot terms in one pass
    per chunk of rows (chunks stay in cache), far cheaper than ``logsumexp`` + autograd. The step is
    the same in both layouts, so this also keeps the packed/padded speed-up from being drowned by
    the vocab projection. Entropy comes out of the same pass, detached.
    """

    @staticmethod
    def forward(  # noqa: D102
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        rows: torch.Tensor,
        targets: torch.Tensor,
        want_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        work = torch.promote_types(x.dtype, torch.float32)  # fp32 math for bf16/fp16 logits
        lse = torch.empty(x.shape[0], dtype=work, device=x.device)
        entropy = torch.empty(x.shape[0] if want_entropy else 0, dtype=work, device=x.device)
        for lo in range(0, x.shape[0], _CHUNK):
            chunk = x[lo : lo + _CHUNK].to(work)
            chunk_lse = torch.logsumexp(chunk, dim=-1)
            lse[lo : lo + _CHUNK] = chunk_lse
            if want_entropy:
                probs = (chunk - chunk_lse[:, None]).exp_()
                entropy[lo : lo + _CHUNK] = chunk_lse - (probs * chunk).sum(-1)
        ctx.save_for_backward(x, lse, rows, targets)
        ctx.mark_non_differentiable(entropy)
        return x[rows, targets].to(work) - lse[rows], entropy

    @staticmethod
    def backward(  # noqa: D102
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor, _: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None]:
        x, lse, rows, targets = ctx.saved_tensors
        row_grad = torch.zeros_like(lse).index_add_(0, rows, grad.to(lse.dtype))
        grad_x = torch.empty_like(x)
        for lo in range(0, x.shape[0], _CHUNK):
            chunk = (x[lo : lo + _CHUNK].to(lse.dtype) - lse[lo : lo + _CHUNK, None]).exp_()
            chunk.mul_(-row_grad[lo : lo + _CHUNK, None])
            grad_x[lo : lo + _CHUNK] = chunk
        grad_x.index_put_((rows, targets), grad.to(grad_x.dtype), accumulate=True)
        return grad_x, None, None, None


def token_logprobs(
    logits: torch.Tensor, batch: ModelBatch, *, return_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gather ``log p(target)`` (float32, ``[N, T]``) from the projected rows ``logits [B, K, V]``.

    The log-normaliser is computed once per projected row (a shared prompt row is read by all G
    first tokens). Entropy, if asked for, is detached: it is logged, not trained on.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    rows, targets = batch.rows.reshape(-1), batch.targets.reshape(-1)
    picked, row_entropy = _SelectedLogProbs.apply(flat, rows, targets, return_entropy)
    picked, row_entropy = picked.float(), row_entropy.float()
    valid = batch.mask.reshape(-1) > 0
    logps = torch.where(valid, picked, torch.zeros_like(picked)).view_as(batch.mask)
    if not return_entropy:
        return logps, None
    entropy = torch.where(valid, row_entropy[rows], torch.zeros_like(picked))
    return logps, entropy.view_as(batch.mask)


def _forward(model: torch.nn.Module, batch: ModelBatch) -> torch.Tensor:
    kwargs = {}
    if batch.position_ids is not None:
        kwargs["position_ids"] = batch.position_ids
    if batch.layout is not None:
        kwargs[LAYOUT_KWARG] = batch.layout
    # a forward without the parameter (Whisper's, TrOCR's decoders) projects every position
    keep_in_forward = accepts_kwarg(model, "logits_to_keep")
    if keep_in_forward:
        kwargs["logits_to_keep"] = batch.logits_to_keep
    out = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False, **kwargs
    )
    logits = out.logits
    if not keep_in_forward and logits.shape[1] == batch.input_ids.shape[1]:
        logits = logits[:, batch.logits_to_keep]
    expected = (batch.input_ids.shape[0], batch.logits_to_keep.numel())
    if tuple(logits.shape[:2]) != expected:
        raise RuntimeError(
            f"{type(model).__name__} returned logits {tuple(logits.shape)}, expected {expected}: "
            "its forward does not honour a tensor logits_to_keep"
        )
    return logits


@overload
def completion_logprobs(
    model: torch.nn.Module,
    groups: list[Group],
    *,
    shared_prompt: bool = ...,
    backend: str = ...,
    pad_token_id: int = ...,
    temperature: float = ...,
    return_entropy: Literal[False] = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def completion_logprobs(
    model: torch.nn.Module,
    groups: list[Group],
    *,
    shared_prompt: bool = ...,
    backend: str = ...,
    pad_token_id: int = ...,
    temperature: float = ...,
    return_entropy: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def completion_logprobs(
    model: torch.nn.Module,
    groups: list[Group],
    *,
    shared_prompt: bool = True,
    backend: str = "auto",
    pad_token_id: int = 0,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Log-probabilities of every completion token given its prompt and preceding tokens.

    Args:
        model: a transformers causal LM (or a peft wrapper of one). Its current mode decides
            dropout; under ``torch.no_grad()`` / ``model.disable_adapter()`` this is the
            reference forward.
        groups: ``[(prompt_ids, [completion_ids_1, ..., completion_ids_G]), ...]``; G and the
            lengths may differ.
        shared_prompt: pack each group as ``[prompt | r1 | ... | rG]`` (prompt encoded once) with
            shared-prompt attention; False: one padded row per completion (the reference).
        backend: ``auto`` (flash / flex on CUDA, split elsewhere) or a name from
            :data:`periodic_rl.attention.BACKENDS` (``sdpa``, ``split``, ``flex``, ``flash``).
        pad_token_id: filler of the padded path (masked out, so its value does not matter).
        temperature: the log-probs (and entropy) are those of ``softmax(logits / temperature)``,
            the distribution the rollouts were sampled from; the policy gradient, the ratio and
            the KL then refer to that distribution (as in TRL, verl and OpenRLHF).
        return_entropy: also return the (detached) per-token entropy of the predictive
            distribution, ``[N, T]``, computed in the same pass over the projected logits.

    Returns:
        ``(logps, mask)`` (or ``(logps, mask, entropy)``), each ``[N, T]`` float32 with ``N`` the
        completions in group order and ``T`` the longest completion; 0 where ``mask`` is 0.

    Raises:
        SharedPromptUnsupportedError: the model's attention cannot take the packed layout
            (sliding window shorter than prompt + response, non-attention layers, ...).
        RuntimeError: gradient checkpointing without an enclosing
            ``shared_prompt_attention(model)`` block (backward would recompute plain attention).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    device, dtype = _model_device_dtype(model)
    if shared_prompt:
        chosen = select_backend(backend, device, dtype, needs_backward=_needs_backward(model))
        batch = pack_groups(groups, backend=chosen.name).to(device)
    else:
        batch = pad_groups(groups, pad_token_id).to(device)
    if batch.mask.sum() == 0:
        empty = torch.zeros_like(batch.mask)
        return (empty, batch.mask, empty.clone()) if return_entropy else (empty, batch.mask)

    if not shared_prompt:
        ensure_exact(model, groups, None, pad_token_id, (device, dtype), completion_logprobs)
        logits = _forward(model, batch)
    else:
        with refusals_name_the_model(model):
            check_model_supported(model, batch.layout)
            ensure_exact(
                model, groups, chosen.name, pad_token_id, (device, dtype), completion_logprobs
            )
            active = is_shared_prompt_active(model)
            checkpointing = needs_checkpoint_session(model)
            if checkpointing and not active:
                raise RuntimeError(
                    "gradient checkpointing recomputes attention during backward(), after this "
                    "call has returned: wrap both in `with periodic_rl.attention."
                    "shared_prompt_attention(model):` (forward and backward), or use "
                    "shared_prompt=False"
                )
            with ExitStack() as stack:
                if not active:
                    stack.enter_context(shared_prompt_attention(model))
                stack.enter_context(
                    shared_forward(batch.layout, context_layout_ok=not checkpointing)
                )
                logits = _forward(model, batch)
            check_layout_consumed(model, batch.layout)

    if temperature != 1.0:
        logits = logits / temperature
    logps, entropy = token_logprobs(logits, batch, return_entropy=return_entropy)
    if return_entropy:
        return logps, batch.mask, entropy
    return logps, batch.mask
