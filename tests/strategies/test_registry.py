"""Every periodic-async strategy is selectable by name, and DeepSpeed's CPU-checkable parts.

DeepSpeed itself needs CUDA: the full ZeRO-2/3 runs are in benchmarks/gpu.sh.
"""

from types import SimpleNamespace

import pytest
from lightning.pytorch.strategies import StrategyRegistry

from periodic_rl.compat.deepspeed import divide_at_next_step, restore_loss_scale
from periodic_rl.strategies import (
    PeriodicAsyncDDPStrategy,
    PeriodicAsyncDeepSpeedStrategy,
    PeriodicAsyncFSDPStrategy,
    PeriodicAsyncStrategy,
    RolloutStrategy,
)


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("periodic_async", PeriodicAsyncStrategy),
        ("periodic_async_ddp", PeriodicAsyncDDPStrategy),
        ("periodic_async_fsdp", PeriodicAsyncFSDPStrategy),
        ("periodic_async_deepspeed_stage_2", PeriodicAsyncDeepSpeedStrategy),
        ("periodic_async_deepspeed_stage_3", PeriodicAsyncDeepSpeedStrategy),
    ],
)
def test_registered_by_name(name, cls):
    entry = StrategyRegistry[name]
    assert entry["strategy"] is cls
    if "deepspeed" in name:
        assert entry["init_params"] == {"stage": int(name[-1])}


@pytest.mark.parametrize("cls", [PeriodicAsyncDDPStrategy, PeriodicAsyncFSDPStrategy])
def test_rollout_arguments_are_checked_before_lightning(cls):
    with pytest.raises(ValueError, match="num_workers must be >= 1"):
        cls(engine="hf", num_workers=0)
    strategy = cls(engine="hf", num_workers=2, overlap=False)
    assert isinstance(strategy, RolloutStrategy)
    assert strategy.rollouts.options.num_workers == 2 and not strategy.rollouts.options.overlap


def test_deepspeed_gradient_division_goes_through_the_loss_scale():
    """The ZeRO optimizers divide every gradient by ``loss_scaler.cur_scale`` at the step
    (pinned against DeepSpeed on a GPU by benchmarks/gpu.sh): scaling it by the iteration's
    normaliser for one step divides the gradients by it, and the scale is restored."""
    engine = SimpleNamespace(optimizer=SimpleNamespace(loss_scaler=SimpleNamespace(cur_scale=1.0)))
    saved = divide_at_next_step(engine, 37.0)
    assert engine.optimizer.loss_scaler.cur_scale == 37.0
    restore_loss_scale(engine, saved, 37.0)
    assert engine.optimizer.loss_scaler.cur_scale == 1.0


def test_deepspeed_without_a_zero_loss_scale_is_refused_with_the_fix():
    engine = SimpleNamespace(optimizer=SimpleNamespace())
    with pytest.raises(NotImplementedError, match="ZeRO stage 2 or 3"):
        divide_at_next_step(engine, 2.0)
