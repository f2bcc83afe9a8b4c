"""The policy's weights as the rollout engines need them: transformers names, LoRA merged."""

from __future__ import annotations

from typing import Any

import torch


@torch.no_grad()
def policy_state_dict(policy: Any) -> dict[str, torch.Tensor]:
    """A detached CPU state dict with the base model's parameter names.

    For a peft LoRA model each adapted weight is ``W + delta`` computed out of place (the model
    is not merged and unmerged, which would drift the base weights by rounding every push).
    Tied weights appear once, under the name transformers saves them with.
    """
    try:
        from peft import PeftModel
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        PeftModel = LoraLayer = ()  # noqa: N806

    if isinstance(policy, PeftModel):
        base = policy.get_base_model()
        deltas = {}
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer) and not module.merged:
                delta = sum(
                    (
                        module.get_delta_weight(a)
                        for a in module.active_adapters
                        if a in module.lora_A
                    ),
                    start=torch.zeros_like(module.get_base_layer().weight),
                )
                deltas[f"{name}.weight"] = delta
        state = {}
        for name, tensor in base.state_dict().items():
            if "lora_" in name:
                continue
            clean = name.replace(".base_layer.", ".")
            value = tensor.detach()
            if clean in deltas:
                value = value + deltas[clean].to(value.dtype)
            state[clean] = value
        model = base
    else:
        state = {k: v.detach() for k, v in policy.state_dict().items()}
        model = policy
    for name in _tied_duplicates(model, state):
        state.pop(name, None)
    return {k: v.to("cpu").contiguous() for k, v in state.items()}


def _tied_duplicates(model: Any, state: dict[str, torch.Tensor]) -> list[str]:
    """Names of state entries that are tied copies of another entry (e.g. ``lm_head.weight``)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return []
    if "lm_head.weight" in state:
        return ["lm_head.weight"]
    return []
