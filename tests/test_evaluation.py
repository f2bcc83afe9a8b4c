"""Held-out evaluation is Lightning validation: logged with self.log, monitored by checkpoints
and early stopping, run before the first and after the last iteration, and by `validate`."""

from __future__ import annotations

import csv
import sys

import lightning as L
import pytest
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from rl_helpers import length_reward

from periodic_rl import PeriodicAsyncStrategy, PromptDataModule, RLModule
from periodic_rl.cli import main


class Recorder(L.Callback):
    """What each held-out generation saw: the iteration, the policy version the strategy holds,
    the version the rollouts hold, and how many prompts were asked for."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def setup(self, trainer, pl_module, stage):
        strategy = trainer.strategy
        generate = strategy.generate_groups

        def recorded(jobs, sampling):
            self.calls.append(
                {
                    "step": trainer.global_step,
                    "policy": strategy.policy_version,
                    "rollouts": strategy.rollouts.backend.version,
                    "fingerprint_ok": strategy.rollouts.backend.fingerprint
                    == strategy.weights_fingerprint,
                    "prompts": len(jobs),
                    "temperature": sampling.temperature,
                }
            )
            return generate(jobs, sampling)

        strategy.generate_groups = recorded


def fit(model_path, root, steps=3, callbacks=(), num_val=3, trainer_kwargs=None, **module_kwargs):
    L.seed_everything(0, verbose=False)
    kwargs = dict(
        model=model_path,
        num_generations=2,
        max_new_tokens=4,
        learning_rate=1e-2,
        reward_funcs=[length_reward],
        shared_prompt=False,
    )
    kwargs.update(module_kwargs)
    module = RLModule(**kwargs)
    recorder = Recorder()
    trainer = L.Trainer(
        strategy=PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False),
        max_steps=steps,
        default_root_dir=root,
        logger=CSVLogger(root, name="csv"),
        log_every_n_steps=1,
        callbacks=[recorder, *callbacks],
        enable_progress_bar=False,
        enable_model_summary=False,
        **(trainer_kwargs or {}),
    )
    data = PromptDataModule(batch_size=2, num_train=16, num_val=num_val)
    trainer.fit(module, datamodule=data)
    return module, trainer, recorder


def eval_rows(trainer) -> list[dict[str, str]]:
    with open(trainer.logger.log_dir + "/metrics.csv") as f:
        return [row for row in csv.DictReader(f) if row.get("eval/reward")]


def test_start_periodic_and_end_evaluations(tiny_llama_path, tmp_path, caplog):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="eval/reward", mode="max")
    stopping = EarlyStopping(monitor="eval/reward", mode="max", patience=100)
    module, trainer, recorder = fit(
        tiny_llama_path,
        tmp_path,
        steps=3,
        callbacks=[checkpoint, stopping],
        trainer_kwargs={"val_check_interval": 2, "num_sanity_val_steps": 0},
    )
    history = module.eval_history
    assert [(e["tag"], e["step"]) for e in history] == [("start", 0), ("iteration", 2), ("end", 3)]
    assert all({"reward", "accuracy", "length_reward"} <= e.keys() for e in history)
    # Logged through Lightning at the iteration they describe, and what callbacks monitor.
    rows = eval_rows(trainer)
    assert [int(r["step"]) for r in rows] == [0, 2, 3]
    for row, entry in zip(rows, history, strict=True):
        assert float(row["eval/reward"]) == pytest.approx(entry["reward"])
        assert float(row["eval/accuracy"]) == pytest.approx(entry["accuracy"])
    assert float(trainer.callback_metrics["eval/reward"]) == pytest.approx(history[-1]["reward"])
    assert checkpoint.best_model_score is not None and checkpoint.best_model_path
    assert stopping.best_score.isfinite()
    # Greedy, every held-out prompt, with the weights of the iteration it describes.
    assert [c["step"] for c in recorder.calls] == [0, 2, 3]
    for call in recorder.calls:
        assert call["policy"] == call["rollouts"] == call["step"] and call["fingerprint_ok"]
        assert call["prompts"] == 3 and call["temperature"] == 0.0
    # Not any iteration's generation time: its spans carry no iteration.
    spans = trainer.strategy.spans.spans()
    assert len([s for s in spans if s.name == "generate" and s.iteration is None]) == 3
    assert len([s for s in spans if s.name == "generate" and s.iteration is not None]) == 3
    logged = caplog.text  # INFO records of the periodic_rl logger
    assert "held-out (start, iteration 0): reward" in logged
    assert "held-out (end, iteration 3): reward" in logged


def test_periodic_evaluation_on_the_last_iteration_is_the_end(tiny_llama_path, tmp_path):
    module, trainer, recorder = fit(
        tiny_llama_path, tmp_path, steps=2, trainer_kwargs={"val_check_interval": 2}
    )
    assert [(e["tag"], e["step"]) for e in module.eval_history] == [("start", 0), ("end", 2)]
    # Lightning's sanity check (2 steps by default) ran on one prompt and recorded nothing.
    assert [(c["step"], c["prompts"]) for c in recorder.calls] == [(0, 1), (0, 3), (2, 3)]


def test_switches_and_no_held_out_rows(tiny_llama_path, tmp_path):
    module, _, recorder = fit(
        tiny_llama_path,
        tmp_path / "a",
        steps=1,
        eval_at_start=False,
        trainer_kwargs={"num_sanity_val_steps": 0},
    )
    assert [e["tag"] for e in module.eval_history] == ["end"]
    module, _, recorder = fit(
        tiny_llama_path, tmp_path / "b", steps=1, eval_at_end=False, num_val=0
    )
    assert module.eval_history == [] and recorder.calls == []


RUN = """
seed_everything: 0
trainer:
  max_steps: 2
  default_root_dir: {root}
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: {root}/ckpt, save_last: true, monitor: eval/reward, mode: max}}
  strategy:
    class_path: periodic_rl.PeriodicAsyncStrategy
    init_args: {{engine: hf, use_ray: false, overlap: false}}
model:
  class_path: periodic_rl.RLModule
  init_args: {{model: {model}, num_generations: 2, max_new_tokens: 4, shared_prompt: false}}
data:
  class_path: periodic_rl.PromptDataModule
  init_args: {{batch_size: 2, num_train: 8, num_val: 3}}
"""


def test_validate_a_checkpoint_prints_the_held_out_table(
    tiny_llama_path, tmp_path, monkeypatch, capsys, caplog
):
    monkeypatch.setattr(sys, "argv", ["periodic-rl"])
    config = tmp_path / "run.yaml"
    config.write_text(RUN.format(root=tmp_path, model=tiny_llama_path))
    main(["fit", "--config", str(config)])
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.exists()
    capsys.readouterr()
    main(["validate", "--config", str(config), "--ckpt_path", str(last)])
    out = capsys.readouterr().out
    assert "held-out (validate, iteration 2): reward" in caplog.text
    assert "Validate metric" in out and "eval/reward" in out and "eval/accuracy" in out
