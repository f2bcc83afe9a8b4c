"""Rows for the architecture: the import graph, the tuning seam, the schedule's k = 0 case."""

from __future__ import annotations

from mutation_rows.base import Mutation

ARCHITECTURE_TESTS = "tests/test_architecture.py"

ROWS: list[Mutation] = [
    Mutation(
        name="an import cycle: micro_batch imports the module for its type only",
        file="src/periodic_rl/micro_batch.py",
        old="from periodic_rl.truncation import mask_truncated\n",
        new=(
            "from periodic_rl.truncation import mask_truncated\n"
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from periodic_rl.module import RLModule  # noqa: F401\n"
        ),
        tests=(ARCHITECTURE_TESTS,),
    ),
    Mutation(
        name="the rollout controller imports the CPU tuner",
        file="src/periodic_rl/rollout/controller.py",
        old="from periodic_rl.rollout.tuning import HardwareTuning\n",
        new=(
            "from periodic_rl.rollout.tuning import HardwareTuning\n"
            "import periodic_rl.cpu_tuning  # noqa: F401\n"
        ),
        tests=(ARCHITECTURE_TESTS,),
    ),
    Mutation(
        name="a CUDA run gets the CPU tuner by default",
        file="src/periodic_rl/rollout/tuning.py",
        old='DEFAULT_TUNING = {"cpu": "periodic_rl.cpu_tuning:CPUTuning"}',
        new=(
            'DEFAULT_TUNING = {"cpu": "periodic_rl.cpu_tuning:CPUTuning", '
            '"cuda": "periodic_rl.cpu_tuning:CPUTuning"}'
        ),
        tests=(ARCHITECTURE_TESTS,),
    ),
    Mutation(
        name="exactly on-policy (k = 0) submits an iteration ahead",
        file="src/periodic_rl/rollout/schedule.py",
        old="        last = min(iteration + self.max_staleness, int(min(end, 2**62)) - 1)\n",
        new="        last = min(iteration + self.max_staleness + 1, int(min(end, 2**62)) - 1)\n",
        tests=("tests/rollout/test_pipeline.py",),
    ),
    Mutation(
        name="the trainer borrows for its step while the workers generate ahead",
        file="src/periodic_rl/rollout/controller.py",
        old="            if pipeline.idle:  # for the optimizer step\n",
        new="            if True:  # for the optimizer step\n",
        tests=("tests/rollout/test_core_loan.py",),
    ),
]
