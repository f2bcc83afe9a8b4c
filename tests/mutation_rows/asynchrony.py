"""Mutation rows of the asynchrony budget, its schedule chooser and partial rollouts
(``src/periodic_rl/rollout/chooser.py``, ``partial.py``, the switches of the schedule)."""

from __future__ import annotations

from mutation_rows.base import Mutation

CHOOSER_TESTS = ("tests/rollout/test_chooser.py", "tests/strategies/test_asynchrony.py")
PARTIAL_TESTS = ("tests/rollout/test_partial.py", "tests/strategies/test_partial_rollouts.py")

ROWS: list[Mutation] = [
    Mutation(
        name="asynchrony: the chooser ignores the budget's bound",
        file="src/periodic_rl/rollout/chooser.py",
        old="    candidates = range(1, min(state.ceiling, budget.max_staleness) + 1)\n",
        new="    candidates = range(1, 4 + 1)\n",
        tests=CHOOSER_TESTS,
    ),
    Mutation(
        name="asynchrony: a measured mismatch over the KL bound is not acted on",
        file="src/periodic_rl/rollout/chooser.py",
        old="    if bound is not None and k > 0 and not budget.allows(k, window.mismatch_kl):\n",
        new="    if False:\n",
        tests=CHOOSER_TESTS,
    ),
    Mutation(
        name="asynchrony: a switch is kept though measured slower than before it",
        file="src/periodic_rl/rollout/chooser.py",
        old="        if window.period_s < before.period_s:\n",
        new="        if True:\n",
        tests=CHOOSER_TESTS,
    ),
    Mutation(
        name="asynchrony: a switch rewrites the schedule of an iteration already submitted",
        file="src/periodic_rl/rollout/pipeline.py",
        old="            first = self.submitted_through + 1\n",
        new="            first = self.submitted_through\n",
        tests=("tests/rollout/test_pipeline.py", "tests/strategies/test_asynchrony.py"),
    ),
    Mutation(
        name="asynchrony: the checkpoint forgets the schedule's switches",
        file="src/periodic_rl/rollout/controller.py",
        old='            "schedule": [list(phase) for phase in self.schedule.phases()],\n',
        new='            "schedule": [[0, 0, 0]],\n',
        tests=("tests/strategies/test_asynchrony.py",),
    ),
    Mutation(
        name="partial rollouts: a stale token tagged with the version of its completion's start",
        file="src/periodic_rl/rollout/partial.py",
        old="                sample.versions += [generated.version] * len(ids)\n",
        new="                sample.versions += [self.versions[0]] * len(ids)\n",
        tests=PARTIAL_TESTS,
    ),
    Mutation(
        name="partial rollouts: a later chunk drawn by the first chunk's weights",
        file="src/periodic_rl/rollout/partial.py",
        old="            chunk_version = self.versions[min(chunk, len(self.versions) - 1)]\n",
        new="            chunk_version = self.versions[0]\n",
        tests=PARTIAL_TESTS,
    ),
    Mutation(
        name="partial rollouts: only a group's first version is checked",
        file="src/periodic_rl/on_policy.py",
        old="        for sampled_by, carried in sorted(group.versions().items()):\n",
        new="        for sampled_by, carried in [(group.version, group.fingerprint)]:\n",
        tests=("tests/test_on_policy.py",),
    ),
    Mutation(
        name="partial rollouts allowed exactly on-policy",
        file="src/periodic_rl/rollout/options.py",
        old="            if self.staleness_bound == 0:\n",
        new="            if False:\n",
        tests=PARTIAL_TESTS,
    ),
]
