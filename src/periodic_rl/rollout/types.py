"""Plain data records that travel between the rollout side and the trainer."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingConfig:
    """How completions are sampled; both built-in engines apply every field identically.

    Each step, the next token's logits (float32) are processed in vLLM's order:
    ``repetition_penalty`` on every token already in the prompt or the completion (a positive
    logit is divided by it, a negative one multiplied), then ``/ temperature``, then ``min_p``
    (drop the tokens whose probability is below ``min_p`` times the most likely one's), then
    ``top_k`` (keep the ``top_k`` highest logits, ties included), then ``top_p`` (keep the
    smallest set of most likely tokens whose probability reaches ``top_p``). The token is drawn
    from the softmax of the result, and its *behaviour log-prob* is its ``log_softmax``.

    Args:
        max_new_tokens: completion length cap, at least 1.
        temperature: ``>= 0``; ``0`` means greedy decoding: the argmax of the logits after
            ``repetition_penalty`` (``top_k``, ``min_p`` and ``top_p`` cannot change an argmax),
            and no behaviour log-probs.
        top_p: nucleus sampling, in ``(0, 1]``; ``1``: off.
        top_k: an integer ``>= 0``; ``0``: off (a value at least the vocabulary size is too).
        min_p: in ``[0, 1)``; ``0``: off.
        repetition_penalty: ``> 0``; ``1``: off, ``> 1`` discourages repeating a token.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if _not_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if _not_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0: greedy), got {self.temperature!r}"
            )
        if _not_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: off), got {self.top_p!r}")
        if _not_int(self.top_k) or self.top_k < 0:
            raise ValueError(
                f"top_k must be an integer >= 0 (0: off; not -1, vLLM's old 'off'), "
                f"got {self.top_k!r}"
            )
        if _not_number(self.min_p) or not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1) (0: off), got {self.min_p!r}")
        if _not_number(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise ValueError(
                f"repetition_penalty must be a finite number > 0 (1: off, > 1 penalises "
                f"repeats), got {self.repetition_penalty!r}"
            )


def _not_int(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, numbers.Integral)


def _not_number(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, numbers.Real)


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt group to generate: ``n`` samples of ``prompt_ids`` from base seed ``seed``.

    Sample ``i`` of the group is drawn with its own seed derived from ``(seed, i)``, so a group's
    samples never depend on which other requests share an engine batch.
    """

    prompt_ids: list[int]
    n: int
    seed: int


@dataclass(frozen=True)
class Turn:
    """One model turn of a multi-turn trajectory and what the environment answered.

    ``start`` is the offset, in the trajectory's response ids, of the turn's first model token;
    the model's ``model_tokens`` tokens are followed by ``env_tokens`` environment tokens (tool
    replies or observations, rendered with the chat template; 0 after the last turn).
    """

    start: int
    model_tokens: int
    env_tokens: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_seconds: float = 0.0
    env_truncated: bool = False


@dataclass(frozen=True)
class Trajectory:
    """What a multi-turn sample carries besides its response token ids.

    The response ids of a trajectory hold the model's tokens of every turn and, between them,
    the environment's tokens. ``loss_mask`` has one entry per response token: 1 on the model's
    tokens (trained), 0 on the environment's (context only). ``messages`` is the conversation
    after the prompt (the model's turns as it wrote them, the environment's replies), for
    rewards and the rollout record. ``env_reward`` is the sum of the rewards the environment
    returned (``None``: it returned none). ``stop`` says why the trajectory ended: ``"done"``
    (the environment said so, or the model answered without calling a tool), ``"max_turns"``,
    ``"token_budget"`` (the model's token budget over the trajectory is spent) or ``"length"``
    (a response cap cut the last turn).
    """

    loss_mask: list[int]
    turns: tuple[Turn, ...]
    messages: list[dict[str, Any]] = field(default_factory=list)
    env_reward: float | None = None
    stop: str = "done"


@dataclass
class RolloutGroup:
    """A finished prompt group: one prompt, its G completions, their rewards and advantages.

    ``version`` and ``fingerprint`` name the policy weights that produced the completions (the
    oldest, with partial rollouts); the trainer refuses a group whose version or fingerprint is
    not one it may train on. ``logprobs``, ``token_versions`` and ``version_fingerprints``: as in
    :class:`GeneratedGroup`, carried unchanged.
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
    logprobs: list[list[float]] = field(default_factory=list)
    trajectories: list[Trajectory] = field(default_factory=list)
    agent_s: float = 0.0
    engine_idle_s: float = 0.0
    token_versions: list[list[int]] = field(default_factory=list)
    version_fingerprints: dict[int, str] = field(default_factory=dict)

    def versions(self) -> dict[int, str]:
        """Every policy version that sampled a token of the group, with the fingerprint the
        engines confirmed for it (``version`` alone unless partial rollouts continued some
        completions under newer weights: ``token_versions``)."""
        return {self.version: self.fingerprint, **self.version_fingerprints}

    def loss_masks(self) -> list[list[int]] | None:
        """Per completion, 1 on the tokens trained and 0 on environment tokens; ``None`` for a
        single-turn group (every completion token is the model's)."""
        return [t.loss_mask for t in self.trajectories] if self.trajectories else None


@dataclass(frozen=True)
class GroupJob:
    """A prompt group to generate in an iteration; ``index`` is its place in the iteration.

    ``row``: the dataset row's columns besides the prompt, for the environments of multi-turn
    rollouts (``reset(**row)``); ``None`` for single-turn generation.
    """

    index: int
    prompt_ids: list[int]
    n: int
    seed: int
    row: dict[str, Any] | None = field(default=None, hash=False, compare=False)

    def request(self) -> GenerationRequest:
        return GenerationRequest(prompt_ids=self.prompt_ids, n=self.n, seed=self.seed)


@dataclass
class GeneratedGroup:
    """The raw output of one job, stamped with the weights that produced it and when.

    ``logprobs`` are the *behaviour* log-probs: for each completion, the log-prob of each of its
    tokens under the distribution the engine sampled it from (one float per token id), or ``[]``
    when the engine gave none (see :func:`behaviour_logprobs`). In a multi-turn group the
    environment's tokens carry ``0.0`` there (they were not sampled; their loss mask is 0), and
    ``trajectories`` holds one :class:`Trajectory` per completion (``[]``: single-turn);
    ``agent_s`` and ``engine_idle_s`` are the group's share of its agent loop's time and of the
    time the engine had nothing to generate (every unfinished trajectory waiting on its
    environment). With partial rollouts (:mod:`periodic_rl.rollout.partial`) ``token_versions``
    holds, per completion, the policy version that sampled each token (``[]``: every token is
    ``version``'s), ``version_fingerprints`` the fingerprint the engines confirmed for each of
    those versions, and ``version`` is the oldest.
    """

    index: int
    completion_ids: list[list[int]]
    version: int
    fingerprint: str
    worker: int
    seed: int
    started: float = 0.0
    finished: float = 0.0
    logprobs: list[list[float]] = field(default_factory=list)
    token_versions: list[list[int]] = field(default_factory=list)
    version_fingerprints: dict[int, str] = field(default_factory=dict)
    trajectories: list[Trajectory] = field(default_factory=list)
    agent_s: float = 0.0
    engine_idle_s: float = 0.0


def behaviour_logprobs(
    completion_ids: list[list[int]], logprobs: list[list[float]] | None
) -> list[list[float]]:
    """An engine's per-token log-probs of one group, checked against its completions.

    Returns one list of floats per completion, as long as its token ids, or ``[]`` when the
    engine gave none (``None``, ``[]``, or only empty lists while some completion has tokens).
    Raises ``ValueError`` when the engine gave some but they do not line up with the tokens.
    """
    if not logprobs:
        return []
    if any(completion_ids) and not any(logprobs):  # empty lists: the engine had none to give
        return []
    if len(logprobs) != len(completion_ids):
        raise ValueError(
            f"the engine returned log-probs for {len(logprobs)} of {len(completion_ids)} "
            "completions"
        )
    for i, (row, ids) in enumerate(zip(logprobs, completion_ids, strict=True)):
        if len(row) != len(ids):
            raise ValueError(
                f"completion {i}: the engine returned {len(row)} log-probs for {len(ids)} tokens"
            )
    return [[float(v) for v in row] for row in logprobs]
