"""Engines used by the RayRollouts and strategy tests, loaded inside Ray workers by
``module:Class``.

This directory goes on the workers' ``PYTHONPATH`` (the ``pythonpath`` argument of RayRollouts, or
the ``PYTHONPATH`` environment variable for a strategy's rollouts), so the workers import this
file as the top-level module ``ray_fixtures``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

from periodic_rl.rollout.engines.hf_engine import HFEngine
from periodic_rl.rollout.types import GenerationRequest, SamplingConfig

HERE = __file__.rsplit("/", 1)[0]


class TamperingEngine(HFEngine):
    """An HFEngine whose weight loads silently corrupt one value: a stand-in for a transport
    or conversion bug. Its fingerprint is honest about what it holds, so pushes must fail.
    ``only_partial``: tamper only with partial loads (LoRA adapter pushes)."""

    def __init__(self, model: str, only_partial: bool = False, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.only_partial = only_partial

    def load_weights(self, state_dict: dict[str, torch.Tensor], partial: bool = False) -> str:
        if self.only_partial and not partial:
            return super().load_weights(state_dict)
        name = sorted(state_dict)[0]
        corrupted = dict(state_dict)
        corrupted[name] = state_dict[name].clone()
        corrupted[name].view(-1)[0] += 1.0
        return super().load_weights(corrupted, partial=partial)


class DroppingEngine(HFEngine):
    """An HFEngine whose load receives every tensor but copies one of them (``drop``) nowhere:
    a reload that loses a tensor after it arrived. Only the copy is faulty; the fingerprint is
    HFEngine's own, so pushes must fail. (Not a tied name such as ``lm_head.weight``: its
    tensor is the embedding's, which the load does copy.)"""

    def __init__(self, model: str, drop: str = "model.norm.weight", **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.drop = drop

    def _copy_in(self, own: dict[str, torch.Tensor], state_dict: dict[str, torch.Tensor]) -> None:
        super()._copy_in(own, {k: v for k, v in state_dict.items() if k != self.drop})


class GatedEngine(HFEngine):
    """An HFEngine whose calls wait for files, so that a test can fix the order of events
    between the trainer and the workers instead of relying on timing.

    Args:
        gate_dir: where the files are.
        gates: ``{group seed: file name}``: a call holding that group starts generating only
            once ``gate_dir/<file name>`` exists.
        reason: what a gate that never opens means (in the error it raises).
        max_wait_s: how long a call waits for a gate or a hold before it raises.

    Holds: while ``gate_dir/hold-<pid>`` exists, every call of the worker process ``pid`` waits
    (a test creates it to be sure that worker still has its calls when it kills the worker);
    ``hold-load-<pid>`` does the same to its weight loads (a hang, if never removed).
    Deaths: once ``gate_dir/die-generate-<pid>`` (``die-load-<pid>``) exists, the worker process
    ``pid`` kills itself (SIGKILL) at the start of its next generate call (weight load). A
    restarted worker has another pid: none of these files concern it.
    """

    def __init__(
        self,
        model: str,
        gate_dir: str = "",
        gates: dict[int, str] | None = None,
        reason: str = "",
        max_wait_s: float = 60.0,
        **kwargs,
    ) -> None:
        super().__init__(model, **kwargs)
        self.gate_dir = Path(gate_dir)
        self.gates = dict(gates or {})
        self.reason = reason
        self.max_wait_s = max_wait_s

    def generate(
        self, requests: list[GenerationRequest], sampling: SamplingConfig
    ) -> list[list[list[int]]]:
        if self.gate_dir.parts:
            self._fault("generate")
            hold = self.gate_dir / f"hold-{os.getpid()}"
            self._wait(lambda: not hold.exists(), f"{hold} was never removed")
            for request in requests:
                if request.seed in self.gates:
                    gate = self.gate_dir / self.gates[request.seed]
                    self._wait(gate.exists, f"{gate} never appeared: {self.reason}")
        return super().generate(requests, sampling)

    def load_weights(self, state_dict: dict[str, torch.Tensor], partial: bool = False) -> str:
        if self.gate_dir.parts:
            self._fault("load")
            hold = self.gate_dir / f"hold-load-{os.getpid()}"
            self._wait(lambda: not hold.exists(), f"{hold} was never removed")
        return super().load_weights(state_dict, partial=partial)

    def _fault(self, where: str) -> None:
        if (self.gate_dir / f"die-{where}-{os.getpid()}").exists():
            os.kill(os.getpid(), signal.SIGKILL)

    def _wait(self, condition, failure: str) -> None:
        deadline = time.monotonic() + self.max_wait_s
        while not condition():
            if time.monotonic() > deadline:
                raise RuntimeError(f"waited {self.max_wait_s:.0f} s: {failure}")
            time.sleep(0.01)
