"""The hardware-split chooser: measured busy times in, one deterministic plan out."""

import math
from dataclasses import replace

import pytest

from periodic_rl.cpu_tuning.hardware_split import (
    Candidate,
    MeasuredRates,
    SideTime,
    SplitModel,
    choose_split,
    efficiency_between,
    fit_model,
    pipeline_s,
    rates_from_summaries,
    recommend_gpus,
)

LINEAR = SplitModel(generation_efficiency=1.0, training_efficiency=1.0, min_gain=0.0)
FLAT = SplitModel(generation_efficiency=0.0, training_efficiency=0.0, min_gain=0.0)


def rates(gen_s, gen_units, train_s, train_units, serial_s=0.0, **kwargs):
    return MeasuredRates(
        SideTime(gen_s, gen_units), SideTime(train_s, train_units), serial_s, **kwargs
    )


def split(plan):
    c = plan.chosen
    return c.overlap, c.trainer_cores, c.worker_cores, round(c.predicted_s, 9)


@pytest.mark.parametrize(
    ("measured", "cores", "workers", "model", "expected"),
    [
        # scaling perfectly, taking turns on both cores halves each side: 2 + 0.5 + push 0.5
        (rates(4, 1, 1, 1, 0.5), (0, 1), 1, LINEAR, (False, (0, 1), ((0, 1),), 3.0)),
        # more cores do not help: overlap, max(3, 2), beats 3 + 2
        (rates(3, 1, 2, 1), (0, 1), 1, FLAT, (True, (0,), ((1,),), 3.0)),
        # e = 0.5 on 4 cores (speedups 1, 1.5, 2, 2.5): work 12 and 4; trainer 1 core: max(6, 4)
        # beats turns 12/2.5 + 4/2.5 = 6.4, trainer 2 cores (8) and 3 cores (12)
        (
            rates(6, 3, 4, 1),
            (0, 1, 2, 3),
            1,
            SplitModel(0.5, 0.5, min_gain=0),
            (True, (0,), ((1, 2, 3),), 6.0),
        ),
        # the same with a 0.5 s cost of overlapping: 6.5 against turns 6.4
        (
            rates(6, 3, 4, 1),
            (0, 1, 2, 3),
            1,
            SplitModel(0.5, 0.5, overlap_cost_s=0.5, min_gain=0),
            (False, (0, 1, 2, 3), ((0, 1, 2, 3),), 6.4),
        ),
        # two workers share the workers' cores (the first the larger part); trainer 1 and 2
        # cores tie at max(2, 3): the fewer trainer cores win
        (rates(2, 2, 3, 2), (4, 5, 6, 7), 2, FLAT, (True, (4,), ((5, 6), (7,)), 3.0)),
        # a tie between turn-taking and overlap (1 + 1 against max(2, 2)): turn-taking
        (rates(2, 1, 2, 1), (0, 1), 1, LINEAR, (False, (0, 1), ((0, 1),), 2.0)),
        # as many cores as workers: no overlap candidate is possible
        (rates(2, 1, 2, 1), (0, 1), 2, FLAT, (False, (0, 1), ((0,), (1,)), 4.0)),
    ],
)
def test_rates_give_the_expected_plan(measured, cores, workers, model, expected):
    plan = choose_split(measured, cores, workers, model)
    assert split(plan) == expected
    assert plan == choose_split(measured, cores, workers, model)  # deterministic
    assert plan.chosen.predicted_s == min(c.predicted_s for c in plan.candidates)
    assert plan.chosen.label in plan.reason


def test_candidates_in_tie_break_order():
    plan = choose_split(rates(2, 1, 2, 1), (0, 1, 2), 1, LINEAR)
    assert [(c.overlap, len(c.trainer_cores)) for c in plan.candidates] == [
        (False, 3),
        (True, 1),
        (True, 2),
    ]


def test_the_current_split_is_kept_unless_another_gains_enough():
    measured = rates(2, 1, 2, 1)  # linear: turns 2.0, overlap 2.0
    overlap = Candidate(True, (0,), ((1,),), 0.0)
    kept = choose_split(measured, (0, 1), 1, SplitModel(1.0, 1.0, min_gain=0.05), overlap)
    assert split(kept) == (True, (0,), ((1,),), 2.0)
    assert kept.reason.startswith("kept")
    # 4 + 0.5 against 2 + 0.5 + 0.5: far more than the 5% gain asked
    slow = rates(4, 1, 1, 1, 0.5)
    switched = choose_split(slow, (0, 1), 1, SplitModel(1.0, 1.0, min_gain=0.05), overlap)
    assert split(switched) == (False, (0, 1), ((0, 1),), 3.0)


def test_efficiency_from_two_core_counts():
    assert efficiency_between(SideTime(2, 1), SideTime(1, 2)) == 1.0  # halved: linear
    assert efficiency_between(SideTime(2, 1), SideTime(2, 2)) == 0.0  # no gain
    assert efficiency_between(SideTime(3, 1), SideTime(2, 2)) == 0.5  # speedup 1.5 on 2
    assert efficiency_between(SideTime(2, 1), SideTime(3, 2)) == 0.0  # slower: clipped
    assert efficiency_between(SideTime(2, 2), SideTime(1, 2)) is None  # same cores


def test_fitted_model_reproduces_both_measured_modes_and_chooses_overlap():
    """Overlapped on 1 + 1 cores and taking turns on 2: the fit explains both measured walls,
    and the faster mode is chosen although turn-taking is the current one."""
    overlapped = rates(4, 1, 3, 1, 0.5, wall_s=5.5, overlap=True)
    turns = rates(4, 2, 2, 2, 0.5, wall_s=7.0, overlap=False)
    model = fit_model([overlapped, turns])
    assert (model.generation_efficiency, model.training_efficiency) == (0.0, 0.5)
    assert (model.serial_s, model.overlap_cost_s) == (1.0, 0.5)
    current = Candidate(False, (0, 1), ((0, 1),), 0.0)
    plan = choose_split(turns, (0, 1), 1, model, current)
    assert [round(c.predicted_s, 9) for c in plan.candidates] == [7.0, 5.5]
    assert split(plan) == (True, (0,), ((1,),), 5.5)
    # one window alone changes only what it can tell: the serial time is then the push
    assert fit_model([overlapped]) == SplitModel(overlap_cost_s=1.0)
    assert fit_model([]) == SplitModel()


def test_rates_from_iteration_summaries():
    summaries = [
        {"generation_time": 2.0, "training_time": 1.0, "push_time": 0.25, "wall_time": 3.0},
        {"generation_time": 4.0, "training_time": 3.0, "push_time": 0.75, "wall_time": 5.0},
    ]
    measured = rates_from_summaries(summaries, 1, 1, overlap=True)
    assert measured == rates(3.0, 1, 2.0, 1, 0.5, wall_s=4.0, overlap=True, iterations=2)
    counted = [
        s | {"micro_batches": m, "training_lent_time": m - 2}
        for s, m in zip(summaries, (2, 4), strict=True)
    ]
    measured = rates_from_summaries(counted, 1, 1, overlap=True)
    assert (measured.micro_batches, measured.lent_s) == (3.0, 1.0)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((4, 6, None), 6),  # micro-batches not measured: the sides overlap fully
        ((4, 6, 1), 10),  # one micro-batch: nothing to overlap
        ((4, 4, 2), 6),  # max(4, 4) + the first micro-batch's generation (2)
        ((4, 4, 2, 2), 5),  # the last micro-batch trains on every core after generation: 1 s
        # generation ends while the first micro-batch trains: 1 s of it beside generation (a
        # third), the rest at the faster pace (2/3 x 1.5), then the second on every core (1.5)
        ((2, 6, 2, 3), 4.5),
        ((4, 4, 2.4), 6),  # a mean count of micro-batches is rounded
    ],
)
def test_overlapped_iteration_as_a_pipeline_of_micro_batches(args, expected):
    assert pipeline_s(*args) == pytest.approx(expected)


def test_few_micro_batches_keep_turn_taking_that_full_overlap_would_leave():
    """A workload measured taking turns on 2 cores (generation 6 s, training 9 s, push 0.5 s),
    efficiencies assumed (0.5), the trainer borrowing the worker's core once generation ends.
    Counting the sides as fully overlapped, one core each looks 10% faster (max(9, 13.5) + 0.5
    against 15.5); in the two micro-batches measured, the first waits for half the generation
    and the last trains after it: 15.5 s, a tie, and turn-taking stays. With 8 micro-batches
    overlap wins (13.25 s)."""
    model = SplitModel(lend_idle_cores=True)
    full = choose_split(rates(6, 2, 9, 2, 0.5), (0, 1), 1, model)
    assert split(full) == (True, (0,), ((1,),), 14.0)
    two = choose_split(rates(6, 2, 9, 2, 0.5, micro_batches=2), (0, 1), 1, model)
    assert [c.predicted_s for c in two.candidates] == [15.5, 15.5] and not two.chosen.overlap
    eight = choose_split(rates(6, 2, 9, 2, 0.5, micro_batches=8), (0, 1), 1, model)
    assert split(eight) == (True, (0,), ((1,),), 13.25)
    unlent = choose_split(rates(6, 2, 9, 2, 0.5, micro_batches=8), (0, 1), 1, SplitModel())
    assert unlent.candidates[1].predicted_s == pytest.approx(15.125)  # no loan: slower drain


def test_borrowed_seconds_are_taken_out_of_training_on_its_own_cores():
    """Training busy 5 s on 1 of 2 cores, 2 s of it on both (the worker's core lent), e = 0.5:
    alone on 2 cores it takes (5 - 2) / 1.5 + 2 = 4 s, on 1 core 6 s. Fitting with a
    turn-taking window that trained 4 s on 2 cores recovers e = 0.5, where the raw 5 s would
    say 0.25; the overlap cost is what the pipeline (8 s) and the push leave of the wall."""
    overlapped = rates(6, 1, 5, 1, 0.5, wall_s=8.75, overlap=True, micro_batches=2, lent_s=2.0)
    assert overlapped.training_on(2, 0.5, 2) == pytest.approx(4.0)
    assert overlapped.training_on(1, 0.5, 2) == pytest.approx(6.0)
    turns = rates(4, 2, 4, 2, 0.5, wall_s=8.5, overlap=False, micro_batches=2)
    model = fit_model([turns, overlapped], SplitModel(lend_idle_cores=True))
    assert model.generation_efficiency == pytest.approx(0.5)
    assert model.training_efficiency == pytest.approx(0.5)
    assert model.serial_s == pytest.approx(0.5) and model.overlap_cost_s == pytest.approx(0.25)
    raw = fit_model([turns, replace(overlapped, lent_s=0.0)], SplitModel(lend_idle_cores=True))
    assert raw.training_efficiency == pytest.approx(0.25)


def test_gpus_that_balance_the_sides():
    # work 20 and 12 GPU-seconds on 8 GPUs: 5 workers and 3 trainer GPUs, max(4, 4)
    advice = recommend_gpus(rates(10, 2, 2, 6, 0.5), model=LINEAR)
    assert (advice.trainer_gpus, advice.worker_gpus, advice.num_workers) == (3, 5, 5)
    assert advice.predicted_s == 4.5 and advice.measured_s == 10.5
    # workers of 2 GPUs; every choice equal (no scaling): the fewest workers
    tie = recommend_gpus(rates(2, 2, 2, 6), gpus_per_worker=2, model=FLAT)
    assert (tie.trainer_gpus, tie.worker_gpus, tie.num_workers) == (6, 2, 1)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: SideTime(-1.0, 1), "busy time must be >= 0"),
        (lambda: SideTime(math.inf, 1), "finite"),
        (lambda: SideTime(1.0, 0), ">= 1 core or GPU"),
        (lambda: SideTime(1.0, 1.5), ">= 1 core or GPU"),
        (lambda: rates(1, 1, 1, 1, serial_s=-0.1), "serial_s must be >= 0"),
        (lambda: rates(1, 1, 1, 1, iterations=0), ">= 1 measured iteration"),
        (lambda: SplitModel(generation_efficiency=1.5), "generation_efficiency"),
        (lambda: SplitModel(overlap_cost_s=-1), "overlap_cost_s"),
        (lambda: choose_split(rates(1, 1, 1, 1), (), 1), "cannot hold 1 workers"),
        (lambda: choose_split(rates(1, 1, 1, 1), (0, 0), 1), "distinct core ids"),
        (lambda: choose_split(rates(1, 1, 1, 1), (0, 1), 0), "num_workers must be >= 1"),
        (lambda: choose_split(rates(1, 1, 1, 1), (0, 1), 3), "cannot hold 3 workers"),
        (lambda: recommend_gpus(rates(1, 1, 1, 1), gpus_per_worker=0.5), "whole number"),
        (lambda: recommend_gpus(rates(1, 1, 1, 1), total_gpus=1), "cannot hold a trainer"),
        (lambda: rates_from_summaries([], 1, 1), "no iteration summaries"),
        (lambda: rates(1, 1, 1, 1, micro_batches=0.5), ">= 1 micro-batch"),
        (lambda: rates(1, 1, 1, 1, lent_s=-1.0), "lent_s must be >= 0"),
    ],
)
def test_invalid_input_is_refused(build, message):
    with pytest.raises(ValueError, match=message):
        build()
