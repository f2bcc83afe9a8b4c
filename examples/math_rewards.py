"""Rewards for examples/math_jsonl.yaml: math-verify checks the answer, a regex checks the form."""

from __future__ import annotations

import re
from typing import Any

_BOXED = re.compile(r"\\boxed\{[^{}]+\}")


def boxed_format(prompts: list[Any], completions: list[str], **columns: Any) -> list[float]:
    """1 when the completion puts its final answer in ``\\boxed{...}``."""
    return [float(bool(_BOXED.search(c))) for c in completions]


def math_correct(
    prompts: list[Any], completions: list[str], solution: list[str], **columns: Any
) -> list[float]:
    """1 when math-verify finds the completion's answer equal to the ``solution`` column."""
    from math_verify import parse, verify

    scores = []
    for completion, gold in zip(completions, solution, strict=True):
        try:
            scores.append(float(verify(parse(f"${gold}$"), parse(completion))))
        except Exception:  # noqa: BLE001 - unparsable output scores 0, it is not a crash
            scores.append(0.0)
    return scores
