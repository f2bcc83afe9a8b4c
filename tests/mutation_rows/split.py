"""Rows that break how the hardware split predicts an iteration from measured spans."""

from __future__ import annotations

from mutation_rows.base import Mutation

PLAN_TESTS = "tests/rollout/test_hardware_split.py"
AUTO_TEST = (
    "tests/strategies/test_auto_split.py::"
    "test_auto_split_switches_twice_and_trains_as_a_fixed_split"
)
DEFER_TEST = (
    "tests/strategies/test_auto_split.py::"
    "test_a_guess_the_run_cannot_repay_is_not_tried_nor_remembered"
)

ROWS: list[Mutation] = [
    Mutation(
        name="an overlapped iteration predicted fully overlapped (no pipeline fill or drain)",
        file="src/periodic_rl/cpu_tuning/hardware_split.py",
        old="    if micro_batches is None:\n        return max(generation_s, training_s)\n",
        new="    return max(generation_s, training_s)\n",
        tests=(
            f"{PLAN_TESTS}::test_few_micro_batches_keep_turn_taking_that_full_overlap_would_leave",
            f"{PLAN_TESTS}::test_overlapped_iteration_as_a_pipeline_of_micro_batches",
        ),
    ),
    Mutation(
        name="the trainer's borrowed seconds fitted as if on its own cores",
        file="src/periodic_rl/cpu_tuning/hardware_split.py",
        old="    if lent <= 0 or turns.training.units <= t.units:\n",
        new="    if True:\n",
        tests=(f"{PLAN_TESTS}::test_borrowed_seconds_are_taken_out_of_training_on_its_own_cores",),
    ),
    Mutation(
        name="the trainer's borrowed seconds predicted as if on its own cores",
        file="src/periodic_rl/cpu_tuning/hardware_split.py",
        old="        if self.lent_s <= 0 or t.units >= all_units:\n",
        new="        if True:\n",
        tests=(f"{PLAN_TESTS}::test_borrowed_seconds_are_taken_out_of_training_on_its_own_cores",),
    ),
    Mutation(
        name="no loan modelled after generation ends (the trainer's drain on its own cores)",
        file="src/periodic_rl/cpu_tuning/hardware_split.py",
        old="    after = rates.training_on(every, te, every) if model.lend_idle_cores else None\n",
        new="    after = None\n",
        tests=(
            f"{PLAN_TESTS}::test_few_micro_batches_keep_turn_taking_that_full_overlap_would_leave",
        ),
    ),
    Mutation(
        name="the micro-batches of an iteration are not counted (one assumed)",
        file="src/periodic_rl/rollout/timing.py",
        old=(
            '        "micro_batches": float(sum(1 for s in trainer if s.name == '
            "MICRO_BATCH_NAME)),\n"
        ),
        new='        "micro_batches": 1.0,\n',
        tests=("tests/rollout/test_timing.py::test_summary_of_an_overlapped_iteration",),
    ),
    Mutation(
        name="a worker_cores: auto run models no loan although its trainer borrows cores",
        file="src/periodic_rl/cpu_tuning/plugin.py",
        old="hit.model if hit else SplitModel(), lend_idle_cores=self.lend_idle_cores\n",
        new="hit.model if hit else SplitModel(), lend_idle_cores=False\n",
        tests=(AUTO_TEST,),
    ),
    Mutation(
        name="a fixed split's advice models no loan although its trainer borrows cores",
        file="src/periodic_rl/cpu_tuning/split_advisor.py",
        old="    model = replace(model or SplitModel(), lend_idle_cores=lend_idle_cores)\n",
        new="    model = model or SplitModel()\n",
        tests=(AUTO_TEST,),
    ),
    Mutation(
        name="auto guesses on assumed efficiencies however few iterations are left",
        file="src/periodic_rl/cpu_tuning/split_advisor.py",
        old="            apply = None if deferred else apply\n",
        new="            deferred = None\n",
        tests=(
            "tests/rollout/test_split_advisor.py::"
            "test_auto_guesses_only_where_the_run_can_repay_a_wrong_guess",
        ),
    ),
    Mutation(
        name="a run too short to explore remembers its untried choice in the split cache",
        file="src/periodic_rl/cpu_tuning/plugin.py",
        old="if step.final and not step.deferred and self.split_cache is not None:",
        new="if step.final and self.split_cache is not None:",
        tests=(DEFER_TEST,),
    ),
    Mutation(
        name="the strategy tells the advisor no bound on the run's iterations",
        file="src/periodic_rl/cpu_tuning/plugin.py",
        old="iterations_left(trainer)",
        new="None",
        tests=(DEFER_TEST,),
    ),
    Mutation(
        name="the benchmark page reports a deferred (untried) plan as the split that ran",
        file="benchmarks/benchmarks_doc.py",
        old='    if s.get("split/deferred", 0) >= 0.5:',
        new="    if False:",
        tests=("tests/test_benchmark_report.py::test_where_auto_ended_reads_the_split_that_ran",),
    ),
    Mutation(
        name="a run without a split logs eleven split/* columns",
        file="src/periodic_rl/cpu_tuning/plugin.py",
        old="        if self.worker_cores is not None:  # a split in use",
        new="        if True:  # a split in use",
        tests=("tests/rollout/test_split_advisor.py",),
    ),
]
