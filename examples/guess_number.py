"""A multi-turn environment: the model guesses a number, the environment says higher or lower.

An :class:`periodic_rl.agents.Environment`: one instance per trajectory, ``reset(row, seed)``
picks the secret from the row's range with the trajectory's seed, ``step(turn)`` reads the
model's guess. The reward is 1 for the turn that finds the number, so the trajectory's reward
(the sum) is 1 when it was found within ``max_turns``. Use it with
``RLModule(agent=AgentConfig(environment="guess_number:GuessNumber"))`` and the rows of
``examples/data/guess_number.jsonl`` (``examples/guess_number.yaml``).
"""

from __future__ import annotations

import random
import re
from typing import Any

_LAST_INTEGER = re.compile(r"(-?\d+)(?!.*\d)", re.DOTALL)


class GuessNumber:
    """Guess a secret integer in ``[row["low"], row["high"]]``."""

    def reset(self, row: dict[str, Any], seed: int) -> str | None:
        self.low, self.high = int(row["low"]), int(row["high"])
        self.secret = random.Random(seed).randint(self.low, self.high)
        return None  # the prompt already explains the game

    def step(self, turn: str) -> tuple[str | None, float, bool]:
        found = _LAST_INTEGER.search(turn)
        if found is None:
            return f"Reply with one number between {self.low} and {self.high}.", 0.0, False
        guess = int(found.group(1))
        if guess == self.secret:
            return None, 1.0, True
        return ("Higher." if guess < self.secret else "Lower."), 0.0, False


def rows(num: int, high: int = 16, seed: int = 0) -> list[dict[str, Any]]:
    """``num`` prompt rows of the game (the ranges vary, the secret is drawn per trajectory)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        top = rng.randint(4, high)
        out.append(
            {
                "prompt": (
                    f"I am thinking of a whole number from 1 to {top}. Guess it: reply with one "
                    "number. I will tell you whether my number is higher or lower."
                ),
                "low": 1,
                "high": top,
            }
        )
    return out
