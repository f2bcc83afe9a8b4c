"""Rows for the first-day work: defaults that fit the device, dropout, and a first run that
reads well (default callbacks, checkpoint names)."""

from __future__ import annotations

from mutation_rows.base import Mutation

MODULE_SETUP_TESTS = "tests/test_module_setup.py"
FIRST_RUN_TESTS = "tests/callbacks/test_defaults.py"

ROWS: list[Mutation] = [
    Mutation(
        name="dtype auto trains in float32 on CUDA",
        file="src/periodic_rl/rollout/device_defaults.py",
        old='TRAINING_DTYPES = {"cpu": "float32", "cuda": "bfloat16"}',
        new='TRAINING_DTYPES = {"cpu": "float32", "cuda": "float32"}',
        tests=(MODULE_SETUP_TESTS,),
    ),
    Mutation(
        name="tis_cap auto leaves the correction off with the vLLM engine",
        file="src/periodic_rl/rollout/device_defaults.py",
        old='    if engine == "vllm":\n        return AUTO_TIS_CAP\n',
        new='    if engine == "vllm":\n        return None\n',
        tests=(MODULE_SETUP_TESTS,),
    ),
    Mutation(
        name="dropout modules keep their rate during RL",
        file="src/periodic_rl/module_setup.py",
        old="            module.p = 0.0\n",
        new="            pass\n",
        tests=(MODULE_SETUP_TESTS,),
    ),
    Mutation(
        name="the logged held-out step stays in the callback metrics and names later checkpoints",
        file="src/periodic_rl/evaluation.py",
        old='        trainer.callback_metrics.pop("step", None)\n',
        new="        pass\n",
        tests=(FIRST_RUN_TESTS,),
    ),
    Mutation(
        name="the module's default callbacks replace the ones the user passed",
        file="src/periodic_rl/callbacks/defaults.py",
        old="if not any(isinstance(given, type(cb)) for given in trainer.callbacks)",
        new="if True",
        tests=(FIRST_RUN_TESTS,),
    ),
]
