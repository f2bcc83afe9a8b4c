"""The core invariants, on multi-turn trajectories: bounded staleness (k = 1) gives the same
update on one Ray worker as on two, a run resumed from a checkpoint ends where the
uninterrupted one does, and a rollout worker killed in the middle of a trajectory changes
nothing (its group is generated again, with the same seeds and environment seeds).

Real Lightning fits of the tiny model on the deterministic guess-the-number environment
(``examples/guess_number.py``: the secret comes from the trajectory's seed), with the
transformers engine. Where the order of events between the trainer and the workers matters,
the workers run ``tests/rollout/ray_fixtures.py:GatedEngine`` under the agent loop the worker
builds from its :class:`AgentConfig`: a call holding one of the gated turn seeds waits for a
file, so nothing depends on timing.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from rl_helpers import RecordingModule, assert_same_update, length_reward, max_diff, train

from periodic_rl import PeriodicAsyncStrategy, PromptDataModule, RLModule
from periodic_rl.agents.config import AgentConfig
from periodic_rl.rollout.engine import sample_seed

ROOT = Path(__file__).resolve().parents[2]
GAME = str(ROOT / "examples" / "data" / "guess_number.jsonl")
ROLLOUT_TESTS = str(ROOT / "tests" / "rollout")
AGENT = AgentConfig(environment="examples.guess_number:GuessNumber", max_turns=3, max_turn_tokens=4)
STEPS = 3
RELEASE = "released"  # the file that lets the held trajectories take their second turn


def game_data() -> PromptDataModule:
    return PromptDataModule(source=GAME, batch_size=2, num_train=8, num_val=0)


class TrajectoryRecording(RecordingModule):
    """Also keeps, per iteration, each group's worker and its trajectories' turn counts."""

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.workers: list[dict[int, int]] = []
        self.turns: list[dict[int, list[int]]] = []

    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)
        groups = self.last_iteration.groups
        self.workers.append({g.index: g.worker for g in groups})
        self.turns.append({g.index: [len(t.turns) for t in g.trajectories] for g in groups})


def run(tiny_llama_path, strategy=None, **kwargs):
    return train(
        tiny_llama_path,
        steps=STEPS,
        strategy=strategy,
        data=game_data(),
        agent=AGENT,
        max_new_tokens=10,
        module_cls=TrajectoryRecording,
        **kwargs,
    )


def ray_workers(workers: int, **kwargs) -> dict:
    return {"engine": "hf", "num_workers": workers, "overlap": True, "groups_per_call": 1, **kwargs}


@pytest.fixture(scope="module")
def on_policy(tiny_llama_path):
    """k = 0, synchronous, the in-process engine: the reference of the fault-free update."""
    return run(tiny_llama_path)


# ---- bounded staleness -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def stale_one_worker(tiny_llama_path, local_ray):
    return run(tiny_llama_path, ray_workers(1, max_staleness=1))


@pytest.fixture(scope="module")
def stale_two_workers(tiny_llama_path, local_ray):
    return run(tiny_llama_path, ray_workers(2, max_staleness=1))


def test_k1_on_one_worker_equals_k1_on_two(stale_one_worker, stale_two_workers, on_policy):
    assert_same_update(stale_one_worker, stale_two_workers, "multi-turn, k=1, two workers")
    for _, module, strategy in (stale_one_worker, stale_two_workers):
        assert strategy.policy_version == STEPS
        assert [{v for v, _ in r.stamps} for r in module.records] == [{0}, {0}, {1}]
        assert max(n for turns in module.turns for g in turns.values() for n in g) > 1
    assert set(stale_two_workers[1].workers[0].values()) == {0, 1}  # both workers generated
    # the stale trajectories are really used: k = 0 takes other steps
    assert max_diff(stale_one_worker[0], on_policy[0]) > 1e-4


# ---- resume ----------------------------------------------------------------------------------
def _fit(model_path, root, ckpt_path=None):
    """tests/test_checkpoint.py's fit, with multi-turn trajectories, 4 iterations, keeping the
    checkpoint of every step."""
    L.seed_everything(0, verbose=False)
    module = RLModule(
        model=model_path,
        num_generations=4,
        micro_batch_size=4,
        max_new_tokens=10,
        learning_rate=1e-2,
        reward_funcs=[length_reward],
        agent=AGENT,
    )
    checkpoint = ModelCheckpoint(
        dirpath=root / "ckpt", save_top_k=-1, save_last=True, every_n_train_steps=1
    )
    trainer = L.Trainer(
        strategy=PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False),
        max_steps=4,
        default_root_dir=root,
        logger=False,
        callbacks=[checkpoint],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=game_data(), ckpt_path=ckpt_path)
    params = {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}
    return params, trainer


def test_resume_equals_uninterrupted(tiny_llama_path, tmp_path):
    """The checkpoint of step 2 is what a run interrupted there leaves (training is
    synchronous: nothing of iteration 2 exists when it is written)."""
    straight, _ = _fit(tiny_llama_path, tmp_path / "a")
    second = tmp_path / "a" / "ckpt" / "epoch=0-step=2.ckpt"
    assert torch.load(second, weights_only=True)["periodic_rl"]["policy_version"] == 2
    resumed, trainer = _fit(tiny_llama_path, tmp_path / "b", ckpt_path=str(second))
    assert trainer.strategy.policy_version == 4
    assert trainer.lightning_module.last_iteration.agent.turns > 8  # multi-turn to the end
    assert max_diff(straight, resumed) == 0.0


# ---- a worker killed mid-trajectory ----------------------------------------------------------
def _wait_dead(pid: int, timeout_s: float = 30.0) -> None:
    """Until process ``pid`` is gone (or a zombie)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
                return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.01)
    raise TimeoutError(f"process {pid} still alive {timeout_s:.0f} s after SIGKILL")


class _KillMidTrajectory(PeriodicAsyncStrategy):
    """In iteration 1, group 0's second turns wait for :data:`RELEASE` (the engine's gates),
    so the first micro-batch is group 1's: this strategy then SIGKILLs the worker still in
    group 0's trajectories, between their first and second turns, and opens the gate for the
    group's second try."""

    gate_dir = ""

    def rollout_micro_batches(self, *args, **kwargs):
        workers = self.rollouts.backend
        pids = workers.worker_pids() if self.policy_version == 1 else None
        resent, restarts = workers.redispatched_calls, workers.restarts
        for index, groups in enumerate(super().rollout_micro_batches(*args, **kwargs)):
            if index == 0 and pids is not None:
                self.first = {(g.index, g.worker) for g in groups}
                (first,) = {g.worker for g in groups}
                self.victim = 1 - first
                os.kill(pids[self.victim], signal.SIGKILL)
                _wait_dead(pids[self.victim])
                Path(self.gate_dir, RELEASE).touch()
            yield groups
        if pids is not None:
            self.resent = workers.redispatched_calls - resent
            self.restarted = workers.restarts - restarts


def test_worker_killed_mid_trajectory_gives_the_fault_free_update(
    tiny_llama_path, on_policy, local_ray, monkeypatch, tmp_path
):
    # Precondition: group 0 of iteration 1 has trajectories that take a second turn (fixed by
    # the seeds), so its call is certainly still running when group 1's arrives.
    assert max(on_policy[1].turns[1][0]) >= 2
    seed = on_policy[1].group_seed(1, 0)
    # the seeds of the samples' second turns (agents/loop.py, _Trajectory.turn_seed)
    gates = {sample_seed(sample_seed(seed, i), 2): RELEASE for i in range(4)}
    path = [ROLLOUT_TESTS, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))  # the workers import ray_fixtures
    engine = {"gate_dir": str(tmp_path), "gates": gates, "reason": "group 0 was never released"}
    killer = type("Killer", (_KillMidTrajectory,), {"gate_dir": str(tmp_path)})
    strategy = ray_workers(2, engine="ray_fixtures:GatedEngine", engine_kwargs=engine)
    faulty = run(tiny_llama_path, strategy, strategy_cls=killer)
    _, module, killed = faulty
    assert killed.first == {(1, 1 - killed.victim)}  # group 0 was held on the killed worker
    assert killed.resent == 1 and killed.restarted == 1  # its call was lost and sent again
    assert killed.policy_version == STEPS
    # the replacement, built with the agent config, generated multi-turn trajectories too
    assert killed.victim in module.workers[2].values()
    assert module.turns == on_policy[1].turns
    assert_same_update(on_policy, faulty, "multi-turn, a worker killed mid-trajectory")
