"""Checkpoints: resume equivalence, atomic writes, weights_only loading."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from rl_helpers import length_reward, max_diff

from periodic_rl import PeriodicAsyncStrategy, PromptDataModule, RLModule
from periodic_rl.checkpoint import AtomicCheckpointIO

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


def _fit(model_path, root, steps, lora=None, ckpt_path=None):
    L.seed_everything(0, verbose=False)
    module = RLModule(
        model=model_path,
        num_generations=2,
        micro_batch_size=2,
        max_new_tokens=6,
        learning_rate=1e-3,
        reward_funcs=[length_reward],
        lora=lora,
    )
    trainer = L.Trainer(
        strategy=PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False),
        max_steps=steps,
        default_root_dir=root,
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=root / "ckpt", save_last=True, every_n_train_steps=1)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = PromptDataModule(batch_size=2, num_train=40, num_val=0)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    params = {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}
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
