"""The DeepSpeed paths (:mod:`periodic_rl.compat.deepspeed` and the strategy that uses them): the
config the strategy gives DeepSpeed (the module's clip, a clashing clip and fp16 refused), the
loss scale put back after the step without undoing the dynamic scaler, and ZeRO-3 models
partitioned as they load.

Everything up to DeepSpeed's own code runs everywhere: where DeepSpeed is not installed, the
strategy is built with a stand-in ``deepspeed`` module (its constructor only sets a logger) and
transformers' ``HfDeepSpeedConfig`` with a stand-in that registers itself the same way. Loading
partitioned needs the ``deepspeed`` package, a training run CUDA.
"""

from __future__ import annotations

import importlib.util
import logging
import socket
import sys
import types
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from periodic_rl.compat.deepspeed import (
    divide_at_next_step,
    restore_loss_scale,
    training_config,
    zero3_loading,
)

NEEDS_DEEPSPEED = "needs the deepspeed package: pip install 'periodic_rl[deepspeed]'"
DEEPSPEED_INSTALLED = importlib.util.find_spec("deepspeed") is not None
ZERO2 = {"zero_optimization": {"stage": 2}}
ZERO3 = {
    "zero_optimization": {"stage": 3},
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
}


# ---- the config: the module's clip, fp16 refused ------------------------------------------------
@pytest.mark.parametrize(("max_grad_norm", "clip"), [(0.5, 0.5), (None, 0.0)])
def test_config_carries_the_module_clip(max_grad_norm, clip):
    config = training_config(ZERO2, max_grad_norm)
    assert config["gradient_clipping"] == clip
    assert config["zero_optimization"] == {"stage": 2}
    assert "gradient_clipping" not in ZERO2  # the user's dict is left as it was


def test_config_refuses_a_clip_of_its_own_that_differs():
    with pytest.raises(ValueError, match=r"gradient_clipping=1\.0.*max_grad_norm is 0\.5"):
        training_config({**ZERO2, "gradient_clipping": 1.0}, 0.5)
    assert training_config({**ZERO2, "gradient_clipping": 0.5}, 0.5)["gradient_clipping"] == 0.5


def test_config_refuses_fp16():
    with pytest.raises(ValueError, match=r"fp16\.enabled.*bf16"):
        training_config({**ZERO2, "fp16": {"enabled": True}}, 1.0)
    assert training_config({**ZERO2, "fp16": {"enabled": False}}, 1.0)["gradient_clipping"] == 1.0


# ---- the loss scale after the step --------------------------------------------------------------
@dataclass
class DynamicScaler:
    """Stands in for DeepSpeed's ``DynamicLossScaler``: halves the scale on an overflow (not
    below ``min_scale``), doubles it after ``window`` clean steps."""

    cur_scale: float
    min_scale: float = 1.0
    window: int = 1000
    clean: int = 0

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            self.cur_scale, self.clean = max(self.cur_scale / 2, self.min_scale), 0
            return
        self.clean += 1
        if self.clean % self.window == 0:
            self.cur_scale *= 2


@dataclass
class Engine:
    """A ZeRO engine as far as the loss scale goes: ``step`` divides the gradient by the scale
    (when it did not overflow), then lets the scaler update it."""

    scaler: DynamicScaler
    applied: list[float | None] = field(default_factory=list)

    @property
    def optimizer(self) -> Engine:
        return self

    @property
    def loss_scaler(self) -> DynamicScaler:
        return self.scaler

    def step(self, grad: float, overflow: bool = False) -> None:
        self.applied.append(None if overflow else grad / self.scaler.cur_scale)
        self.scaler.update_scale(overflow)


def iteration(engine: Engine, grad: float, denominator: float, overflow: bool = False) -> None:
    """One iteration of the strategy: divide at the step, step, put the scale back."""
    saved = divide_at_next_step(engine, denominator)
    engine.step(grad * saved, overflow)  # the backward ran at the saved scale
    restore_loss_scale(engine, saved, denominator)


def test_loss_scale_is_put_back_after_a_clean_step():
    engine = Engine(DynamicScaler(cur_scale=1024.0))
    iteration(engine, grad=6.0, denominator=3.0)
    assert engine.applied == [2.0]  # divided by the normaliser exactly
    assert engine.scaler.cur_scale == 1024.0


def test_overflow_back_off_is_kept():
    engine = Engine(DynamicScaler(cur_scale=1024.0))
    iteration(engine, grad=6.0, denominator=3.0, overflow=True)
    assert engine.scaler.cur_scale == 512.0  # the back-off, not the scale from before
    iteration(engine, grad=6.0, denominator=3.0)
    assert engine.applied == [None, 2.0]


def test_growth_is_kept_and_the_floor_holds():
    engine = Engine(DynamicScaler(cur_scale=1024.0, window=1))
    iteration(engine, grad=6.0, denominator=3.0)
    assert engine.scaler.cur_scale == 2048.0
    floored = Engine(DynamicScaler(cur_scale=1.0, min_scale=1.0))
    iteration(floored, grad=6.0, denominator=1000.0, overflow=True)
    assert floored.scaler.cur_scale == 1.0


# ---- ZeRO-3 loading -----------------------------------------------------------------------------
def test_zero3_loading_leaves_other_stages_alone(tiny_llama_path):
    from transformers.integrations import is_deepspeed_zero3_enabled

    from periodic_rl.models import load_causal_lm

    with zero3_loading({**ZERO2, "train_micro_batch_size_per_gpu": 1}):
        assert not is_deepspeed_zero3_enabled()
        model = load_causal_lm(tiny_llama_path)
    assert not any(hasattr(p, "ds_id") for p in model.parameters())


@pytest.fixture
def one_rank_group(monkeypatch):
    """A one-process gloo group on loopback and the environment Lightning's DeepSpeed strategy
    sets, as DeepSpeed's ``zero.Init`` needs both."""
    deepspeed = pytest.importorskip("deepspeed", reason=NEEDS_DEEPSPEED)
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield deepspeed
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: zero.Init partitions onto CUDA"
)
def test_zero3_loading_partitions_as_it_loads(tiny_llama_path, one_rank_group):
    from transformers.integrations import is_deepspeed_zero3_enabled

    from periodic_rl.models import load_causal_lm

    whole = load_causal_lm(tiny_llama_path)
    with zero3_loading(ZERO3):
        assert is_deepspeed_zero3_enabled()
        model = load_causal_lm(tiny_llama_path)
    assert not is_deepspeed_zero3_enabled()  # later loads (engine, reward model) load whole
    params = list(model.parameters())
    assert all(hasattr(p, "ds_id") and p.numel() == 0 for p in params)  # partitioned
    with one_rank_group.zero.GatheredParameters(params):
        loaded = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(torch.equal(loaded[k], v) for k, v in whole.state_dict().items())


class StandInHfConfig:
    """Stands in for transformers' ``HfDeepSpeedConfig`` where DeepSpeed is not installed (the
    real one derives from accelerate's only then): it registers itself the same way, through
    a weak reference that lives only as long as the object."""

    def __init__(self, config: dict) -> None:
        from transformers.integrations import set_hf_deepspeed_config

        self.config = config
        set_hf_deepspeed_config(self)

    def is_zero3(self) -> bool:
        return self.config.get("zero_optimization", {}).get("stage") == 3


@pytest.fixture
def hf_deepspeed_config(monkeypatch):
    """transformers' ``HfDeepSpeedConfig``: the real one with DeepSpeed installed, else the
    stand-in."""
    if not DEEPSPEED_INSTALLED:
        import transformers.integrations

        monkeypatch.setattr(transformers.integrations, "HfDeepSpeedConfig", StandInHfConfig)


def test_zero3_loading_registers_the_stage3_config_for_the_block(hf_deepspeed_config):
    from transformers.integrations import deepspeed_config, is_deepspeed_zero3_enabled

    with zero3_loading(ZERO3):
        assert is_deepspeed_zero3_enabled()  # from_pretrained builds under zero.Init
        assert deepspeed_config() == ZERO3
    assert not is_deepspeed_zero3_enabled()  # later loads (engine, reward model) load whole


@pytest.fixture
def deepspeed_strategy(monkeypatch):
    """``PeriodicAsyncDeepSpeedStrategy`` constructible where DeepSpeed is not installed:
    Lightning's availability flags set and a stand-in ``deepspeed`` module (the constructor
    only sets its logger's level; nothing else of it runs before a CUDA set-up)."""
    from periodic_rl.strategies import PeriodicAsyncDeepSpeedStrategy

    if not DEEPSPEED_INSTALLED:
        import lightning.pytorch.strategies.deepspeed as lightning_deepspeed

        stand_in = types.ModuleType("deepspeed")
        stand_in.utils = SimpleNamespace(logging=SimpleNamespace(logger=logging.getLogger("ds")))
        monkeypatch.setitem(sys.modules, "deepspeed", stand_in)
        monkeypatch.setattr(lightning_deepspeed, "_DEEPSPEED_AVAILABLE", True)
        monkeypatch.setattr(lightning_deepspeed, "_DEEPSPEED_GREATER_EQUAL_0_16", True)

    def build(max_grad_norm: float | None = 0.5, **kwargs):
        import lightning as L

        from periodic_rl import RLModule

        strategy = PeriodicAsyncDeepSpeedStrategy(
            engine="hf", use_ray=False, overlap=False, logging_batch_size_per_gpu=1, **kwargs
        )
        trainer = L.Trainer(
            strategy=strategy, accelerator="cpu", devices=1, precision="bf16-mixed", logger=False
        )
        module = RLModule(model="unused", max_grad_norm=max_grad_norm)
        strategy.connect(module)
        module.trainer = trainer
        return strategy

    return build


@pytest.mark.parametrize("stage", [2, 3])
def test_strategy_gives_deepspeed_the_modules_clip(deepspeed_strategy, stage):
    strategy = deepspeed_strategy(0.5, stage=stage)
    strategy._init_config_if_needed()  # what Lightning's setup and zero.Init read
    assert strategy.config["gradient_clipping"] == 0.5
    assert strategy.config["bf16"] == {"enabled": True}
    assert strategy.config["zero_optimization"]["stage"] == stage


def test_strategy_refuses_a_config_clip_of_its_own_before_any_model_loads(deepspeed_strategy):
    config = {"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0}
    strategy = deepspeed_strategy(0.5, config=config)
    with pytest.raises(ValueError, match=r"gradient_clipping=1\.0.*max_grad_norm is 0\.5"):
        strategy.setup_environment()  # the first thing Lightning calls once the module is in


@pytest.mark.parametrize("stage", [2, 3])
def test_only_stage3_loads_the_policy_partitioned(deepspeed_strategy, hf_deepspeed_config, stage):
    from transformers.integrations import deepspeed_config, is_deepspeed_zero3_enabled

    strategy = deepspeed_strategy(0.5, stage=stage)
    with strategy.policy_loading():
        assert is_deepspeed_zero3_enabled() == (stage == 3)
        if stage == 3:  # the run's whole config: the clip and precision zero.Init sees
            assert deepspeed_config()["gradient_clipping"] == 0.5
            assert deepspeed_config()["bf16"] == {"enabled": True}
    assert not is_deepspeed_zero3_enabled()


# ---- on a GPU -----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: DeepSpeed ZeRO-3")
def test_zero3_run_loads_the_policy_partitioned(tiny_llama_path):
    pytest.importorskip("deepspeed", reason=NEEDS_DEEPSPEED)
    from rl_helpers import RecordingModule, train

    from periodic_rl.strategies import PeriodicAsyncDeepSpeedStrategy

    class Recorded(RecordingModule):
        def configure_model(self) -> None:
            loaded_before = self.policy is not None
            super().configure_model()
            if not loaded_before:  # the first load: before deepspeed.initialize
                self.partitioned_at_load = all(
                    hasattr(p, "ds_id") for p in self.policy.parameters()
                )

    _, module, strategy = train(
        tiny_llama_path,
        steps=1,
        strategy={"engine": "hf", "use_ray": False, "overlap": False, "stage": 3},
        strategy_cls=PeriodicAsyncDeepSpeedStrategy,
        module_cls=Recorded,
        max_grad_norm=0.5,
    )
    assert module.partitioned_at_load
    assert strategy.config["gradient_clipping"] == 0.5
    assert strategy.policy_version == 1
