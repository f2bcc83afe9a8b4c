"""Writes math_train.jsonl and math_test.jsonl: small products and fractions, no prompt twice.

    python examples/data/make_math.py

Every distinct problem appears once, and the test problems are disjoint from the training ones
(a held-out set that overlaps training measures memorisation).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SUFFIX = " Put the final answer in \\boxed{}."


def problems() -> list[dict[str, str]]:
    rows = []
    for a in range(2, 13):
        for b in range(a, 13):
            rows.append({"prompt": f"Compute {a} \\times {b}.{SUFFIX}", "solution": str(a * b)})
    for q in range(2, 13):
        for d in range(2, 15):
            rows.append(
                {"prompt": f"Simplify \\frac{{{q * d}}}{{{d}}}.{SUFFIX}", "solution": str(q)}
            )
    return rows


def main(num_train: int = 160, num_test: int = 40, seed: int = 0) -> None:
    rows = problems()
    random.Random(seed).shuffle(rows)
    assert len({r["prompt"] for r in rows}) == len(rows) >= num_train + num_test
    here = Path(__file__).parent
    for name, part in (
        ("math_train", rows[:num_train]),
        ("math_test", rows[num_train:][:num_test]),
    ):
        with open(here / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in part)


if __name__ == "__main__":
    main()
