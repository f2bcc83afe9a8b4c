"""Rewards for examples/math_jsonl.yaml: math-verify checks the answer, a regex checks the form."""

from __future__ import annotations

import re
from typing import Any

from periodic_rl.extras import require

_BOXED = re.compile(r"\\boxed\{[^{}]+\}")


def boxed_format(prompts: list[Any], completions: list[str], **columns: Any) -> list[float]:
    """1 when the completion puts its final answer in ``\\boxed{...}``."""
    return [float(bool(_BOXED.search(c))) for c in completions]


def math_correct(
    prompts: list[Any], completions: list[str], solution: list[str], **columns: Any
) -> list[float]:
    """1 when math-verify finds the completion's answer equal to the ``solution`` column.

    math-verify's own timeouts use ``signal.alarm``, which works in the main thread only: rewards
    run in the rollout thread (and in a ``reward_timeout_s`` thread), where they would raise and
    score every completion 0. They are off here; ``reward_timeout_s`` bounds the call instead."""
    require("math_verify", "the math_correct reward (examples/math_rewards.py)")
    from math_verify import parse, verify

    scores = []
    for completion, gold in zip(completions, solution, strict=True):
        try:
            answer = parse(completion, parsing_timeout=None)
            expected = parse(f"${gold}$", parsing_timeout=None)
            scores.append(float(verify(expected, answer, timeout_seconds=None)))
        except Exception:  # noqa: BLE001 - unparsable output scores 0, it is not a crash
            scores.append(0.0)
    return scores
