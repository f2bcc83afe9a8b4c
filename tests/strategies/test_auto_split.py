"""The measured hardware split in a run: logged after a window, applied with
``worker_cores: auto`` (trainer re-pinned, overlap switched, workers moved to new cores)
without changing any number of the run, and remembered: the next run starts on the choice.

Real Ray actors with the transformers engine on a tiny model; each run pins this test process
(the trainer), so its cores and torch threads are restored after every test.
"""

import logging
import os

import pytest
from rl_helpers import assert_same_update, train, with_tuning

from periodic_rl import CPUTuning, PeriodicAsyncStrategy
from periodic_rl.cli import main
from periodic_rl.cpu_tuning import split_advisor, split_cache
from periodic_rl.cpu_tuning.hardware_split import SplitModel
from periodic_rl.rollout.controller import RolloutController

pytestmark = pytest.mark.usefixtures("restore_trainer_cores")

CORES = sorted(os.sched_getaffinity(0))
needs_two_cores = pytest.mark.skipif(len(CORES) < 2, reason="splits two cores")


@pytest.fixture(autouse=True)
def split_cache_file(tmp_path, monkeypatch):
    """Each test its own split cache: a run here never starts on a choice of another."""
    path = tmp_path / "hardware_split.json"
    monkeypatch.setenv(split_cache.CACHE_ENV, str(path))
    return path


def _strategy(**kwargs) -> dict:
    return {"engine": "hf", "num_workers": 1, "groups_per_call": 1, "split_after": 1, **kwargs}


@needs_two_cores
def test_auto_split_switches_twice_and_trains_as_a_fixed_split(
    tiny_llama_path, local_ray, monkeypatch, caplog, split_cache_file
):
    """Turn-taking on both cores (iterations 0-1), overlap on 1 + 1 cores (2-3, the first fit
    forced to favour it), then back to turn-taking (4, the second fit forced to favour it): the
    same update as a run pinned throughout, and each side really moved. The choice is
    remembered: a second run with the same cache starts on it, measures it once and moves
    nothing."""
    favours_overlap = SplitModel(0.0, 0.0, min_gain=0.0, efficiencies_measured=True)
    favours_turns = SplitModel(1.0, 1.0, 100.0, min_gain=0.0, efficiencies_measured=True)
    moves = []
    original = RolloutController.set_worker_cores

    pids = []

    def recording(self, worker_cores):
        pids.append(self.backend.worker_pids())
        original(self, worker_cores)
        pids.append(self.backend.worker_pids())
        affinity = [info["affinity"] for info in self.backend.worker_info()]
        moves.append((self.overlap, sorted(os.sched_getaffinity(0)), affinity))

    monkeypatch.setattr(RolloutController, "set_worker_cores", recording)
    first, rest = CORES[0], CORES[1:]
    fixed = train(
        tiny_llama_path,
        steps=5,
        strategy=_strategy(overlap=True, worker_cores=[rest], trainer_cores=[first]),
    )
    assert not moves  # a fixed split is only logged
    (logged,) = fixed[2].tuning.split_advisor.steps
    assert fixed[2].tuning.split_advisor.model.lend_idle_cores  # the run's option, modelled
    assert logged.apply is None and logged.plan is not None
    assert logged.assumed  # no run of this workload has measured the efficiencies yet
    os.sched_setaffinity(0, CORES)  # the fixed run pinned this process to its trainer core
    monkeypatch.setattr(  # for the auto run and after
        split_advisor,
        "fit_model",
        lambda windows, base: favours_overlap if len(windows) == 1 else favours_turns,
    )
    caplog.clear()  # the fixed run's own advice line (INFO is shown by default)
    with caplog.at_level(logging.INFO, logger="periodic_rl.cpu_tuning.plugin"):
        auto = train(tiny_llama_path, steps=5, strategy=_strategy(worker_cores="auto"))
    # The fixed run's trainer has one core; the auto run's has both while taking turns.
    assert_same_update(fixed, auto, "auto split against a fixed one", same_threads=False)
    assert moves == [
        (True, [first], [rest]),  # overlap on disjoint cores
        (False, CORES, [CORES]),  # back to turn-taking: both sides on every core
    ]
    assert len(pids) == 4 and all(p == pids[0] for p in pids)  # moved in place
    steps = auto[2].tuning.split_advisor.steps
    assert auto[2].tuning.split_advisor.model.lend_idle_cores
    assert [s.final for s in steps] == [False, True]
    assert [s.rates.overlap for s in steps] == [False, True]
    assert [s.rates.training.units for s in steps] == [len(CORES), 1]
    metrics = auto[1].trainer.callback_metrics
    assert metrics["split/applied"] == 1.0 and metrics["split/overlap"] == 0.0
    assert metrics["split/generation_s"] > 0 and metrics["split/training_s"] > 0
    lines = [r.getMessage() for r in caplog.records if "hardware split" in r.getMessage()]
    assert len(lines) == 2 and all("applying it" in line for line in lines)
    assert metrics["split/cached"] == 0.0 and split_cache_file.exists()

    caplog.clear()
    os.sched_setaffinity(0, CORES)
    with caplog.at_level(logging.INFO, logger="periodic_rl.cpu_tuning.plugin"):
        again = train(tiny_llama_path, steps=3, strategy=_strategy(worker_cores="auto"))
    assert len(moves) == 2  # no switch
    strategy = again[2]
    assert strategy.tuning.split_start.same_split(steps[-1].plan.chosen)
    assert (strategy.rollouts.overlap, strategy.tuning.trainer_cores) == (False, CORES)
    assert strategy.rollouts.worker_cores == [CORES]
    (step,) = strategy.tuning.split_advisor.steps
    assert step.cached and step.apply is None and step.rates.overlap is False
    assert again[1].trainer.callback_metrics["split/cached"] == 1.0
    lines = [r.getMessage() for r in caplog.records if "hardware split" in r.getMessage()]
    assert lines[0].startswith("hardware split: cached from ") and "applying" not in lines[1]

    # a fixed split of the same workload advises from what the auto run measured
    os.sched_setaffinity(0, CORES)
    advised = train(tiny_llama_path, steps=3, strategy=_strategy(overlap=False))
    (advice,) = advised[2].tuning.split_advisor.steps
    assert not advice.assumed and advice.apply is None
    assert advised[2].tuning.split_advisor.model == strategy.tuning.split_advisor.model


@needs_two_cores
def test_a_guess_the_run_cannot_repay_is_not_tried_nor_remembered(
    tiny_llama_path, local_ray, monkeypatch, split_cache_file
):
    """With the efficiencies assumed and overlap predicted faster, a 4-step run is asked at
    its first window (iteration 2 of 0-3) with 2 iterations left; judged too short, it keeps
    taking turns, logs why, and writes nothing to the cache (a longer run may still try)."""
    favours_overlap = SplitModel(0.0, 0.0, min_gain=0.0)  # assumed, not measured
    asked = []

    def too_short(plan, current, rates, cores, workers, model, left, window):
        asked.append((plan.chosen.overlap, left, window))
        return "not explored: the test says so"

    monkeypatch.setattr(split_advisor, "fit_model", lambda windows, base: favours_overlap)
    monkeypatch.setattr(split_advisor, "too_short_to_explore", too_short)
    run = train(tiny_llama_path, steps=4, strategy=_strategy(worker_cores="auto"))
    assert asked == [(True, 2, 1)]
    (step,) = run[2].tuning.split_advisor.steps
    assert step.final and step.apply is None and step.deferred
    assert (run[2].rollouts.overlap, run[2].tuning.trainer_cores) == (False, CORES)
    assert run[1].trainer.callback_metrics["split/deferred"] == 1.0
    assert not split_cache_file.exists()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ray_address": "ray://elsewhere:10001"}, "a cluster's workers run elsewhere"),
        ({"use_ray": False, "overlap": False}, "use_ray: true"),
        ({"gpus_per_worker": 1}, "splits CPU cores"),
        ({"max_staleness": 1}, "max_staleness > 0"),
        ({"trainer_cores": [0]}, "leave trainer_cores unset"),
        ({"split_after": 0}, "split_after must be >= 1"),
    ],
)
def test_auto_split_refuses_what_it_cannot_apply(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PeriodicAsyncStrategy(**with_tuning({"engine": "hf", "worker_cores": "auto", **kwargs}))


def test_worker_cores_must_be_lists_or_auto():
    with pytest.raises(ValueError, match="lists of cores, 'auto' or null"):
        PeriodicAsyncStrategy(engine="hf", tuning=CPUTuning(worker_cores="all"))


@needs_two_cores
def test_auto_split_refuses_gpu_training():
    strategy = PeriodicAsyncStrategy(
        engine="hf", tuning=CPUTuning(worker_cores="auto"), device="cuda:0"
    )
    with pytest.raises(ValueError, match="splits CPU cores; training on GPUs"):
        strategy.tuning.before_setup(strategy)


def test_worker_cores_auto_from_yaml(tmp_path, capsys):
    config = tmp_path / "auto.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: periodic_rl.PeriodicAsyncStrategy\n"
        "    init_args:\n      engine: hf\n      tuning:\n"
        "        class_path: periodic_rl.CPUTuning\n"
        "        init_args: {worker_cores: auto, split_after: 2}\n"
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "worker_cores: auto" in printed and "split_after: 2" in printed
    assert "class_path: periodic_rl.CPUTuning" in printed and "lend_idle_cores: true" in printed
