"""The schedule chooser: its predictions, its decisions (deterministic given the measurements),
and that it never leaves the budget."""

from __future__ import annotations

import pytest

from periodic_rl.rollout import chooser as chooser_module
from periodic_rl.rollout.budget import AsynchronyBudget
from periodic_rl.rollout.chooser import (
    ChooserState,
    IterationTimes,
    ScheduleChooser,
    WindowMeasure,
    decide,
    predict_period_s,
)
from periodic_rl.rollout.timing import SpanRecorder

# The staleness benchmark's k = 0 run: generate 4.3 s, train 5.2 s, push 1.95 s per iteration.
BENCH = IterationTimes(generation_s=4.3, training_s=5.2, push_s=1.95)


def window(k: int, period_s: float, times=(BENCH,) * 3, kl=None) -> WindowMeasure:
    return WindowMeasure(k, period_s, tuple(times), kl)


def test_turn_taking_is_the_sum_and_a_pipeline_the_slower_side():
    assert predict_period_s([BENCH], 0) == pytest.approx(4.3 + 5.2 + 1.95)
    assert predict_period_s([BENCH], 1) == pytest.approx(max(4.3 + 1.95, 5.2))
    assert predict_period_s([BENCH], 2) == pytest.approx(max(4.3 + 1.95, 5.2))


def test_a_deeper_pipeline_absorbs_iterations_of_uneven_length():
    sides = [(9.0, 1.0), (1.0, 9.0), (1.0, 9.0), (9.0, 1.0)]  # (generate, train) seconds
    uneven = [IterationTimes(g, t, 0.0) for g, t in sides]
    periods = [predict_period_s(uneven, k) for k in (0, 1, 2, 3)]
    assert periods == pytest.approx([10.0, 7.0, 5.0, 5.0])  # 5.0: both sides always busy
    state = ChooserState(ceiling=3)
    decision = decide(AsynchronyBudget(3), window(0, 10.0, uneven), state)
    assert decision.staleness == 2  # k = 3 is as fast: the fresher one is chosen


def test_on_policy_switches_to_the_freshest_of_the_fastest_and_logs_the_prediction():
    state = ChooserState(ceiling=3)
    decision = decide(AsynchronyBudget(3), window(0, 11.4), state)
    assert decision.switch and decision.staleness == 1 and not decision.final
    assert set(decision.predicted_s) == {1, 2, 3}
    assert "switching to k=1" in decision.line() and "k=2: 6.25" in decision.line()


def test_a_switch_is_kept_only_when_the_next_window_measured_it_faster():
    budget, state = AsynchronyBudget(2), ChooserState(ceiling=2)
    decide(budget, window(0, 11.4), state)
    kept = decide(budget, window(1, 7.0), state)
    assert not kept.switch and kept.final and "predicted 6.25" in kept.line()
    assert decide(budget, window(1, 7.0), state) is None  # nothing more to say
    state = ChooserState(ceiling=2)
    decide(budget, window(0, 11.4), state)
    back = decide(budget, window(1, 12.0), state)
    assert back.switch and back.staleness == 0 and "going back" in back.reason


def test_no_switch_when_nothing_is_predicted_faster_by_the_minimum_gain():
    state = ChooserState(ceiling=2)
    decision = decide(AsynchronyBudget(2), window(0, 6.3), state)
    assert not decision.switch and decision.final and decision.staleness == 0


def test_the_decision_depends_on_the_measurements_only():
    measured = [window(0, 11.4), window(1, 7.0), window(1, 7.1, kl=0.5)]
    budget = AsynchronyBudget(2, 0.1)
    runs = []
    for _ in range(2):
        state = ChooserState(ceiling=2)
        runs.append([decide(budget, m, state) for m in measured])
    assert runs[0] == runs[1]


def test_the_budget_bounds_every_candidate_whatever_is_predicted(monkeypatch):
    monkeypatch.setattr(chooser_module, "predict_period_s", lambda times, k, cycles=8: 1e-3 / k)
    on_policy = decide(AsynchronyBudget(0), window(0, 11.4), ChooserState(ceiling=0))
    assert on_policy.staleness == 0 and not on_policy.switch and on_policy.predicted_s == {}
    two = decide(AsynchronyBudget(2), window(0, 11.4), ChooserState(ceiling=2))
    assert two.staleness == 2 and set(two.predicted_s) == {1, 2}


def test_a_measured_mismatch_over_the_bound_goes_back_and_never_up_again():
    budget, state = AsynchronyBudget(3, max_mismatch_kl=0.01), ChooserState(ceiling=3)
    decide(budget, window(0, 11.4), state)  # -> k=1
    over = decide(budget, window(1, 7.0, kl=0.05), state)
    assert over.switch and over.staleness == 0 and "over the budget" in over.reason
    assert state.ceiling == 0 and state.done
    assert decide(budget, window(0, 11.4, kl=0.05), state) is None  # k = 0 is always inside
    under = ChooserState(ceiling=3)
    decide(budget, window(0, 11.4), under)
    assert not decide(budget, window(1, 7.0, kl=0.005), under).switch


def test_the_kl_bound_is_checked_in_every_window_after_exploring():
    budget, state = AsynchronyBudget(2, max_mismatch_kl=0.01), ChooserState(ceiling=2)
    decide(budget, window(0, 11.4), state)
    decide(budget, window(1, 7.0, kl=0.001), state)  # kept
    assert decide(budget, window(1, 7.0, kl=0.002), state) is None
    late = decide(budget, window(1, 7.0, kl=0.02), state)
    assert late.switch and late.staleness == 0


class Clock:
    def __init__(self, step_s: float) -> None:
        self.now, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        self.now += self.step_s
        return self.now


def _iteration(recorder: SpanRecorder, i: int) -> None:
    recorder.new_iteration(i)
    recorder.add("generate", "worker-0", 0.0, 4.3)
    recorder.add("train micro-batch", "trainer", 4.3, 9.5)
    recorder.add("weight push", "trainer", 9.5, 11.45)


def test_a_window_is_measured_after_one_warm_up_iteration_and_again_after_a_switch():
    chooser = ScheduleChooser(AsynchronyBudget(1), window=2, clock=Clock(11.4))
    recorder = SpanRecorder()
    decisions = []
    for i in range(4):  # starts of iterations 0..3: iteration 0 warms up, 1 and 2 measured
        decisions.append(chooser.step(0, recorder, None))
        _iteration(recorder, i)
    assert decisions[:3] == [None, None, None]
    first = decisions[3]
    assert first.switch and first.staleness == 1
    assert first.measured.period_s == pytest.approx(11.4)
    assert first.measured.iterations[0] == IterationTimes(4.3, 5.2, pytest.approx(1.95))
    chooser.clock.step_s = 7.0
    later = []
    for i in range(4, 8):  # 3 warms up k = 1; 4 and 5 measured; decided at 6's start
        later.append(chooser.step(1, recorder, None))
        _iteration(recorder, i)
    assert later[:2] == [None, None] and later[2] is not None
    assert not later[2].switch and later[2].measured.period_s == pytest.approx(7.0)
