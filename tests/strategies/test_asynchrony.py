"""A run that chooses its staleness within an ``asynchrony`` budget, through the strategy and
RLModule on the in-process engine.

The chooser's measurements are scripted (its clock advances a fixed pace per iteration, by the
staleness running; the pipelined pace it predicts is fixed), so that each run's decisions, and
with them its schedule, are known in advance; everything else is a real run. Each group must
carry the version the switched schedule names for its iteration, and the budget must hold
whatever the chooser is told.
"""

from __future__ import annotations

import pytest
import torch
from rl_helpers import RecordingModule, fit_checkpointed, max_diff, train

from periodic_rl import PeriodicAsyncStrategy
from periodic_rl.rollout import chooser as chooser_module
from periodic_rl.rollout.schedule import RolloutSchedule

LOCAL = {"engine": "hf", "use_ray": False, "overlap": False, "asynchrony_window": 1}
#: seconds per iteration the scripted clock advances, by the staleness running
PACE = {0: 10.0, 1: 5.0, 2: 5.0}


class ScriptedPace(PeriodicAsyncStrategy):
    """The chooser's clock advances ``PACE[k]`` per iteration, ``k`` the staleness running."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.now = 0.0
        self.schedule_chooser.clock = self._clock

    def _clock(self) -> float:
        self.now += PACE[self.rollouts.schedule.max_staleness]
        return self.now


@pytest.fixture
def predicted_s(monkeypatch):
    """The pipelined pace the chooser predicts for every staleness >= 1 (6 s: 1.67x the
    scripted on-policy pace), settable per test."""
    pace = {"s": 6.0}
    monkeypatch.setattr(chooser_module, "predict_period_s", lambda times, k, cycles=8: pace["s"])
    return pace


def _versions(module) -> list[set[int]]:
    return [{v for v, _ in record.stamps} for record in module.records]


def _run(tiny_llama_path, asynchrony, steps):
    strategy = {**LOCAL, "asynchrony": asynchrony}
    _, module, strategy = train(
        tiny_llama_path,
        steps=steps,
        strategy=strategy,
        module_cls=RecordingModule,
        strategy_cls=ScriptedPace,
    )
    return module, strategy


def test_the_run_switches_to_the_predicted_faster_staleness_and_keeps_it(
    tiny_llama_path, predicted_s
):
    module, strategy = _run(tiny_llama_path, {"max_staleness": 2}, steps=7)
    first, kept = strategy.schedule_chooser.decisions
    # iteration 0 warms up, 1 is measured (10 s); k = 1 and 2 are predicted alike: the fresher
    assert first.switch and first.staleness == 1 and first.predicted_s == {1: 6.0, 2: 6.0}
    # from iteration 2 on; 2 warms up, 3 is measured (5 s, faster than 10 s): kept
    assert not kept.switch and kept.measured.period_s == 5.0 and kept.final
    expected = RolloutSchedule(0).switched(2, 1, version=2)
    assert _versions(module) == [{expected.version_for(j)} for j in range(7)]
    assert _versions(module) == [{0}, {1}, {2}, {2}, {3}, {4}, {5}]
    for iteration, record in enumerate(module.records):
        assert record.version == iteration
    assert module.last_iteration.metrics()["staleness/1"] == 1.0
    assert strategy.max_staleness == 2 and not strategy.rollouts.pushes_at_publish


@pytest.mark.parametrize("budget, bound", [("on_policy", 0), ({"max_staleness": 1}, 1)])
def test_the_budget_holds_whatever_the_chooser_predicts(
    tiny_llama_path, predicted_s, budget, bound
):
    predicted_s["s"] = 1e-3  # any staleness predicted 10000x faster
    module, strategy = _run(tiny_llama_path, budget, steps=5)
    lags = {record.version - v for record in module.records for v, _ in record.stamps}
    assert max(lags) == bound
    assert all(d.staleness <= bound for d in strategy.schedule_chooser.decisions)
    if bound == 0:
        assert _versions(module) == [{j} for j in range(5)]
        assert strategy.rollouts.pushes_at_publish  # never a snapshot: nothing runs ahead


def test_a_switch_measured_slower_goes_back_on_policy(tiny_llama_path, predicted_s, monkeypatch):
    monkeypatch.setitem(PACE, 1, 12.0)  # predicted 6 s, measured 12 s
    module, strategy = _run(tiny_llama_path, {"max_staleness": 1}, steps=7)
    first, back = strategy.schedule_chooser.decisions
    assert first.staleness == 1 and back.switch and back.staleness == 0
    # decided at iteration 4's start, when iteration 4 was already generated ahead (version 3)
    assert _versions(module) == [{0}, {1}, {2}, {2}, {3}, {5}, {6}]


def test_a_measured_mismatch_over_the_kl_budget_sends_the_run_back(tiny_llama_path, predicted_s):
    module, strategy = _run(tiny_llama_path, {"max_mismatch_kl": 1e-9, "max_staleness": 1}, steps=7)
    first, over = strategy.schedule_chooser.decisions
    assert first.staleness == 1
    assert (
        over.measured.mismatch_kl > 1e-9
        and over.staleness == 0
        and "over the budget" in (over.reason)
    )
    assert _versions(module) == [{0}, {1}, {2}, {2}, {3}, {5}, {6}]


def _fit_checkpointed(model_path, root, steps, ckpt_path=None):
    """``steps`` iterations with ``{max_staleness: 1}``, a checkpoint after every one."""
    strategy = ScriptedPace(**LOCAL, asynchrony={"max_staleness": 1})
    return fit_checkpointed(model_path, root, steps, strategy, ckpt_path)


def test_a_resumed_run_continues_the_schedule_it_switched_to(
    tiny_llama_path, tmp_path, predicted_s
):
    """Switched to k = 1 at iteration 2 and interrupted after iteration 4: the checkpoint keeps
    the switch and the weights iteration 5 is generated with (version 4), so the resumed run
    ends where the uninterrupted one does."""
    straight, _ = _fit_checkpointed(tiny_llama_path, tmp_path / "a", 7)
    _, first = _fit_checkpointed(tiny_llama_path, tmp_path / "b", 5)
    last = tmp_path / "b" / "ckpt" / "last.ckpt"
    saved = torch.load(last, weights_only=True)["periodic_rl"]["ahead"]
    assert saved["schedule"] == [[0, 0, 0], [2, 1, 2]] and list(saved["snapshots"]) == [4]
    resumed, trainer = _fit_checkpointed(tiny_llama_path, tmp_path / "b", 7, ckpt_path=str(last))
    assert trainer.strategy.policy_version == 7
    assert max_diff(straight, resumed) == 0.0
