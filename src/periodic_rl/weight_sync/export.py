"""The trainer side of a weight push: the policy's weights as the rollout engines need them.

:func:`policy_state_dict` gives the full weights (transformers names, LoRA merged in).

With LoRA the trainer changes only the low-rank factors ``A`` and ``B``; the base weights stay
frozen. Pushing the merged weights every iteration ships the whole model; instead the rollout
workers keep the base weights that LoRA adapts (sent once, with the first push:
:func:`lora_base_state_dict`) and each later push carries only the factors (a few MB,
:func:`lora_adapter_payload`), which every worker merges itself with
:func:`~periodic_rl.weight_sync.merge.merge_lora`.

Supported: plain ``nn.Linear`` LoRA layers, one active adapter, no DoRA or other LoRA variant,
no LoRA bias, ``fan_in_fan_out=False``, nothing trainable besides the factors (no
``modules_to_save``, no trainable biases), no adapted tied duplicate. Anything else gives
``None`` from :func:`lora_adapter_payload`, and the caller pushes full merged weights instead.

Payload layout, per adapted weight ``name`` (a transformers name such as
``model.layers.0.self_attn.q_proj.weight``): ``f"{name}|lora_A"`` (r x in), ``f"{name}|lora_B"``
(out x r), both in the adapter's dtype, and ``f"{name}|scale"``, the scaling as a 0-d float64
tensor (a Python float exactly). A plain dict of CPU tensors, so that the weights transport and
:func:`~periodic_rl.weight_sync.fingerprint.weights_fingerprint` take it as they are.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from typing import Any

import torch

A_SUFFIX, B_SUFFIX, SCALE_SUFFIX = "|lora_A", "|lora_B", "|scale"


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
    push is merged into, see :mod:`periodic_rl.weight_sync.merge`)."""
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


# ---- LoRA adapter payloads --------------------------------------------------------------------
def adapted_names(payload: Mapping[str, torch.Tensor]) -> list[str]:
    """The base weight names an adapter payload adapts, sorted."""
    return sorted(key.removesuffix(A_SUFFIX) for key in payload if key.endswith(A_SUFFIX))


@torch.no_grad()
def lora_adapter_payload(policy: Any) -> dict[str, torch.Tensor] | None:
    """The LoRA factors and scalings of ``policy`` as a push payload (module docstring), or
    ``None`` when ``policy`` is not a peft model or uses anything
    :func:`~periodic_rl.weight_sync.merge.merge_lora` cannot reproduce. Tensors are detached
    CPU copies (the optimizer cannot change them afterwards)."""
    try:
        from peft import PeftModel
        from peft.tuners.lora import Linear as LoraLinear
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:  # pragma: no cover - peft is a dependency
        return None
    if not isinstance(policy, PeftModel):
        return None
    base = policy.get_base_model()
    payload: dict[str, torch.Tensor] = {}
    factors: set[int] = set()
    for module_name, module in base.named_modules():
        if isinstance(module, AuxiliaryTrainingWrapper):
            return None  # modules_to_save, trainable tokens: not LoRA factors
        if not isinstance(module, BaseTunerLayer):
            continue
        if type(module) is not LoraLinear or not _plain_linear(module):
            return None
        active = [a for a in module.active_adapters if a in module.lora_A]
        if len(active) > 1:
            return None
        if not active:
            continue
        (adapter,) = active
        if not _vanilla(module, adapter):
            return None
        name = f"{module_name}.weight"
        if tied_duplicates(base, {name}):
            return None  # the merged tied copy would not be pushed
        lora_a, lora_b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
        factors |= {id(lora_a), id(lora_b)}
        payload[name + A_SUFFIX] = _cpu_copy(lora_a)
        payload[name + B_SUFFIX] = _cpu_copy(lora_b)
        payload[name + SCALE_SUFFIX] = torch.tensor(
            float(module.scaling[adapter]), dtype=torch.float64
        )
    if not payload:
        return None
    if any(p.requires_grad and id(p) not in factors for p in policy.parameters()):
        return None  # a trainable base weight would change without being pushed
    return payload


def _plain_linear(module: Any) -> bool:
    return (
        isinstance(module.get_base_layer(), torch.nn.Linear)
        and not module.merged
        and not module.disable_adapters
        and not getattr(module, "fan_in_fan_out", False)
    )


def _vanilla(module: Any, adapter: str) -> bool:
    """Plain LoRA for ``adapter``: no variant (DoRA, ...), no LoRA bias."""
    return (
        adapter not in getattr(module, "lora_variant", {})
        and not getattr(module, "use_dora", {}).get(adapter, False)
        and not getattr(module, "lora_bias", {}).get(adapter, False)
    )


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True).contiguous()


def payload_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the tensors in ``state`` (to report how much a push carries)."""
    return sum(t.numel() * t.element_size() for t in state.values())
