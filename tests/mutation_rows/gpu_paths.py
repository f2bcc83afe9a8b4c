"""Rows for the DeepSpeed and fp16 paths: the module's clip in DeepSpeed's config, float16
training refused, the dynamic loss scaler's back-off kept, and ZeRO-3 loads partitioned."""

from __future__ import annotations

from mutation_rows.base import Mutation

DEEPSPEED_TESTS = "tests/compat/test_deepspeed.py"
PRECISION_TESTS = "tests/strategies/test_precision.py"

ROWS: list[Mutation] = [
    Mutation(
        name="the DeepSpeed config drops the module's max_grad_norm",
        file="src/periodic_rl/strategies/distributed.py",
        old='        return training_config(self.config, module.hparams.get("max_grad_norm"))\n',
        new="        return self.config\n",
        tests=(DEEPSPEED_TESTS,),
    ),
    Mutation(
        name="fp16 precision accepted",
        file="src/periodic_rl/config_checks.py",
        old="    if str(precision) in FP16_PRECISIONS:\n",
        new="    if False:\n",
        tests=(PRECISION_TESTS,),
    ),
    Mutation(
        name="restoring the loss scale undoes the dynamic scaler's back-off",
        file="src/periodic_rl/compat/deepspeed.py",
        old="    if current == saved * float(denominator):\n",
        new="    if True:\n",
        tests=(DEEPSPEED_TESTS,),
    ),
    Mutation(
        name="ZeRO-3 loading does not keep its HfDeepSpeedConfig alive",
        file="src/periodic_rl/compat/deepspeed.py",
        old="    hf_config = HfDeepSpeedConfig(dict(config))  # registers itself",
        new="    hf_config = None; HfDeepSpeedConfig(dict(config))  #",
        tests=(DEEPSPEED_TESTS,),
    ),
    Mutation(
        name="the half-precision probe judges the mean difference (a lost position_ids passes)",
        file="src/periodic_rl/attention/support.py",
        old="    if worst <= limit:\n",
        new="    if diffs.mean().item() <= limit:\n",
        tests=("tests/attention/test_families.py",),
    ),
]
