"""Rows for promises only a test reading the whole path exercises: the on-policy check on every
micro-batch, the module's reward timeout, the resume of iterations generated ahead, the check of
their prompts, and the staleness correction's default cap."""

from __future__ import annotations

from mutation_rows.base import STALENESS_TESTS, Mutation

ROWS: list[Mutation] = [
    Mutation(
        name="the on-policy check runs on an iteration's first micro-batch only",
        file="src/periodic_rl/module.py",
        old="                self._check_on_policy(groups, strategy)\n",
        new=(
            "                if not first_pass:\n"
            "                    self._check_on_policy(groups, strategy)\n"
        ),
        tests=("tests/test_on_policy.py",),
    ),
    Mutation(
        name="the module does not pass reward_timeout_s on to its scorer",
        file="src/periodic_rl/module_setup.py",
        old='        reward_timeout_s=h.get("reward_timeout_s", 300.0),\n',
        new="",
        tests=("tests/test_scoring.py",),
    ),
    Mutation(
        name="a checkpoint drops the weights of iterations already generated ahead",
        file="src/periodic_rl/rollout/controller.py",
        old="            pending = self.pipeline.pending_snapshots(self.version)\n",
        new=(
            "            pending = self.pipeline.pending_snapshots(self.version)\n"
            "            first = self.schedule.version_for(self.pipeline.submitted_through + 1)\n"
            "            pending = {v: s for v, s in pending.items() if v >= first}\n"
        ),
        tests=("tests/test_checkpoint.py",),
    ),
    Mutation(
        name="iterations generated ahead are trained whatever prompts the trainer got",
        file="src/periodic_rl/rollout/controller.py",
        old="                if self._submitted.get(request.iteration) != jobs:\n",
        new="                if False:\n",
        tests=("tests/rollout/test_pipeline.py",),
    ),
    Mutation(
        name="the staleness correction's default cap is 100, not 2",
        file="src/periodic_rl/algorithms/mismatch.py",
        old="STALE_IS_CAP = 2.0",
        new="STALE_IS_CAP = 100.0",
        tests=(STALENESS_TESTS,),
    ),
]
