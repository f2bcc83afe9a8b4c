"""`RolloutBackend`: the interface every set of rollout engines offers the rollout side.

Two implementations: :class:`~periodic_rl.rollout.ray_rollouts.RayRollouts` (engines in Ray
actors, groups streamed back as they finish, dead workers replaced) and
:class:`~periodic_rl.rollout.local.LocalRollouts` (one engine in the trainer's process, for
debugging). The :class:`~periodic_rl.rollout.controller.RolloutController` talks to either only
through these five methods.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import torch

from periodic_rl.rollout.types import GeneratedGroup, GroupJob, SamplingConfig


@runtime_checkable
class RolloutBackend(Protocol):
    """Rollout engines behind one API: load weights (verified), generate groups, shut down."""

    def start(self) -> object:
        """Start the engines (idempotent); returns once every engine holds the same weights."""
        ...

    def push_weights(
        self, state_dict: dict[str, torch.Tensor], version: int, keep: list[str] | None = None
    ) -> str:
        """Load ``state_dict`` on every engine as policy ``version``; check each engine's
        fingerprint of what it holds against the fingerprint of what was sent; return it.
        ``keep``: LoRA-adapted weight names to keep as the base of later adapter pushes."""
        ...

    def push_adapter(self, adapter: dict[str, torch.Tensor], version: int) -> str:
        """Merge a LoRA adapter payload into the kept base on every engine; verified like
        :meth:`push_weights`; returns the fingerprint of base and adapter together."""
        ...

    def generate(
        self,
        jobs: list[GroupJob],
        sampling: SamplingConfig,
        version: int,
        groups_per_call: int | None = None,
        ramp_groups: int | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[GeneratedGroup]:
        """Every job once, each group stamped with the version and fingerprint of the weights
        that generated it, in completion order. Stops early once ``cancel`` is set."""
        ...

    def shutdown(self) -> None:
        """Stop every engine and process it started (idempotent)."""
        ...
