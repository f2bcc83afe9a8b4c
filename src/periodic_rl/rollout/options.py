"""`RolloutOptions`: the rollout arguments of the training strategies, checked on construction.

One dataclass the strategies build from their own arguments (``PeriodicAsyncStrategy``'s
docstring describes each field) and hand to the :class:`~periodic_rl.rollout.controller.
RolloutController`; a hardware tuner reads it too (:mod:`periodic_rl.rollout.tuning`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from periodic_rl.choices import check_choices
from periodic_rl.rollout.budget import AsynchronyBudget
from periodic_rl.rollout.device_defaults import PlacementStrategy, PushTransport
from periodic_rl.rollout.spec import BuiltinEngine


@dataclass(frozen=True)
class RolloutOptions:
    """The rollout arguments of the strategies (see ``PeriodicAsyncStrategy``); frozen: what a
    run changes between iterations is held by the controller."""

    engine: BuiltinEngine | str = "vllm"
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    num_workers: int = 1
    overlap: bool = True
    use_ray: bool = True
    ray_address: str | None = None
    cpus_per_worker: float = 1.0
    gpus_per_worker: float | None = None  # None: the device's default (device_defaults)
    groups_per_call: int | None = None  # None: 2 overlapped, else a worker's share
    adapter_pushes: bool = True
    max_staleness: int = 0
    asynchrony: AsynchronyBudget | None = None  # None: the fixed schedule of max_staleness
    partial_rollout_tokens: int | None = None  # None: completions in one piece
    call_timeout_s: float | None = 600.0
    worker_resources: dict[str, float] | None = None
    placement_strategy: PlacementStrategy = "PACK"
    push_transport: PushTransport = "auto"

    def __post_init__(self) -> None:
        check_choices(RolloutOptions, vars(self))
        if self.max_staleness < 0:
            raise ValueError(
                f"max_staleness must be >= 0 (0: exactly on-policy), got {self.max_staleness}"
            )
        if self.asynchrony is not None and self.max_staleness != 0:
            raise ValueError(
                f"max_staleness={self.max_staleness} and asynchrony="
                f"{self.asynchrony.describe()!r} both given: max_staleness fixes the schedule, "
                "asynchrony lets the run choose one within a budget; give one of them (e.g. "
                "asynchrony: {max_staleness: %d})" % self.max_staleness
            )
        if self.partial_rollout_tokens is not None:
            if self.partial_rollout_tokens < 1:
                raise ValueError(
                    f"partial_rollout_tokens must be >= 1 (tokens per chunk) or None, got "
                    f"{self.partial_rollout_tokens}"
                )
            if self.staleness_bound == 0:
                raise ValueError(
                    "partial_rollout_tokens needs max_staleness >= 1 (or an asynchrony budget "
                    "above on_policy): exactly on-policy, every token is already sampled by the "
                    "weights that train it, so no completion would continue under newer ones"
                )
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if not self.use_ray and (self.overlap or self.num_workers != 1):
            raise ValueError(
                "use_ray=False runs one engine inside the trainer's process: it needs "
                "num_workers=1 and overlap=False (overlap needs workers in their own processes)"
            )
        if self.groups_per_call is not None and self.groups_per_call < 1:
            raise ValueError(f"groups_per_call must be >= 1, got {self.groups_per_call}")
        if self.call_timeout_s is not None and not self.call_timeout_s > 0:
            raise ValueError(f"call_timeout_s must be > 0 or None, got {self.call_timeout_s}")

    @property
    def staleness_bound(self) -> int:
        """The most versions a trained group may lag in this run: the budget's, or the fixed
        ``max_staleness``."""
        if self.asynchrony is not None:
            return self.asynchrony.max_staleness
        return self.max_staleness
