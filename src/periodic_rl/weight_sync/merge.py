"""The rollout side of LoRA adapter pushes: keep the base weights, merge each adapter into them.

With LoRA the trainer pushes the base weights once and then only the adapter factors
(:func:`~periodic_rl.weight_sync.export.lora_adapter_payload`; the payload layout and what is
supported are in :mod:`periodic_rl.weight_sync.export`), which every rollout worker merges
itself with :func:`merge_lora`.

The merge is peft's: ``W + (B @ A) * scaling`` in the adapter's dtype, cast to the weight's
(``get_delta_weight`` of ``peft.tuners.lora.Linear``, peft 0.21, including its fp32 detour for
half-precision factors on the CPU). On one machine and device, :func:`merge_lora` of
:func:`~periodic_rl.weight_sync.export.lora_base_state_dict` is bit-identical to
:func:`~periodic_rl.weight_sync.export.policy_state_dict` for the adapted weights.

A full push with ``keep`` (the names the LoRA adapter adapts) leaves its engine loaded as usual
and, in :class:`AdapterLoader`, CPU copies of the kept weights plus the push's fingerprint. An
adapter push then carries only the LoRA factors: they are merged into those copies and the
merged weights are loaded as a *partial* load, so every engine gets the adapter through its
ordinary weight loading (no engine-side LoRA support needed). The fingerprint reported is
:func:`~periodic_rl.weight_sync.fingerprint.adapter_fingerprint` of the base's and the
payload's, the one the trainer expects; the fingerprint the engine reports of what it received
is checked against the merged weights' (one more hash, of the merged weights only).

Memory: the copies hold the adapted weights, plus what the engine can only load together with
them (vLLM: whole fused ``qkv_proj`` / ``gate_up_proj``), and the merged adapted weights are
written into buffers kept between pushes (one more copy of the adapted weights). An engine whose
``load_weights`` predates partial loads (no ``partial`` argument) gets full state dicts
instead: all base weights are kept then.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping

import torch

from periodic_rl.rollout.engine import InferenceEngine
from periodic_rl.weight_sync.export import A_SUFFIX, B_SUFFIX, SCALE_SUFFIX, adapted_names
from periodic_rl.weight_sync.fingerprint import adapter_fingerprint, weights_fingerprint

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


class AdapterLoader:
    """The base weights one engine keeps for adapter pushes, and the merge-and-load of them."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] | None = None
        self.base_fingerprint: str | None = None
        self.adapted: frozenset[str] = frozenset()
        self.partial = True
        # Merge buffers reused push after push (engines copy what they load): allocating the
        # merged weights afresh each time cost more than the merge itself (page faults).
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}

    def keep_base(
        self,
        engine: InferenceEngine,
        state_dict: Mapping[str, torch.Tensor],
        keep: Iterable[str] | None,
        fingerprint: str,
    ) -> None:
        """After a full push of ``state_dict`` (fingerprint ``fingerprint``): copy the weights
        later adapter pushes need (``keep=None``: forget any, adapter pushes are refused)."""
        self.base, self.base_fingerprint, self.adapted = None, None, frozenset()
        self._buffers = {}
        if keep is None:
            return
        adapted = frozenset(keep)
        missing = sorted(adapted - state_dict.keys())
        if missing:
            raise KeyError(f"keep names weights the push does not hold: {missing[:5]}")
        self.partial = accepts_partial(engine)
        names = engine.partial_load_names(set(adapted)) if self.partial else set(state_dict)
        absent = sorted(names - state_dict.keys())
        if absent:
            raise KeyError(f"the engine needs weights the push does not hold: {absent[:5]}")
        self.base = {name: state_dict[name].detach().to("cpu", copy=True) for name in names}
        self.base_fingerprint, self.adapted = fingerprint, adapted

    def load(self, engine: InferenceEngine, payload: Mapping[str, torch.Tensor]) -> str:
        """Merge ``payload`` into the kept base, load the result into ``engine``; returns the
        :func:`adapter_fingerprint` of the base and ``payload``."""
        if self.base is None or self.base_fingerprint is None:
            raise RuntimeError(
                "an adapter push needs a full push with keep=[adapted names] before it"
            )
        names = adapted_names(payload)
        if not names:
            raise ValueError("the adapter payload adapts no weight")
        unknown = sorted(set(names) - self.adapted)
        if unknown:
            raise KeyError(f"the adapter adapts weights the base push did not keep: {unknown[:5]}")
        fingerprint = adapter_fingerprint(self.base_fingerprint, payload)
        state = {**self.base, **merge_lora(self.base, payload, self._buffers)}
        if self.partial:
            loaded = engine.load_weights(state, partial=True)
        else:
            loaded = engine.load_weights(state)
        # The engine hashed what it received: a transport or conversion bug shows here.
        merged = weights_fingerprint(state)
        if loaded != merged:
            raise RuntimeError(
                f"the engine loaded other weights than the merged adapter: fingerprint "
                f"{loaded}, expected {merged}"
            )
        return fingerprint


def accepts_partial(engine: InferenceEngine) -> bool:
    """Whether ``engine.load_weights`` takes ``partial`` (engines written before it do not)."""
    try:
        parameters = inspect.signature(engine.load_weights).parameters
    except (TypeError, ValueError):
        return False
    return "partial" in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )
