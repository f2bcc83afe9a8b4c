"""A short periodic-async fit on a Ray rollout worker, run as a script by test_trainer_kill.py,
so that a test can SIGKILL the trainer mid-iteration and resume it in a new process.

Usage: python tests/fault_fit.py MODEL_DIR ROOT STEPS [--block-at N] [--resume]

Checkpoints of every step go to ``ROOT/ckpt`` (all kept, and ``last.ckpt``). Each iteration
appends to ``ROOT/steps.jsonl`` what it starts from: global step, policy version, a hash of
the torch RNG state and the prompts of its batch. ``--block-at N``: in the iteration that
starts at global step ``N`` (so after step ``N``'s checkpoint was written), once its first
micro-batch was back-propagated while the worker still generates the rest, write
``ROOT/blocked`` (the pids of the rollout workers) and wait to be killed. ``--resume``: fit
with ``ckpt_path="last"``. A fit that ends writes ``ROOT/result.pt`` (trainable parameters,
policy version, global step).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # rl_helpers

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from rl_helpers import length_reward  # noqa: E402

from periodic_rl import PeriodicAsyncStrategy, PromptDataModule, RLModule  # noqa: E402


class FaultModule(RLModule):
    def __init__(self, root: str, block_at: int | None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.root, self.block_at = Path(root), block_at

    def training_step(self, batch, batch_idx):
        record = {
            "step": self.trainer.global_step,
            "version": self.trainer.strategy.policy_version,
            "rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest(),
            "prompts": [str(row["prompt"]) for row in batch],
        }
        with open(self.root / "steps.jsonl", "a") as steps:
            steps.write(json.dumps(record) + "\n")
        torch.rand(1)  # a draw per iteration, as dropout makes: the RNG state matters on resume
        return super().training_step(batch, batch_idx)

    def _backward_micro_batch(self, groups, first=None):
        out = super()._backward_micro_batch(groups, first)
        if self.trainer.global_step == self.block_at:
            self.trainer.strategy.checkpoint_io.wait()  # step N's, written in the background
            workers = self.trainer.strategy.rollouts.backend.worker_pids()
            (self.root / "blocked.tmp").write_text(json.dumps(workers))
            (self.root / "blocked.tmp").rename(self.root / "blocked")
            time.sleep(300)  # killed long before; ends a test run whose kill went wrong
            raise SystemExit("blocked for 300 s and was not killed")
        return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("root")
    parser.add_argument("steps", type=int)
    parser.add_argument("--block-at", type=int)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0, verbose=False)
    module = FaultModule(
        str(root),
        args.block_at,
        model=args.model,
        num_generations=2,
        micro_batch_size=2,  # two micro-batches per iteration: one can be done, one not
        max_new_tokens=6,
        learning_rate=1e-3,
        reward_funcs=[length_reward],
    )
    trainer = L.Trainer(
        strategy=PeriodicAsyncStrategy(engine="hf", num_workers=1, overlap=True),
        max_steps=args.steps,
        default_root_dir=root,
        logger=False,
        callbacks=[
            ModelCheckpoint(
                dirpath=root / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=-1
            )
        ],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = PromptDataModule(batch_size=2, num_train=40, num_val=0)
    trainer.fit(module, datamodule=data, ckpt_path="last" if args.resume else None)
    params = {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}
    torch.save(
        {
            "params": params,
            "policy_version": trainer.strategy.policy_version,
            "global_step": trainer.global_step,
        },
        root / "result.pt",
    )


if __name__ == "__main__":
    main()
