"""Engines used by the fabric tests, loaded inside Ray workers by ``module:Class`` path.

This directory goes on the workers' ``PYTHONPATH`` (the fabric's ``pythonpath`` argument), so
the workers import this file as the top-level module ``fabric_fixtures``.
"""

from __future__ import annotations

import time

import torch

from periodic_rl.rollout.hf_engine import HFEngine
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


class SlowEngine(HFEngine):
    """An HFEngine that sleeps ``delay_s`` per call, so a test can kill it mid-call."""

    def __init__(self, model: str, delay_s: float = 0.0, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.delay_s = delay_s

    def generate(
        self, requests: list[GenerationRequest], sampling: SamplingConfig
    ) -> list[list[list[int]]]:
        time.sleep(self.delay_s)
        return super().generate(requests, sampling)
