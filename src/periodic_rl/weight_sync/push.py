"""`WeightPusher`: the one entry point that sends the policy's weights to the rollout engines.

Each push is one of three kinds:

- ``full``: the merged weights (:meth:`PushablePolicy.rollout_state_dict`), every time, when
  the policy has no LoRA adapter the engines can merge (or ``adapter_pushes=False``);
- ``base+adapter``: with LoRA, the frozen base once per set of engines (and again after a
  failed push, when what they hold is unknown), then the adapter;
- ``adapter``: with LoRA, every later push: only the adapter factors, merged by the engines.

The engines report a fingerprint of what they hold after loading; the backend checks it against
the fingerprint of what was sent (:mod:`periodic_rl.weight_sync.fingerprint`). With sharded
training (FSDP, DeepSpeed ZeRO-3) the caller gathers the full weights onto rank 0 first
(:mod:`periodic_rl.weight_sync.gather`); this class only ever runs on rank 0.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from periodic_rl.rollout.backend import RolloutBackend
from periodic_rl.weight_sync.export import adapted_names

PUSH_KINDS = ("full", "base+adapter", "adapter")


class PushablePolicy(Protocol):
    """What a module offers the rollout side (``RLModule`` implements it; override the
    methods to customise a push)."""

    model_path: str  # the engines are built from it

    def rollout_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights the engines must hold: transformers names, LoRA merged in."""
        ...

    def rollout_adapter(self) -> dict[str, torch.Tensor] | None:
        """Only the LoRA factors (``None``: no adapter the engines can merge)."""
        ...

    def rollout_base_state_dict(self) -> dict[str, torch.Tensor]:
        """The frozen base weights the adapter payloads are merged into."""
        ...


class WeightPusher:
    """Chooses the kind of each push, sends it, and counts pushes per kind.

    Args:
        adapter_pushes: with LoRA, push the base once and then only the adapter factors;
            ``False`` pushes the full merged weights every time.
    """

    def __init__(self, adapter_pushes: bool = True) -> None:
        self.adapter_pushes = adapter_pushes
        self.counts = dict.fromkeys(PUSH_KINDS, 0)
        #: Seconds of the last push on this side: ``export_s`` (the policy's weights as a state
        #: dict or adapter payload) and ``send_s`` (the backend's push, the workers' loads and
        #: fingerprint checks included).
        self.timings: dict[str, float] = {}
        self._base_on: tuple[int, list[str]] | None = None  # (id of backend, kept names)

    def push(
        self, backend: RolloutBackend, policy: PushablePolicy, version: int
    ) -> tuple[str, str]:
        """Send ``policy``'s weights to ``backend`` as ``version``; returns ``(kind,
        fingerprint)``. On any failure the base is sent again by the next push."""
        began = time.perf_counter()
        adapter = policy.rollout_adapter() if self.adapter_pushes else None
        export_s = time.perf_counter() - began
        try:
            if adapter is None:
                kind, self._base_on = "full", None
                exporting = time.perf_counter()
                state = policy.rollout_state_dict()
                export_s += time.perf_counter() - exporting
                sending = time.perf_counter()
                fingerprint = backend.push_weights(state, version)
                del state
            else:
                kind, keep = "adapter", adapted_names(adapter)
                sending = time.perf_counter()
                if self._base_on != (id(backend), keep):
                    kind, self._base_on = "base+adapter", None
                    backend.push_weights(policy.rollout_base_state_dict(), version, keep=keep)
                    self._base_on = (id(backend), keep)
                fingerprint = backend.push_adapter(adapter, version)
        except BaseException:
            self._base_on = None  # the engines' state is unknown: start again from the base
            raise
        self.counts[kind] += 1
        self.timings = {"export_s": export_s, "send_s": time.perf_counter() - sending}
        return kind, fingerprint

    def forget_base(self) -> None:
        """The engines were replaced: the next push sends the base again."""
        self._base_on = None
