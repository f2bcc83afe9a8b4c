"""Rows for the first-day work: rewards."""

from __future__ import annotations

from mutation_rows.base import Mutation

POOL_TESTS = "tests/test_reward_pool.py"

ROWS: list[Mutation] = [
    Mutation(
        name="rewards: every reward runs in the trainer's process (a timeout cannot stop it)",
        file="src/periodic_rl/reward_pool.py",
        old='    if getattr(func, "reward_in_process", False) or inspect.ismethod(func):\n',
        new="    if True:\n",
        tests=(POOL_TESTS,),
    ),
    Mutation(
        name="rewards: the reward pool outlives the fit",
        file="src/periodic_rl/module.py",
        old="        if self.scorer is not None:\n            self.scorer.close()\n",
        new="        pass\n",
        tests=(POOL_TESTS,),
    ),
    Mutation(
        name="rewards: a reward failing every call never stops the run",
        file="src/periodic_rl/scoring.py",
        old="                self._streaks[name] += 1\n",
        new="                pass\n",
        tests=(POOL_TESTS,),
    ),
    Mutation(
        name="rewards: named components summed without the reward's weight",
        file="src/periodic_rl/scoring.py",
        old="totals = [t + weight * v for t, v in zip(totals, values, strict=True)]",
        new="totals = [t + v for t, v in zip(totals, values, strict=True)]",
        tests=("tests/test_scoring.py",),
    ),
    Mutation(
        name="rewards: an HTTP verifier's 5xx is not retried",
        file="src/periodic_rl/remote_rewards.py",
        old="            if error.code >= 500 or error.code == RETRY_STATUS:\n",
        new="            if error.code == RETRY_STATUS:\n",
        tests=("tests/test_remote_rewards.py",),
    ),
]
