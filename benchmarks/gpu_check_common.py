"""What the parts of the GPU check share: the time budget, the outcomes, the run's settings.

A check function takes a :class:`Setting` and a :class:`Budget`, returns its numbers (a dict
that goes into the JSON as it is) when it passed, and raises :class:`CheckFailed` (with the
numbers measured so far) or :class:`NotRun` (with the reason) otherwise. Any other exception
counts as a failure with its traceback.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch


class CheckFailed(Exception):
    """The check ran and something did not hold; ``numbers`` are what it measured."""

    def __init__(self, message: str, numbers: dict[str, Any]) -> None:
        super().__init__(message)
        self.numbers = numbers


class NotRun(Exception):
    """The check cannot run here (no CUDA, a package missing, no time left): the reason."""


@dataclass
class Budget:
    """Seconds a check may still start work in: a check asks before each piece of work and
    marks what it had no time for as not run."""

    seconds: float
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.started)

    def allows(self, needed: float = 0.0) -> bool:
        return self.left() > needed


@dataclass(frozen=True)
class Setting:
    """Where the check runs and how large: ``quick`` shrinks every shape (the CPU mode)."""

    device: torch.device
    quick: bool
    workdir: str  # scratch space for model directories

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtypes(self) -> list[torch.dtype]:
        """fp32 everywhere; bf16 on CUDA (the CPU mode checks the code paths, not bf16)."""
        return [torch.float32, torch.bfloat16] if self.cuda else [torch.float32]


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def summarise(rows: list[dict[str, Any]]) -> dict[str, int]:
    """How many of ``rows`` (each with a ``status``) passed, failed, were not run."""
    counts = {"passed": 0, "failed": 0, "not-run": 0}
    for row in rows:
        counts[row["status"]] += 1
    return counts
