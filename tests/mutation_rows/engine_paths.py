"""Rows for the engine paths: NCCL's bootstrap on loopback on the trainer's side, the
engine/trainer dtype mismatch corrected and said by default, and vLLM's CPU head sizes refused at
setup."""

from __future__ import annotations

from mutation_rows.base import Mutation

NCCL_ENV_TESTS = "tests/weight_sync/test_nccl_env.py"
MODULE_SETUP_TESTS = "tests/test_module_setup.py"
HEAD_SIZE_TESTS = "tests/rollout/test_engine_head_size.py"

ROWS: list[Mutation] = [
    Mutation(
        name="the trainer's NCCL bootstrap leaves the interface unset",
        file="src/periodic_rl/weight_sync/broadcast.py",
        old=(
            "            os.environ.update(nccl_environment(address.host))"
            "  # before NCCL's first use\n"
        ),
        new="",
        tests=(NCCL_ENV_TESTS,),
    ),
    Mutation(
        name="a bf16 HF engine against an fp32 trainer is not corrected by default",
        file="src/periodic_rl/rollout/device_defaults.py",
        old="        return None if engine_dtype in same else AUTO_TIS_CAP\n",
        new="        return None\n",
        tests=(MODULE_SETUP_TESTS,),
    ),
    Mutation(
        name="the engine/trainer dtype mismatch is not said at the start",
        file="src/periodic_rl/module_setup.py",
        old="    if mismatch is not None:\n        logger.log(*mismatch)\n",
        new="",
        tests=(MODULE_SETUP_TESTS,),
    ),
    Mutation(
        name="vLLM's CPU head-size check is skipped at setup",
        file="src/periodic_rl/setup_checks.py",
        old="        check_engine_takes_model(options.engine, config, module.model_path)\n",
        new="",
        tests=(HEAD_SIZE_TESTS,),
    ),
]
