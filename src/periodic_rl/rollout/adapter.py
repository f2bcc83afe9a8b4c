"""The rollout side of LoRA adapter pushes: keep the base weights, merge each adapter into them.

A full push with ``keep`` (the names the LoRA adapter adapts) leaves its engine loaded as usual
and, here, CPU copies of the kept weights plus the push's fingerprint. An adapter push then
carries only the LoRA factors (:mod:`periodic_rl.lora_push`): they are merged into those copies
and the merged weights are loaded as a *partial* load, so every engine gets the adapter through
its ordinary weight loading (no engine-side LoRA support needed). The fingerprint reported is
:func:`~periodic_rl.rollout.fingerprint.adapter_fingerprint` of the base's and the payload's,
the one the trainer expects; the fingerprint the engine reports of what it received is checked
against the merged weights' (one more hash, of the merged weights only).

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

from periodic_rl.lora_push import adapted_names, merge_lora
from periodic_rl.rollout.engine import InferenceEngine
from periodic_rl.rollout.fingerprint import adapter_fingerprint, weights_fingerprint


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
