"""LoRA weight pushes that carry only the adapter: its payload, and the merge the rollouts do.

With LoRA the trainer changes only the low-rank factors ``A`` and ``B``; the base weights stay
frozen. Pushing the merged weights every iteration ships the whole model; instead the rollout
workers keep the base weights that LoRA adapts (sent once, with the first push) and each later
push carries only the factors (a few MB), which every worker merges itself with
:func:`merge_lora`.

The merge is peft's: ``W + (B @ A) * scaling`` in the adapter's dtype, cast to the weight's
(``get_delta_weight`` of ``peft.tuners.lora.Linear``, peft 0.21, including its fp32 detour for
half-precision factors on the CPU). On one machine and device, :func:`merge_lora` of
:func:`~periodic_rl.weights.lora_base_state_dict` is bit-identical to
:func:`~periodic_rl.weights.policy_state_dict` for the adapted weights.

Supported: plain ``nn.Linear`` LoRA layers, one active adapter, no DoRA or other LoRA variant,
no LoRA bias, ``fan_in_fan_out=False``, nothing trainable besides the factors (no
``modules_to_save``, no trainable biases), no adapted tied duplicate. Anything else gives
``None`` from :func:`lora_adapter_payload`, and the caller pushes full merged weights instead.

Payload layout, per adapted weight ``name`` (a transformers name such as
``model.layers.0.self_attn.q_proj.weight``): ``f"{name}|lora_A"`` (r x in), ``f"{name}|lora_B"``
(out x r), both in the adapter's dtype, and ``f"{name}|scale"``, the scaling as a 0-d float64
tensor (a Python float exactly). A plain dict of CPU tensors, so that the weights transport and
:func:`~periodic_rl.rollout.fingerprint.weights_fingerprint` take it as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from periodic_rl.weights import tied_duplicates

A_SUFFIX, B_SUFFIX, SCALE_SUFFIX = "|lora_A", "|lora_B", "|scale"
_HALF = (torch.float16, torch.bfloat16)


def lora_delta(
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(B @ A) * scaling`` exactly as peft's ``Linear.get_delta_weight`` computes it (in the
    factors' dtype; half-precision factors on the CPU are multiplied in fp32, then cast back).

    ``out``: a buffer to write into (same kernels, same bits: ``mm`` with ``out=`` and an
    in-place ``mul_``), so repeated merges do not allocate (and page-fault) fresh memory.
    """
    dtype = lora_b.dtype
    if lora_b.device.type == "cpu" and dtype in _HALF:
        delta = ((lora_b.float() @ lora_a.float()) * scaling).to(dtype)
        return delta if out is None else out.copy_(delta)
    if out is None:
        return (lora_b @ lora_a) * scaling
    return torch.matmul(lora_b, lora_a, out=out).mul_(scaling)


def adapted_names(payload: Mapping[str, torch.Tensor]) -> list[str]:
    """The base weight names an adapter payload adapts, sorted."""
    return sorted(key.removesuffix(A_SUFFIX) for key in payload if key.endswith(A_SUFFIX))


@torch.no_grad()
def merge_lora(
    base: Mapping[str, torch.Tensor],
    payload: Mapping[str, torch.Tensor],
    buffers: dict[tuple[str, str], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """``{name: base[name] + delta}`` for the names ``payload`` adapts (and only those).

    ``base`` must hold every adapted name (``KeyError`` otherwise); shapes are checked.
    ``buffers`` (a dict the caller keeps between merges): write into tensors kept there, so the
    result's tensors are overwritten by the next merge with the same ``buffers``. Same bits.
    """
    merged: dict[str, torch.Tensor] = {}
    for name in adapted_names(payload):
        lora_a, lora_b = payload[name + A_SUFFIX], payload[name + B_SUFFIX]
        scaling = float(payload[name + SCALE_SUFFIX].item())
        if name not in base:
            raise KeyError(f"the adapter adapts {name}, which the kept base weights lack")
        weight = base[name]
        if tuple(weight.shape) != (lora_b.shape[0], lora_a.shape[1]):
            raise ValueError(
                f"{name}: weight {tuple(weight.shape)} does not fit lora_B "
                f"{tuple(lora_b.shape)} @ lora_A {tuple(lora_a.shape)}"
            )
        if buffers is None:
            merged[name] = weight + lora_delta(lora_a, lora_b, scaling).to(weight.dtype)
            continue
        delta = lora_delta(lora_a, lora_b, scaling, _buffer(buffers, "delta", weight, lora_b))
        target = _buffer(buffers, name, weight, weight)
        merged[name] = torch.add(weight, delta.to(weight.dtype), out=target)
    return merged


def _buffer(
    buffers: dict[tuple[str, str], torch.Tensor],
    key: str,
    shape_of: torch.Tensor,
    dtype_of: torch.Tensor,
) -> torch.Tensor:
    """The kept buffer ``key`` with ``shape_of``'s shape and ``dtype_of``'s dtype (made once;
    the ``"delta"`` scratch is shared by every weight of one shape)."""
    index = (key, f"{tuple(shape_of.shape)}|{dtype_of.dtype}")
    if index not in buffers:
        buffers[index] = torch.empty(shape_of.shape, dtype=dtype_of.dtype)
    return buffers[index]


@torch.no_grad()
def lora_adapter_payload(policy: Any) -> dict[str, torch.Tensor] | None:
    """The LoRA factors and scalings of ``policy`` as a push payload (module docstring), or
    ``None`` when ``policy`` is not a peft model or uses anything :func:`merge_lora` cannot
    reproduce. Tensors are detached CPU copies (the optimizer cannot change them afterwards)."""
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
