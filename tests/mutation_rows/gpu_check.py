"""Rows for the GPU check: what runs on the lent machine (no Ray, no vLLM) and its verdicts."""

from __future__ import annotations

from mutation_rows.base import Mutation

GPU_CHECK_TESTS = "tests/test_gpu_check.py"

ROWS: list[Mutation] = [
    Mutation(
        name="import periodic_rl imports ray at module level",
        file="src/periodic_rl/__init__.py",
        old="from typing import Any\n",
        new="from typing import Any\n\nimport ray  # noqa: F401\n",
        tests=(GPU_CHECK_TESTS,),
    ),
    Mutation(
        name="the gpu check reports a failed packing case as passed",
        file="benchmarks/gpu_check_attention.py",
        old='row[key] = "passed" if passed else "failed"',
        new='row[key] = "passed"',
        tests=(GPU_CHECK_TESTS,),
    ),
]
