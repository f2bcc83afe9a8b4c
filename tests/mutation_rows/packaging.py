"""Rows for the first-day work: packaging (the core's metadata, the extras, the strategy names
registered by ``import periodic_rl``, the workers that do not import Lightning)."""

from __future__ import annotations

from mutation_rows.base import Mutation

INSTALL_TESTS = "tests/test_install.py"
DEPENDENCY_TESTS = "tests/test_dependencies.py"

ROWS: list[Mutation] = [
    Mutation(
        name="import periodic_rl registers the strategy names only in rollout workers",
        file="src/periodic_rl/__init__.py",
        old='if os.environ.get(ROLLOUT_WORKER_ENV) != "1":\n',
        new='if os.environ.get(ROLLOUT_WORKER_ENV) == "1":\n',
        tests=(INSTALL_TESTS,),
    ),
    Mutation(
        name="the rollout workers' runtime env does not say they are workers (Lightning imported)",
        file="src/periodic_rl/rollout/workers/placement.py",
        old=', ROLLOUT_WORKER_ENV: "1"}\n',
        new="}\n",
        tests=(INSTALL_TESTS,),
    ),
    Mutation(
        name="the core pins torch exactly again",
        file="pyproject.toml",
        old='    "torch>=2.13,<2.14",\n',
        new='    "torch==2.13.0",\n',
        tests=(DEPENDENCY_TESTS,),
    ),
    Mutation(
        name="the report imports matplotlib (the report extra) when the package is imported",
        file="src/periodic_rl/callbacks/report.py",
        old="from periodic_rl.extras import available, install_hint, require\n",
        new=(
            "from periodic_rl.extras import available, install_hint, require\n"
            "import matplotlib  # noqa: F401\n"
        ),
        tests=(DEPENDENCY_TESTS,),
    ),
    Mutation(
        name="the demo alias converts without checking for gguf (the demo extra)",
        file="src/periodic_rl/models.py",
        old='    require("gguf", f"converting the model {SMOLLM2_ALIAS!r} from its GGUF file")\n',
        new="",
        tests=(INSTALL_TESTS,),
    ),
]
