"""The policy's weights as the rollout engines need them: transformers names, LoRA merged."""

from __future__ import annotations

from collections.abc import Container
from typing import Any

import torch


@torch.no_grad()
def policy_state_dict(policy: Any) -> dict[str, torch.Tensor]:
    """A detached CPU state dict with the base model's parameter names.

    For a peft LoRA model each adapted weight is ``W + delta`` computed out of place (the model
    is not merged and unmerged, which would drift the base weights by rounding every push).
    Tied weights appear once, under the name transformers saves them with.
    """
    if _is_peft(policy):
        base = policy.get_base_model()
        return _peft_base_state(base, _lora_deltas(base))
    state = {k: v.detach() for k, v in policy.state_dict().items()}
    for name in tied_duplicates(policy, state):
        state.pop(name, None)
    return {k: v.to("cpu").contiguous() for k, v in state.items()}


@torch.no_grad()
def lora_base_state_dict(policy: Any) -> dict[str, torch.Tensor]:
    """The base weights of a peft model, adapters *not* merged, under the names and with the
    tied duplicates dropped exactly as :func:`policy_state_dict` has them (the base an adapter
    push is merged into, see :mod:`periodic_rl.lora_push`)."""
    if not _is_peft(policy):
        raise TypeError(f"lora_base_state_dict needs a peft model, got {type(policy).__name__}")
    return _peft_base_state(policy.get_base_model(), {})


def tied_duplicates(model: Any, names: Container[str]) -> list[str]:
    """Names among ``names`` that are tied copies of another weight (e.g. ``lm_head.weight``)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return []
    if "lm_head.weight" in names:
        return ["lm_head.weight"]
    return []


def _is_peft(policy: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(policy, PeftModel)


def _lora_deltas(base: Any) -> dict[str, torch.Tensor]:
    """``{weight name: delta}`` of every unmerged LoRA layer, from peft's own
    ``get_delta_weight`` (one adapter: its delta as is; several: their sum)."""
    from peft.tuners.lora import LoraLayer

    deltas = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer) and not module.merged:
            parts = [
                module.get_delta_weight(a) for a in module.active_adapters if a in module.lora_A
            ]
            if len(parts) == 1:  # no zeros start: ``0 + d`` turns -0.0 into +0.0
                deltas[f"{name}.weight"] = parts[0]
            elif parts:
                deltas[f"{name}.weight"] = sum(parts[1:], start=parts[0])
    return deltas


def _peft_base_state(base: Any, deltas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's state under transformers names, ``deltas`` added to their weights."""
    state = {}
    for name, tensor in base.state_dict().items():
        if "lora_" in name:
            continue
        clean = name.replace(".base_layer.", ".")
        value = tensor.detach()
        if clean in deltas:
            value = value + deltas[clean].to(value.dtype)
        state[clean] = value
    for name in tied_duplicates(base, state):
        state.pop(name, None)
    return {k: v.to("cpu").contiguous() for k, v in state.items()}
