"""RolloutRecord (``RLModule(record_rollouts=True)``): what the record holds is what was trained,
a resumed run continues it, and a write that fails leaves nothing behind."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict
from pathlib import Path

import datasets
import lightning as L
import pyarrow.parquet as pq
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from rl_helpers import length_reward
from trajectory_helpers import attach_trajectories

from periodic_rl import PeriodicAsyncStrategy, PromptDataModule, RLModule
from periodic_rl.callbacks import RolloutRecord
from periodic_rl.callbacks import record as record_module


class KeepsWhatItTrained(RLModule):
    """Keeps a copy of every iteration's trained groups, their micro-batches and loss sums.
    The tiny random model never ends a completion: the first of each group is let through as
    if it had, so the loss masks hold ones and zeros."""

    def _backward_micro_batch(self, groups, first=None):
        if first is None:
            for group in groups:
                group.truncated[0] = False
        return super()._backward_micro_batch(groups, first)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.trained: list[tuple[list, dict[int, int], dict[str, float]]] = []
        self.steps: list[list[dict]] = []  # per iteration, per optimizer step: the gradients

    def on_before_optimizer_step(self, optimizer):
        grads = {n: p.grad.clone() for n, p in self.named_parameters() if p.grad is not None}
        self.stepped.append(grads)  # the gradient the step applies

    def training_step(self, batch, batch_idx):
        self.stepped: list[dict] = []
        super().training_step(batch, batch_idx)
        stats = self.last_iteration
        self.trained.append(
            (copy.deepcopy(stats.groups), dict(stats.micro_batch), dict(stats.loss))
        )
        self.steps.append(self.stepped)


class TrajectoriesKept(KeepsWhatItTrained):
    """Its groups are multi-turn: tokens 3 and 4 of each completion are an environment reply,
    sample 3 stopped on its length (tests/trajectory_helpers.py)."""

    def setup(self, stage: str) -> None:
        super().setup(stage)
        attach_trajectories(self)


def fit(
    model_path: str,
    root: Path,
    steps: int,
    ckpt_path: str | None = None,
    module_cls: type[KeepsWhatItTrained] = KeepsWhatItTrained,
):
    L.seed_everything(0, verbose=False)
    module = module_cls(
        model=model_path,
        num_generations=4,
        micro_batch_size=4,  # one group per micro-batch: two micro-batches an iteration
        max_new_tokens=6,
        learning_rate=1e-2,
        reward_funcs=[length_reward],
        shared_prompt=False,
        mask_truncated_completions=True,  # loss masks with zeros
        temperature=0.7,
        record_rollouts=True,
    )
    trainer = L.Trainer(
        strategy=PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False),
        max_steps=steps,
        default_root_dir=root,
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_top_k=-1)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        module,
        datamodule=PromptDataModule(batch_size=2, num_train=16, num_val=0),
        ckpt_path=ckpt_path,
    )
    return module, trainer


@pytest.fixture(scope="module")
def recorded(tiny_llama_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("record")
    module, trainer = fit(tiny_llama_path, root, 2)
    return root, module, trainer


def read(folder: Path, tmp_path: Path) -> datasets.Dataset:
    files = sorted(str(p) for p in folder.glob("*.parquet"))
    return datasets.load_dataset(
        "parquet", data_files=files, split="train", cache_dir=str(tmp_path / "cache")
    )


def test_the_record_read_back_is_what_was_trained(recorded, tmp_path):
    root, module, _ = recorded
    folder = root / "rollouts"
    assert sorted(p.name for p in folder.iterdir()) == [
        "iteration_000000_rank0.parquet",
        "iteration_000001_rank0.parquet",
    ]
    rows = read(folder, tmp_path)
    assert len(rows) == sum(len(g.completion_ids) for gs, _, _ in module.trained for g in gs)
    by_key = {(r["iteration"], r["group"], r["sample"]): r for r in rows}
    kept = 0
    for iteration, (groups, micro_batch, loss) in enumerate(module.trained):
        for group in groups:
            for i, ids in enumerate(group.completion_ids):
                row = by_key[(iteration, group.index, i)]
                assert row["rank"] == 0 and row["micro_batch"] == micro_batch[group.index]
                assert row["prompt_ids"] == group.prompt_ids and row["completion_ids"] == ids
                assert row["behaviour_logprobs"] == pytest.approx(group.logprobs[i], abs=1e-6)
                # the HF engine samples with the trainer's numerics: the same log-probs
                assert row["trainer_logprobs"] == pytest.approx(group.logprobs[i], abs=1e-4)
                assert row["loss_mask"] == [0 if group.truncated[i] else 1] * len(ids)
                kept += not group.truncated[i]
                assert row["truncated"] == group.truncated[i]
                assert row["reward"] == group.rewards[i]
                assert row["rewards/length_reward"] == group.reward_components["length_reward"][i]
                assert row["advantage"] == group.advantages[i]
                assert (row["version"], row["fingerprint"]) == (group.version, group.fingerprint)
                assert (row["seed"], row["worker"]) == (group.seed, group.worker)
                assert row["completion"] == group.completions[i]
                assert (row["temperature"], row["max_new_tokens"]) == (0.7, 6)
        mask_tokens = sum(sum(r["loss_mask"]) for r in rows if r["iteration"] == iteration)
        assert mask_tokens == loss["tokens"]  # the tokens the trainer's loss counted
    assert {r["micro_batch"] for r in rows} == {0, 1}
    assert any(0 in r["loss_mask"] for r in rows) and kept  # both kinds of rows
    assert all(r[c] is None for r in rows for c in ("turns", "messages", "env_reward", "stop"))


def test_a_multi_turn_record_holds_the_trajectories(tiny_llama_path, tmp_path):
    """The loss mask is the trajectory's (0 on the environment's tokens), zeroed whole for a
    truncated completion under mask_truncated_completions; the turns, messages, environment
    reward and stop are recorded, and read back into the trajectory that was trained."""
    module, _ = fit(tiny_llama_path, tmp_path, 1, module_cls=TrajectoriesKept)
    rows = pq.read_table(tmp_path / "rollouts" / "iteration_000000_rank0.parquet").to_pylist()
    by_key = {(r["group"], r["sample"]): r for r in rows}
    ((groups, _, loss),) = module.trained
    assert len(rows) == 8
    for group in groups:
        for i, trajectory in enumerate(group.trajectories):
            row = by_key[(group.index, i)]
            kept = not group.truncated[i]
            assert row["loss_mask"] == [m * kept for m in trajectory.loss_mask]
            assert row["turns"] == [asdict(t) for t in trajectory.turns]
            assert json.loads(row["messages"]) == trajectory.messages
            assert (row["env_reward"], row["stop"]) == (trajectory.env_reward, trajectory.stop)
            assert row["rewards/environment"] == group.reward_components["environment"][i]
            assert record_module.read_trajectory(row) == trajectory
    assert not any(any(by_key[(g.index, 3)]["loss_mask"]) for g in groups)  # a "length" stop
    assert sum(sum(r["loss_mask"]) for r in rows) == loss["tokens"]


def test_each_file_carries_the_digest_of_the_gradient_its_steps_applied(recorded):
    root, module, _ = recorded
    for iteration, steps in enumerate(module.steps):
        path = root / "rollouts" / f"iteration_{iteration:06d}_rank0.parquet"
        digests = record_module.read_gradient_digest(path)
        assert len(digests) == len(steps) == 1
        (digest,), (grads,) = digests, steps
        assert set(digest) == set(grads) and grads
        for name, grad in grads.items():
            total, squares, numel = digest[name]
            assert numel == grad.numel()
            scale = grad.double().abs().sum().item()  # float32 sums: error ~1e-7 of this
            assert total == pytest.approx(grad.double().sum().item(), abs=1e-6 * scale)
            assert squares == pytest.approx(grad.double().square().sum().item(), rel=1e-5)
    first = record_module.read_gradient_digest(root / "rollouts" / "iteration_000000_rank0.parquet")
    last = record_module.read_gradient_digest(root / "rollouts" / "iteration_000001_rank0.parquet")
    assert first != last


def test_a_resumed_run_continues_the_record(recorded, tiny_llama_path, tmp_path):
    """Resumed from the checkpoint after iteration 0, in another folder: the record goes on in
    the first run's folder, iteration 1 written again exactly as the first run had it."""
    root, _, _ = recorded
    first = pq.read_table(root / "rollouts" / "iteration_000001_rank0.parquet")
    digest = record_module.read_gradient_digest(
        root / "rollouts" / "iteration_000001_rank0.parquet"
    )
    checkpoint = next((root / "ckpt").glob("*step=1.ckpt"))
    fit(tiny_llama_path, tmp_path / "resumed", 3, ckpt_path=str(checkpoint))
    assert not (tmp_path / "resumed" / "rollouts").exists()
    names = sorted(p.name for p in (root / "rollouts").iterdir())
    assert names == [f"iteration_{i:06d}_rank0.parquet" for i in range(3)]
    again = pq.read_table(root / "rollouts" / "iteration_000001_rank0.parquet")
    assert again.equals(first)
    path = root / "rollouts" / "iteration_000001_rank0.parquet"
    assert record_module.read_gradient_digest(path) == digest  # the same update, bit for bit


def test_a_failed_write_leaves_no_file(recorded, tmp_path, monkeypatch):
    """An interruption while a file is written leaves neither it nor its temporary behind."""
    root, module, _ = recorded
    stats = module.last_iteration
    rows = record_module.record_rows(stats, 7, 0, module.hparams)

    def interrupted(table, where, **kwargs):
        Path(where).write_bytes(b"PAR1 half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(record_module.pq, "write_table", interrupted)
    with pytest.raises(KeyboardInterrupt):
        record_module.write_record(tmp_path / "iteration_000007_rank0.parquet", rows)
    assert list(tmp_path.iterdir()) == []


def test_the_option_adds_the_callback_and_its_absence_does_not(tiny_llama_path):
    from periodic_rl.callbacks.defaults import default_callbacks

    for wanted in (True, False):
        trainer = L.Trainer(logger=False, enable_checkpointing=False)
        module = RLModule(model=tiny_llama_path, record_rollouts=wanted)
        trainer.strategy.connect(module)
        chosen = default_callbacks(trainer)
        assert any(isinstance(cb, RolloutRecord) for cb in chosen) == wanted
