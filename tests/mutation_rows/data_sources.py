"""Rows for the first-day work: data sources (hub configs, column mapping, reasoning-gym)."""

from __future__ import annotations

from mutation_rows.base import Mutation

HUB_TESTS = "tests/data/test_hub.py"
TRANSFORM_TESTS = "tests/data/test_transform.py"
GYM_TESTS = "tests/data/test_reasoning_gym.py"

ROWS: list[Mutation] = [
    Mutation(
        name="data sources: a hub dataset's config name is not passed to load_dataset",
        file="src/periodic_rl/data/hub.py",
        old="            name=options.name,\n",
        new="            name=None,\n",
        tests=(HUB_TESTS,),
    ),
    Mutation(
        name="data sources: the column mapping is checked but not applied",
        file="src/periodic_rl/data/transform.py",
        old="            rows = [self._renamed(row) for row in rows]\n",
        new="            rows = list(rows)\n",
        tests=(TRANSFORM_TESTS,),
    ),
    Mutation(
        name="data sources: the reasoning-gym verifier scores the whole completion, not its tags",
        file="src/periodic_rl/data/reasoning_gym.py",
        old="            score = float(self._score(extract_answer(completion), entry))\n",
        new="            score = float(self._score(completion.strip(), entry))\n",
        tests=(GYM_TESTS,),
    ),
    Mutation(
        name="data sources: reasoning-gym held-out rows reuse the training items' seeds",
        file="src/periodic_rl/data/reasoning_gym.py",
        old="    candidates = task_rows(task, 2 * num_val, seed + num_train)\n",
        new="    candidates = task_rows(task, 2 * num_val, seed + 1)\n",
        tests=(GYM_TESTS,),
    ),
]
