"""The split advisor's windows: warm-up skipped, one window logged, or with ``auto`` turn-taking
first and overlap tried only where predicted faster, then the fitted choice kept, or a cached
split measured without switching; on spans written by hand (no Ray)."""

from types import SimpleNamespace

import pytest

from periodic_rl.cpu_tuning.hardware_split import SplitModel
from periodic_rl.cpu_tuning.split_advisor import (
    SplitAdvisor,
    auto_start,
    iterations_left,
    log_only_advisor,
    starting_split,
)
from periodic_rl.cpu_tuning.split_cache import SplitCache, read_cache
from periodic_rl.rollout.timing import SpanRecorder, worker_lane


def record(
    recorder: SpanRecorder,
    iteration: int,
    generate: float,
    train: float,
    overlap: bool,
    fill: float = 0.0,
    micro_batches: int = 8,
):
    """One iteration: the worker generates ``generate`` s, the trainer trains ``train`` s in
    ``micro_batches`` back-to-back micro-batches (alongside, from ``fill`` s in, or after it),
    then a 0.5 s push."""
    start = 100.0 * iteration
    recorder.new_iteration(iteration)
    recorder.add("generate", worker_lane(0), start, start + generate)
    begin = start + fill if overlap else start + generate
    each = train / micro_batches
    for i in range(micro_batches):
        recorder.add("train micro-batch", "trainer", begin + i * each, begin + (i + 1) * each)
    end = max(start + generate, begin + train)
    recorder.add("weight push", "trainer", end, end + 0.5)


def test_a_fixed_split_is_measured_once_after_the_warm_up():
    recorder = SpanRecorder()
    advisor = SplitAdvisor(starting_split((0, 1), 1, True), (0, 1), 1, window=2)
    record(recorder, 0, 50.0, 50.0, True)  # warm-up: never measured
    assert advisor.step(recorder) is None
    record(recorder, 1, 4.0, 2.0, True)
    assert advisor.step(recorder) is None
    record(recorder, 2, 6.0, 2.0, True)
    step = advisor.step(recorder)
    assert (step.rates.generation.busy_s, step.rates.training.busy_s) == (5.0, 2.0)
    assert (step.rates.serial_s, step.rates.wall_s) == (0.5, 5.5)
    assert step.final and step.apply is None and step.plan is not None
    assert step.metrics()["split/generation_s"] == 5.0
    record(recorder, 3, 4.0, 2.0, True)
    assert advisor.step(recorder) is None  # once


def test_auto_starts_taking_turns_and_stays_where_overlap_is_not_predicted_faster():
    """Training twice as long as generation: overlap on one core each is predicted no faster
    (max(6, 12) + 0.5 s against 4 + 8 + 0.5 s, efficiencies assumed), so the synchronous
    split stays, nothing is explored and the choice is final after one window."""
    recorder = SpanRecorder()
    start = auto_start(1, True, None, None, 0, None)
    assert not start.overlap and start.trainer_cores == start.worker_cores[0]
    start = starting_split((0, 1), 1, False)
    advisor = SplitAdvisor(start, (0, 1), 1, window=1, auto=True)
    record(recorder, 0, 9.0, 9.0, False)  # warm-up
    record(recorder, 1, 4.0, 8.0, False)
    step = advisor.step(recorder)
    assert step.final and step.apply is None and step.assumed
    assert step.plan.chosen.same_split(start) and "kept turn-taking" in step.reason
    record(recorder, 2, 4.0, 8.0, False)
    assert advisor.step(recorder) is None and advisor.current is start


@pytest.mark.parametrize(
    ("generate", "train", "fill", "keeps_overlap"),
    [
        # generation gains nothing from a second core: overlap measured 5.5 s, predicted 6.0
        # (5 + 4 / 8 of fill and drain + 0.5), turns 8.5
        (4.0, 5.0, 0.0, True),
        (8.0, 8.0, 1.0, False),  # both sides scale perfectly, 1 s of fill: 9.5 s, turns 8.5
    ],
)
def test_auto_moves_to_overlap_where_predicted_faster_then_keeps_the_fitted_choice(
    generate, train, fill, keeps_overlap
):
    """Balanced sides taking turns (4 + 4 + 0.5 s) in 8 micro-batches: overlap is predicted
    faster with the assumed efficiencies (6 s a side, + 6 / 8 of pipeline fill and drain
    + 0.5 s), so the advisor moves there, measures a window on one core per side, fits how
    each side scales and keeps the faster split: overlap, or back to turn-taking when the
    guess was wrong."""
    recorder = SpanRecorder()
    start = starting_split((0, 1), 1, False)
    advisor = SplitAdvisor(start, (0, 1), 1, window=1, auto=True)
    record(recorder, 0, 9.0, 9.0, False)
    record(recorder, 1, 4.0, 4.0, False)
    first = advisor.step(recorder)
    assert first.apply.overlap and first.apply.trainer_cores == (0,) and not first.final
    assert first.apply.predicted_s == 7.25 and first.assumed
    record(recorder, 2, 20.0, 20.0, True)  # warm-up after the switch: not measured
    assert advisor.step(recorder) is None
    record(recorder, 3, generate, train, True, fill)
    final = advisor.step(recorder)
    assert final.final and not final.assumed and final.model.efficiencies_measured
    assert [s.rates.overlap for s in advisor.steps] == [False, True]
    if keeps_overlap:
        assert final.apply is None and advisor.current.overlap
        assert final.plan.chosen.predicted_s == 6.0
    else:
        assert final.apply.same_split(start) and final.apply.predicted_s == 8.5
    assert advisor.step(recorder) is None


@pytest.mark.parametrize(("left", "moves"), [(1, False), (2, True), (None, True)])
def test_auto_guesses_only_where_the_run_can_repay_a_wrong_guess(left, moves):
    """The balanced workload above: overlap hopes to gain 1.25 s per iteration (8.5 against
    7.25 s). If both sides scaled linearly it would cost 1 s per iteration instead (8 + 8 / 8
    + 0.5 = 9.5 s), for the warm-up after the move and the window measured there (2). With one
    iteration left (1.25 < 2 s) the run keeps taking turns, says why, and remembers nothing;
    with two (2.5 s) or no bound it tries."""
    recorder = SpanRecorder()
    start = starting_split((0, 1), 1, False)
    advisor = SplitAdvisor(start, (0, 1), 1, window=1, auto=True)
    record(recorder, 0, 9.0, 9.0, False)
    record(recorder, 1, 4.0, 4.0, False)
    step = advisor.step(recorder, iterations_left=left)
    assert step.plan.chosen.overlap  # the advice is the same either way
    if moves:
        assert step.apply is not None and not step.final and step.deferred is None
        assert step.metrics()["split/deferred"] == 0.0
    else:
        assert step.apply is None and step.final and advisor.current is start
        assert step.deferred.startswith("not explored: 1 iteration(s) left")
        assert "at most 1.25 s" in step.reason and "up to 2 s" in step.reason
        assert step.metrics()["split/deferred"] == 1.0 and step.metrics()["split/applied"] == 0.0
        record(recorder, 2, 4.0, 4.0, False)
        assert advisor.step(recorder, iterations_left=0) is None


def test_iterations_left_from_the_trainers_limits():
    def trainer(max_steps=-1, global_step=0, batches=float("inf"), epochs=-1, done=0):
        loop = SimpleNamespace(total_batch_idx=done)
        return SimpleNamespace(
            max_steps=max_steps, global_step=global_step, num_training_batches=batches,
            max_epochs=epochs, fit_loop=loop,
        )  # fmt: skip

    assert iterations_left(trainer()) is None  # unbounded
    assert iterations_left(trainer(max_steps=3, global_step=2)) == 1
    assert iterations_left(trainer(batches=10, epochs=2, done=15)) == 5
    assert iterations_left(trainer(max_steps=8, global_step=1, batches=10, epochs=2)) == 7
    assert iterations_left(trainer(max_steps=3, global_step=5)) == 0


def test_auto_needs_a_core_for_each_side():
    with pytest.raises(ValueError, match="at least num_workers \\+ 1 = 3 cores"):
        starting_split((0, 1), 2, True)
    with pytest.raises(ValueError, match="use_ray: true"):
        auto_start(1, False, None, None, 0, None)


def test_cached_mode_measures_one_window_and_never_switches():
    """A cached turn-taking split, although overlap measures much faster: logged, not moved."""
    recorder = SpanRecorder()
    cached = starting_split((0, 1), 1, False)
    model = SplitModel(0.0, 0.0, min_gain=0.0)
    advisor = SplitAdvisor(cached, (0, 1), 1, window=2, model=model, cached=True)
    record(recorder, 0, 9.0, 9.0, False)  # warm-up
    record(recorder, 1, 4.0, 4.0, False)
    assert advisor.step(recorder) is None
    record(recorder, 2, 4.0, 4.0, False)
    step = advisor.step(recorder)
    assert step.final and step.cached and step.apply is None
    assert step.plan.chosen.overlap  # the advice differs; it is only logged
    assert step.metrics()["split/cached"] == 1.0 and step.metrics()["split/applied"] == 0.0
    for i in range(3, 8):
        record(recorder, i, 4.0, 4.0, False)
        assert advisor.step(recorder) is None
    assert len(advisor.steps) == 1 and advisor.current is cached
    with pytest.raises(ValueError, match="measured, not explored"):
        SplitAdvisor(cached, (0, 1), 1, auto=True, cached=True)


def test_a_miss_remembers_the_final_choice_and_the_next_run_starts_on_it(tmp_path):
    """As the strategy does: an exploring run writes its final step's choice; a run with the
    same key reads it back and, in cached mode, measures it without switching."""
    path, key = tmp_path / "hardware_split.json", {"run": "same"}
    miss = SplitCache(path, key, read_cache(path, key))
    assert miss.hit is None
    recorder = SpanRecorder()
    advisor = SplitAdvisor(starting_split((0, 1), 1, False), (0, 1), 1, window=1, auto=True)
    record(recorder, 0, 9.0, 9.0, False)
    record(recorder, 1, 4.0, 4.0, False)
    first = advisor.step(recorder)
    assert not first.final and first.metrics()["split/cached"] == 0.0
    record(recorder, 2, 9.0, 9.0, True)
    record(recorder, 3, 4.0, 5.0, True)
    final = advisor.step(recorder)
    assert final.final
    written = miss.remember(final, advisor.windows)
    hit = SplitCache(path, key, read_cache(path, key)).hit
    assert hit == written and hit.split == final.plan.chosen and hit.split.overlap
    assert hit.model == final.model and list(hit.windows) == advisor.windows
    assert hit.date[:4].isdigit()

    again = SpanRecorder()
    cached = SplitAdvisor(hit.split, (0, 1), 1, window=1, model=hit.model, cached=True)
    for i in range(6):
        record(again, i, 4.0, 2.0, True)
        step = cached.step(again)
        assert step is None or (step.apply is None and step.cached)
    assert len(cached.steps) == 1 and cached.current.same_split(final.plan.chosen)


@pytest.mark.parametrize("measured", [False, True])
def test_fixed_split_advice_uses_measured_efficiencies_or_says_they_are_assumed(measured):
    """Turn-taking on both cores, generation 4 s and training 6 s per iteration: with the
    assumed efficiency (0.5) one core each looks faster (max(6, 9) + 0.5 < 10.5 s), and the
    advice says the efficiency is assumed; with the efficiencies an auto run measured (1.0:
    time x cores constant), turn-taking stays best, and nothing is said to be assumed."""
    model = SplitModel(1.0, 1.0, efficiencies_measured=True) if measured else None
    advisor = log_only_advisor(False, [[0, 1]], True, 1, None, [0, 1], window=1, model=model)
    recorder = SpanRecorder()
    record(recorder, 0, 9.0, 9.0, False)
    record(recorder, 1, 4.0, 6.0, False)
    step = advisor.step(recorder)
    assert step.assumed is not measured
    assert ("assumed" in step.reason) is not measured
    assert step.plan.chosen.overlap is not measured


@pytest.mark.parametrize("worker_cores", [None, [[1]]], ids=["no-split", "split-given"])
def test_split_metrics_are_logged_only_when_a_split_is_in_use(worker_cores, caplog):
    """A run without ``worker_cores`` gets the advice as one log line, not ``split/*`` columns."""
    from periodic_rl.cpu_tuning import CPUTuning

    logged: list[dict[str, float]] = []
    logger = SimpleNamespace(log_metrics=lambda metrics, step: logged.append(dict(metrics)))
    trainer = SimpleNamespace(
        loggers=[logger], global_step=4, callback_metrics={}, max_steps=10, max_epochs=None,
        num_training_batches=float("inf"),
    )  # fmt: skip
    step = SimpleNamespace(
        metrics=lambda: {"split/generation_s": 5.0}, reason="keep the split", apply=None,
        final=False, deferred=False,
    )  # fmt: skip
    tuning = CPUTuning(worker_cores=worker_cores, trainer_cores=[0] if worker_cores else None)
    tuning.split_advisor = SimpleNamespace(step=lambda spans, left: step)
    run = SimpleNamespace(
        lightning_module=SimpleNamespace(trainer=trainer), rollouts=SimpleNamespace(spans=None)
    )
    with caplog.at_level("INFO", logger="periodic_rl"):
        tuning.between_iterations(run)
    assert "hardware split: keep the split" in caplog.text  # the advice, either way
    if worker_cores is None:
        assert logged == [] and "split/generation_s" not in trainer.callback_metrics
    else:
        assert logged == [{"split/generation_s": 5.0}]
        assert "split/generation_s" in trainer.callback_metrics
