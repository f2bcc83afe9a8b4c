"""Rows of what a user checks a run with: the engine/trainer mismatch metrics."""

from __future__ import annotations

from mutation_rows.base import Mutation

ROWS: list[Mutation] = [
    Mutation(
        name="mismatch: the ratio's maximum is summed over micro-batches, not kept",
        file="src/periodic_rl/iteration.py",
        old="                self.loss[name] = max(self.loss.get(name, value), value)\n",
        new="                self.loss[name] += value\n",
        tests=("tests/test_mismatch.py",),
    ),
    Mutation(
        name="mismatch: a micro-batch without behaviour log-probs counts no missing tokens",
        file="src/periodic_rl/micro_batch.py",
        old='        stats["mismatch_missing_tokens"] = mask.sum()\n',
        new="        pass\n",
        tests=("tests/test_mismatch.py",),
    ),
    Mutation(
        name="mismatch: the effective sample size is not normalised by the token count",
        file="src/periodic_rl/algorithms/mismatch.py",
        old='(tokens * sums["mismatch_ratio_sq_sum"]),\n',
        new='sums["mismatch_ratio_sq_sum"],\n',
        tests=("tests/test_mismatch.py",),
    ),
]
