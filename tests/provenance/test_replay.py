"""replay: a recorded iteration recomputed from the record and the checkpoint gives the update
the run made (full fine-tuning and LoRA, the first and the last of three iterations); a
corrupted behaviour log-prob in the record is named by group, sample and token; another
advantage normaliser than the run's is a different update; a multi-turn iteration is replayed,
turn by turn through the agent loop, or with the trajectories of its record."""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path

import lightning as L
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from rl_helpers import length_reward
from trajectory_helpers import attach_trajectories

from periodic_rl import PeriodicAsyncStrategy, PromptDataModule, RLModule
from periodic_rl.cli import main
from periodic_rl.provenance import replay

replay_module = importlib.import_module("periodic_rl.provenance.replay")  # not the function
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
ITERATIONS = 3


def module_and_data(model_path: str, lora: dict | None, cls: type = RLModule, **overrides):
    """The run's module and data, built the same way for the run and for each replay."""
    kwargs = dict(
        model=model_path,
        lora=lora,
        num_generations=4,
        micro_batch_size=4,
        max_new_tokens=6,
        learning_rate=1e-2,
        reward_funcs=[length_reward],
        shared_prompt=False,
        temperature=0.7,
        record_rollouts=True,
    )
    module = cls(**{**kwargs, **overrides})
    return module, PromptDataModule(batch_size=2, num_train=16, num_val=0)


@pytest.fixture(scope="module", params=[None, LORA], ids=["full", "lora"])
def run(request, tiny_llama_path, tmp_path_factory):
    """A recorded run of three iterations with a checkpoint at every step."""
    root = tmp_path_factory.mktemp("recorded-run")
    L.seed_everything(0, verbose=False)
    module, data = module_and_data(tiny_llama_path, request.param)
    trainer = L.Trainer(
        strategy=PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False),
        max_steps=ITERATIONS,
        default_root_dir=root,
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_top_k=-1)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)
    return root, request.param


def record_one_iteration(module: RLModule, data: PromptDataModule, root: Path) -> None:
    """Train one recorded iteration (synchronous, in process) into ``root``, no checkpoint."""
    trainer = L.Trainer(
        strategy=PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False),
        max_steps=1,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)


def checkpoint(root: Path, iteration: int) -> Path | None:
    return next((root / "ckpt").glob(f"*step={iteration}.ckpt")) if iteration else None


@pytest.mark.parametrize("iteration", [0, ITERATIONS - 1])
def test_replay_reproduces_the_recorded_update(run, tiny_llama_path, iteration):
    root, lora = run
    module, data = module_and_data(tiny_llama_path, lora)
    report = replay(module, data, root / "rollouts", iteration, checkpoint(root, iteration), seed=0)
    assert report.exact, report.describe()
    assert report.digest_difference <= 1e-6  # the same order of micro-batches: the same sums
    assert report.trainer_logprob_difference <= 1e-6
    assert report.groups == 2 and report.tokens > 0
    assert not report.token_mismatches and not report.reward_differences
    assert "update reproduced" in report.describe()


def test_a_corrupted_behaviour_logprob_is_named(run, tiny_llama_path, tmp_path):
    root, lora = run
    record = tmp_path / "rollouts"
    shutil.copytree(root / "rollouts", record)
    path = record / f"iteration_{ITERATIONS - 1:06d}_rank0.parquet"
    table = pq.read_table(path)
    rows = table.to_pylist()
    row = rows[5]
    row["behaviour_logprobs"][3] += 1.0
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)
    module, data = module_and_data(tiny_llama_path, lora)
    report = replay(module, data, record, ITERATIONS - 1, checkpoint(root, ITERATIONS - 1), seed=0)
    (bad,) = report.token_mismatches
    assert (bad.group, bad.sample, bad.position) == (row["group"], row["sample"], 3)
    assert bad.difference == pytest.approx(-1.0, abs=1e-3)
    assert f"group {row['group']} sample {row['sample']} token 3" in report.describe()
    assert report.metrics["mismatch/ratio_min"] == pytest.approx(2.718**-1, rel=1e-2)
    assert report.exact  # tis_cap off: the behaviour log-probs do not enter the update


def test_another_normaliser_is_another_update(run, tiny_llama_path):
    """The run divided each group's advantages by its reward std (``scale_rewards: group``);
    replayed without (``none``) the gradient differs, and the replay says the update is not
    the recorded one."""
    root, lora = run
    module, data = module_and_data(tiny_llama_path, lora, scale_rewards="none")
    report = replay(module, data, root / "rollouts", 1, checkpoint(root, 1), seed=0)
    assert not report.exact
    assert report.digest_difference > 1e-3
    assert "NOT reproduced" in report.describe()


def test_a_missing_record_or_checkpoint_is_named(run, tiny_llama_path, tmp_path):
    root, lora = run
    module, data = module_and_data(tiny_llama_path, lora)
    with pytest.raises(FileNotFoundError, match="no record of iteration 7"):
        replay(module, data, root / "rollouts", 7, checkpoint(root, 1))
    with pytest.raises(ValueError, match="needs the checkpoint taken before it"):
        replay(module, data, root / "rollouts", 1)


def test_the_command_replays_from_the_run_configuration(run, tiny_llama_path, tmp_path, capsys):
    """``periodic-rl replay`` builds the module and data from the run's configuration."""
    root, lora = run
    config = {
        "seed_everything": 0,
        "trainer": {"strategy": {"class_path": "periodic_rl.PeriodicAsyncStrategy",
                                 "init_args": {"engine": "hf", "use_ray": False,
                                               "overlap": False}}},
        "model": {"class_path": "periodic_rl.RLModule", "init_args": {
            "model": tiny_llama_path, "lora": lora, "num_generations": 4, "micro_batch_size": 4,
            "max_new_tokens": 6, "learning_rate": 1e-2, "reward_funcs":
            ["rl_helpers.length_reward"], "shared_prompt": False, "temperature": 0.7,
            "record_rollouts": True}},
        "data": {"class_path": "periodic_rl.PromptDataModule",
                 "init_args": {"batch_size": 2, "num_train": 16, "num_val": 0}},
    }  # fmt: skip
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    last = ITERATIONS - 1
    args = ["replay", "--config", str(path), "--record", str(root / "rollouts")]
    main([*args, "--iteration", str(last), "--checkpoint", str(checkpoint(root, last))])
    assert f"iteration {last}: update reproduced" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--iteration", "9"])
    assert exit_.value.code == 2


class MultiTurnRun(RLModule):
    """A run whose groups are multi-turn: tokens 3 and 4 of each completion an environment
    reply (behaviour log-prob 0.0), environment rewards (tests/trajectory_helpers.py)."""

    def setup(self, stage: str) -> None:
        super().setup(stage)
        attach_trajectories(self)


class NoTrajectories(L.Callback):
    """Stands for replay's RecordedTrajectories, giving the groups none."""

    def __init__(self, rows) -> None:
        pass


def test_replay_rebuilds_a_multi_turn_iteration(tiny_llama_path, tmp_path, monkeypatch):
    """Replayed by a module that makes no trajectories, a multi-turn iteration gets its
    trajectories from the record: the same update, the same rewards (the environment's
    included), and no mismatch reported on the environment's tokens. Without them the replay
    is another update."""
    L.seed_everything(0, verbose=False)
    module, data = module_and_data(tiny_llama_path, None, cls=MultiTurnRun)
    record_one_iteration(module, data, tmp_path)
    masked = module.last_iteration.masked_tokens
    assert masked > 0

    module, data = module_and_data(tiny_llama_path, None)
    report = replay(module, data, tmp_path / "rollouts", 0, seed=0)
    assert report.exact, report.describe()
    assert not report.token_mismatches and not report.reward_differences
    assert report.metrics["rollout/masked_tokens"] == masked  # the replay's own groups

    monkeypatch.setattr(replay_module, "RecordedTrajectories", NoTrajectories)
    module, data = module_and_data(tiny_llama_path, None)
    report = replay(module, data, tmp_path / "rollouts", 0, seed=0)
    assert not report.exact and report.reward_differences
    assert report.digest_difference > 1e-3


GAME = Path(__file__).resolve().parents[2] / "examples" / "data" / "guess_number.jsonl"


def test_replay_reproduces_an_agent_loop_iteration(tiny_llama_path, tmp_path):
    """A run of the agent loop (examples/guess_number.py: the environment draws its secret
    from the trajectory's seed): replayed, each model turn is the recorded one and the
    environment answers it again, giving the same trajectories, rewards and update."""
    from periodic_rl.agents.config import AgentConfig

    agent = AgentConfig(
        environment="examples.guess_number:GuessNumber", max_turns=3, max_turn_tokens=4
    )

    def build():
        module, _ = module_and_data(tiny_llama_path, None, max_new_tokens=10, agent=agent)
        return module, PromptDataModule(source=str(GAME), batch_size=2, num_train=8, num_val=0)

    L.seed_everything(0, verbose=False)
    module, data = build()
    record_one_iteration(module, data, tmp_path)
    run = module.last_iteration
    assert max(len(t.turns) for g in run.groups for t in g.trajectories) > 1

    module, data = build()
    report = replay(module, data, tmp_path / "rollouts", 0, seed=0)
    assert report.exact, report.describe()
    assert not report.token_mismatches and not report.reward_differences
    replayed = module.last_iteration
    assert [t for g in replayed.groups for t in g.trajectories] == [
        t for g in run.groups for t in g.trajectories
    ]
