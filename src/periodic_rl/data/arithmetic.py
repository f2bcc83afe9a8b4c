"""``builtin:arithmetic``: procedurally generated sums, easy enough for a 135M model.

Problems are ``a + b`` (and optionally ``a - b``) with small operands. The train and held-out
splits are disjoint by construction: each problem's split is a function of the problem itself,
so no held-out problem ever appears in training, whatever the seed.
The reward gives format credit (a short one-line reply that ends in a number) and correctness
credit (that number is the answer); they are separate reward functions, logged separately.
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Any

PROMPT_TEMPLATE = "What is {a} {op} {b}? Reply with only the number."
FORMAT_WEIGHT = 0.25
CORRECT_WEIGHT = 1.0

_FINAL_NUMBER = re.compile(r"(-?\d+)\s*\.?\s*$")
_SHORT_REPLY_CHARS = 40


def _is_held_out(a: int, op: str, b: int, held_out_fraction: float) -> bool:
    digest = hashlib.sha256(f"{a}{op}{b}".encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < held_out_fraction


def arithmetic_problems(
    split: str,
    num: int,
    seed: int = 0,
    max_operand: int = 19,
    ops: tuple[str, ...] = ("+",),
    held_out_fraction: float = 0.2,
) -> list[dict[str, Any]]:
    """``num`` rows ``{"prompt", "answer"}`` from ``split`` ("train" or "test"), seeded.

    The training split samples with replacement (an RL run revisits problems); the test split
    is a fixed, seeded sample without replacement from the held-out problems.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    pool = [
        (a, op, b)
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
        for op in ops
        if (op != "-" or a >= b) and _is_held_out(a, op, b, held_out_fraction) == (split == "test")
    ]
    rng = random.Random(f"{split}-{seed}")
    if split == "train":
        chosen = [rng.choice(pool) for _ in range(num)]
    else:
        chosen = rng.sample(pool, min(num, len(pool)))
    return [
        {
            "prompt": PROMPT_TEMPLATE.format(a=a, op=op, b=b),
            "answer": str(a + b if op == "+" else a - b),
        }
        for a, op, b in chosen
    ]


def _final_number(completion: str) -> str | None:
    match = _FINAL_NUMBER.search(completion.strip())
    return match.group(1) if match else None


def format_reward(prompts: list[Any], completions: list[str], **columns: Any) -> list[float]:
    """1 for a single short line that ends in a number (e.g. ``12`` or ``The answer is 12.``)."""
    return [
        float(
            "\n" not in c.strip()
            and len(c.strip()) <= _SHORT_REPLY_CHARS
            and _final_number(c) is not None
        )
        for c in completions
    ]


def correctness_reward(
    prompts: list[Any], completions: list[str], answer: list[str], **columns: Any
) -> list[float]:
    """1 when the reply's final number equals the answer."""
    return [float(_final_number(c) == a) for c, a in zip(completions, answer, strict=True)]


REWARD_FUNCS = [format_reward, correctness_reward]
REWARD_WEIGHTS = [FORMAT_WEIGHT, CORRECT_WEIGHT]
ACCURACY_FUNC = correctness_reward
