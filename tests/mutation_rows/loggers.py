"""Rows for the first-day work: loggers (W&B and MLflow get the sample tables, read offline)."""

from __future__ import annotations

from mutation_rows.base import Mutation

LOGGERS_TESTS = "tests/callbacks/test_loggers.py"

ROWS: list[Mutation] = [
    Mutation(
        name="RolloutSamples gives MLflow no table",
        file="src/periodic_rl/callbacks/samples.py",
        old="        elif isinstance(logger, MLFlowLogger):\n",
        new="        elif isinstance(logger, type(None)):\n",
        tests=(LOGGERS_TESTS,),
    ),
    Mutation(
        name="the samples table is logged a step after its iteration's metrics",
        file="src/periodic_rl/callbacks/samples.py",
        old="            self._log(logger, rows, step=iteration)\n",
        new="            self._log(logger, rows, step=trainer.global_step)\n",
        tests=(LOGGERS_TESTS,),
    ),
    Mutation(
        name="the W&B and MLflow tables' reward columns name the wrong values",
        file="src/periodic_rl/callbacks/samples.py",
        old='    columns += [f"rewards/{n}" for n in names] + ["advantage", "version"]\n',
        new='    columns += ["advantage", "version"] + [f"rewards/{n}" for n in names]\n',
        tests=(LOGGERS_TESTS,),
    ),
]
