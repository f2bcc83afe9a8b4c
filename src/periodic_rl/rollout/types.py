"""Plain data records that travel between the rollout side and the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingConfig:
    """How completions are sampled. ``temperature == 0`` means greedy decoding."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt group to generate: ``n`` samples of ``prompt_ids`` from base seed ``seed``.

    Sample ``i`` of the group is drawn with its own seed derived from ``(seed, i)``, so a group's
    samples never depend on which other requests share an engine batch.
    """

    prompt_ids: list[int]
    n: int
    seed: int


@dataclass
class RolloutGroup:
    """A finished prompt group: one prompt, its G completions, their rewards and advantages.

    ``version`` and ``fingerprint`` name the policy weights that produced the completions; the
    trainer refuses a group whose version or fingerprint is not the current one.
    """

    index: int
    prompt: Any
    prompt_ids: list[int]
    completion_ids: list[list[int]]
    completions: list[str]
    columns: dict[str, Any] = field(default_factory=dict)
    rewards: list[float] = field(default_factory=list)
    reward_components: dict[str, list[float]] = field(default_factory=dict)
    advantages: list[float] = field(default_factory=list)
    version: int = 0
    fingerprint: str = ""
    seed: int = 0
    worker: int = 0
    truncated: list[bool] = field(default_factory=list)


@dataclass(frozen=True)
class GroupJob:
    """A prompt group to generate in an iteration; ``index`` is its place in the iteration."""

    index: int
    prompt_ids: list[int]
    n: int
    seed: int

    def request(self) -> GenerationRequest:
        return GenerationRequest(prompt_ids=self.prompt_ids, n=self.n, seed=self.seed)


@dataclass
class GeneratedGroup:
    """The raw output of one job, stamped with the weights that produced it and when."""

    index: int
    completion_ids: list[list[int]]
    version: int
    fingerprint: str
    worker: int
    seed: int
    started: float = 0.0
    finished: float = 0.0
