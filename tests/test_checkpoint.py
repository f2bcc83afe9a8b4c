"""Checkpoints: resume equivalence, atomic writes, weights_only loading."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from rl_helpers import length_reward, max_diff

from periodic_rl import PeriodicAsyncStrategy, PromptDataModule, RLModule
from periodic_rl.checkpoint import AtomicCheckpointIO

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


class StopAt(L.Callback):
    """Stop the run after ``step`` iterations, as an interruption would (the schedule still
    spans the whole ``max_steps``)."""

    def __init__(self, step: int | None) -> None:
        self.step = step
        self.rates: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.rates.append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.should_stop = True


def _fit(model_path, root, steps, lora=None, ckpt_path=None, stop_at=None, **module_kwargs):
    L.seed_everything(0, verbose=False)
    kwargs = dict(
        model=model_path,
        num_generations=2,
        micro_batch_size=2,
        max_new_tokens=6,
        learning_rate=1e-3,
        reward_funcs=[length_reward],
        lora=lora,
    )
    module = RLModule(**{**kwargs, **module_kwargs})
    stop = StopAt(stop_at)
    checkpoint = ModelCheckpoint(dirpath=root / "ckpt", save_last=True, every_n_train_steps=1)
    trainer = L.Trainer(
        strategy=PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False),
        max_steps=steps,
        default_root_dir=root,
        logger=False,
        callbacks=[checkpoint, stop],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = PromptDataModule(batch_size=2, num_train=40, num_val=0)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    params = {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}
    trainer.rates = stop.rates
    return params, trainer


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_resume_equals_uninterrupted(tiny_llama_path, tmp_path, lora):
    straight, _ = _fit(tiny_llama_path, tmp_path / "a", 4, lora)
    _fit(tiny_llama_path, tmp_path / "b", 2, lora)
    last = tmp_path / "b" / "ckpt" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=True)  # loads without unpickling code
    assert checkpoint["global_step"] == 2 and checkpoint["periodic_rl"]["policy_version"] == 2
    if lora is not None:
        assert all("lora_" in k for k in checkpoint["state_dict"])  # adapter only
    resumed, trainer = _fit(tiny_llama_path, tmp_path / "b", 4, lora, ckpt_path=str(last))
    assert trainer.strategy.policy_version == 4
    assert max_diff(straight, resumed) == 0.0


def test_resume_continues_the_lr_schedule(tiny_llama_path, tmp_path):
    schedule = {"lr_scheduler": "cosine", "warmup_steps": 1}
    straight, uninterrupted = _fit(tiny_llama_path, tmp_path / "a", 4, **schedule)
    _, first = _fit(tiny_llama_path, tmp_path / "b", 4, stop_at=2, **schedule)
    last = tmp_path / "b" / "ckpt" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=True)
    assert checkpoint["global_step"] == 2 and checkpoint["lr_schedulers"][0]["last_epoch"] == 2
    resumed, second = _fit(tiny_llama_path, tmp_path / "b", 4, ckpt_path=str(last), **schedule)
    assert first.rates + second.rates == uninterrupted.rates
    assert len(set(uninterrupted.rates)) == 4  # warm-up from 0, then a decay: it did schedule
    assert max_diff(straight, resumed) == 0.0


def test_interrupted_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1, "w": torch.ones(3)}, path)

    def crash(obj, handle, *args, **kwargs):
        handle.write(b"partial bytes")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"step": 2, "w": torch.zeros(3)}, path)
    monkeypatch.undo()
    assert io.load_checkpoint(path)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temp file left
