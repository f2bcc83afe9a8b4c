"""Learning-rate schedules: warm-up then decay, stepped once per iteration, logged, from YAML."""

from __future__ import annotations

import math
import sys

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from rl_helpers import length_reward

from periodic_rl import PeriodicAsyncStrategy, PromptDataModule, RLModule
from periodic_rl.cli import main
from periodic_rl.optim import fused_allowed, fused_supported

LR = 1e-2


class LearningRates(L.Callback):
    """The rate each iteration's optimizer step uses."""

    def __init__(self) -> None:
        self.rates: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.rates.append(trainer.optimizers[0].param_groups[0]["lr"])


def fit(root, model_path, steps, precision="32-true", **module_kwargs):
    L.seed_everything(0, verbose=False)
    module = RLModule(
        model=model_path,
        num_generations=2,
        max_new_tokens=4,
        learning_rate=LR,
        reward_funcs=[length_reward],
        shared_prompt=False,
        **module_kwargs,
    )
    rates = LearningRates()
    trainer = L.Trainer(
        strategy=PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False),
        max_steps=steps,
        logger=CSVLogger(root),
        log_every_n_steps=1,
        callbacks=[rates],
        precision=precision,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=PromptDataModule(batch_size=1, num_train=8, num_val=0))
    return trainer, rates.rates


def cosine_with_warmup(step: int, warmup: int, total: int, floor: float = 0.0) -> float:
    if step < warmup:
        return LR * step / warmup
    progress = (step - warmup) / (total - warmup)
    return LR * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def logged(trainer, name: str) -> list[float]:
    import csv

    with open(trainer.logger.log_dir + "/metrics.csv") as f:
        return [float(row[name]) for row in csv.DictReader(f) if row.get(name)]


def test_warmup_then_cosine(tiny_llama_path, tmp_path):
    trainer, rates = fit(tmp_path, tiny_llama_path, 5, lr_scheduler="cosine", warmup_steps=2)
    expected = [cosine_with_warmup(s, 2, 5) for s in range(5)]  # 0, 0.5, 1, 0.75, 0.25 x LR
    assert rates == pytest.approx(expected, abs=1e-12)
    assert logged(trainer, "lr") == pytest.approx(expected, rel=1e-6)  # logged as float32
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 5  # stepped once per step


def test_warmup_ratio_linear_and_floor(tiny_llama_path, tmp_path):
    _, rates = fit(tmp_path / "a", tiny_llama_path, 4, lr_scheduler="linear", warmup_ratio=0.25)
    assert rates == pytest.approx([0.0, LR, LR * 2 / 3, LR / 3], abs=1e-12)  # 1 warm-up step
    _, rates = fit(
        tmp_path / "b",
        tiny_llama_path,
        3,
        lr_scheduler="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
    )
    assert rates == pytest.approx([cosine_with_warmup(s, 0, 3, 0.1) for s in range(3)])


def test_constant_by_default(tiny_llama_path, tmp_path):
    trainer, rates = fit(tmp_path, tiny_llama_path, 2)
    assert rates == [LR, LR] and trainer.lr_scheduler_configs == []
    # torch's fused AdamW kernel on the CPU: it updates each tensor in one pass (~5x faster)
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"] is True
    assert all(s["step"].item() == 2 for s in optimizer.state.values())


def test_bf16_mixed_keeps_the_fused_kernel_and_clips(tiny_llama_path, tmp_path):
    """``bf16-mixed`` has no loss scaler, so nothing for a fused step to unscale: the fused
    kernel stays (Lightning's AMP plugin would refuse to clip its gradients), and the gradients
    are clipped: to a norm so small here that AdamW barely moves the weights."""
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(tiny_llama_path).state_dict()
    moved = {}
    for clip in (None, 1e-12):
        trainer, rates = fit(
            tmp_path / str(clip), tiny_llama_path, 1, precision="bf16-mixed", max_grad_norm=clip
        )
        assert rates == [LR] and trainer.optimizers[0].defaults["fused"] is True
        policy = trainer.lightning_module.policy
        moved[clip] = max((p - start[n]).abs().max().item() for n, p in policy.named_parameters())
    assert moved[None] > 1e-3 > 1e-4 > moved[1e-12], moved


def test_fused_only_under_plugins_without_a_loss_scaler():
    """Under a loss scaler (``16-mixed``; on the CPU Lightning turns it into ``bf16-mixed``,
    hence no fit here) a fused step would unscale the gradients after they were clipped: the
    optimizer is torch's default one there."""
    from types import SimpleNamespace

    from lightning.pytorch.plugins.precision import FSDPPrecision, MixedPrecision, Precision

    def allowed(plugin) -> bool:
        return fused_allowed(SimpleNamespace(_trainer=SimpleNamespace(precision_plugin=plugin)))

    assert allowed(Precision()) and allowed(MixedPrecision("bf16-mixed", "cpu"))
    assert not allowed(MixedPrecision("16-mixed", "cpu"))
    assert not allowed(FSDPPrecision("bf16-mixed"))


def test_fused_only_where_torch_has_the_kernel():
    plain = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    assert fused_supported(plain)
    assert not fused_supported([])
    assert not fused_supported(plain + [torch.nn.Parameter(torch.zeros(3, device="meta"))])

    class Sharded(torch.Tensor):  # a tensor subclass, as FSDP2's DTensor is
        pass

    assert not fused_supported(plain + [torch.zeros(3).as_subclass(Sharded)])


def test_fused_update_matches_the_reference_loop():
    """The fused kernel is the same AdamW: from the same state and gradients, it lands where
    torch's per-tensor loop does (to float32 rounding), over steps and a resumed state."""
    torch.manual_seed(0)
    start = [torch.randn(5, 3), torch.randn(7)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(4)]
    results = []
    for fused in (True, False):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=fused)
        for step, step_grads in enumerate(grads):
            if step == 2:  # a resume: the state as a checkpoint holds it, into a fresh optimizer
                state = optimizer.state_dict()
                optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=fused)
                optimizer.load_state_dict(state)
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.clone()
            optimizer.step()
        results.append([p.detach() for p in params])
    for fused_p, loop_p in zip(*results, strict=True):
        torch.testing.assert_close(fused_p, loop_p, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"lr_scheduler": "exponential"}, "lr_scheduler"),
        ({"lr_scheduler": "reduce_lr_on_plateau"}, "lr_scheduler"),
        ({"lr_scheduler": "constant", "warmup_steps": 3}, "constant_with_warmup"),
        ({"lr_scheduler": "cosine", "warmup_ratio": 1.5}, "warmup_ratio"),
        ({"lr_scheduler": "cosine", "warmup_steps": -1}, "warmup_steps"),
    ],
)
def test_bad_schedule_names_the_field(tiny_llama_path, kwargs, field):
    with pytest.raises(ValueError, match=field):
        RLModule(model=tiny_llama_path, **kwargs)


def test_schedule_from_the_command_line(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["periodic-rl"])
    args = ["fit", "--model.init_args.lr_scheduler", "cosine"]
    args += ["--model.init_args.warmup_ratio", "0.1", "--print_config"]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "lr_scheduler: cosine" in printed and "warmup_ratio: 0.1" in printed
