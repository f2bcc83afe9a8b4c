"""The hardware-split chooser: measured busy times in, one deterministic plan out."""

import math

import pytest

from periodic_rl.rollout.hardware_split import (
    Candidate,
    MeasuredRates,
    SideTime,
    SplitModel,
    choose_split,
    efficiency_between,
    fit_model,
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
    ],
)
def test_invalid_input_is_refused(build, message):
    with pytest.raises(ValueError, match=message):
        build()
