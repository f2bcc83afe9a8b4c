"""The reward pool: which rewards run in worker processes, a call past its timeout stopped with
its process gone, no worker left after a fit, and a fit whose reward always fails stopping
with the reason (:mod:`periodic_rl.reward_pool`, :class:`~periodic_rl.scoring.Scorer`)."""

from __future__ import annotations

import functools
import os
import time
import warnings
from pathlib import Path

import lightning as L
import psutil
import pytest
from rl_helpers import SGDModule, train

from periodic_rl import PeriodicAsyncStrategy, PromptDataModule
from periodic_rl.remote_rewards import HTTPReward
from periodic_rl.reward_pool import RewardPool, runs_in_pool
from periodic_rl.rewards import RewardError, RewardModel, RewardTimeoutError
from periodic_rl.scoring import STOP_AFTER_FAILED_ITERATIONS, Scorer

PROMPTS = ["What is 2+2?"] * 3
COMPLETIONS = ["4", "four", "5"]
PIDS_ENV = "PERIODIC_RL_TEST_PID_DIR"  # where the rewards below note the process they ran in


def _note_pid() -> None:
    folder = os.environ.get(PIDS_ENV)
    if folder:
        Path(folder, str(os.getpid())).touch()


def where(prompts, completions, **columns):
    """The id of the process the call ran in, for every completion."""
    return [float(os.getpid())] * len(completions)


def loops_forever(prompts, completions, pid_file, **columns):
    """On its first call: notes its process, then never returns (a busy loop: only a kill
    stops it); later calls return 1.0s."""
    if Path(pid_file[0]).exists():
        return [1.0] * len(completions)
    Path(pid_file[0]).write_text(str(os.getpid()))
    while True:
        pass


def named_parts(prompts, completions, **columns):
    """Two named components, from a worker process whose id it notes."""
    _note_pid()
    return {
        "short": [1.0 if len(c) < 6 else 0.0 for c in completions],
        "length": [len(c) / 10.0 for c in completions],
    }


def always_fails(prompts, completions, **columns):
    if len(completions) == 2:  # the set-up probe passes: the run starts
        return [0.0, 0.0]
    _note_pid()
    raise KeyError("answer column missing")


class Holder:
    def reward(self, prompts, completions, **columns):
        return [0.0] * len(completions)


def scorer(*funcs, workers=1, timeout=None, on_error="raise"):
    return Scorer(
        tokenizer=None,
        reward_funcs=list(funcs),
        reward_weights=[1.0] * len(funcs),
        reward_timeout_s=timeout,
        reward_on_error=on_error,
        reward_workers=workers,
    )


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# ---- where a reward runs ---------------------------------------------------------------------
def test_the_rule_picklable_rewards_in_the_pool_the_others_here():
    assert runs_in_pool(where)
    assert runs_in_pool(functools.partial(where))
    assert not runs_in_pool(lambda prompts, completions, **c: [0.0] * len(completions))
    assert not runs_in_pool(Holder().reward)  # a bound method: the reward() override
    assert not runs_in_pool(RewardModel.__new__(RewardModel))  # reward_in_process
    assert runs_in_pool(HTTPReward("http://127.0.0.1:1"))  # a small picklable object

    def local(prompts, completions, **columns):
        return [0.0] * len(completions)

    assert not runs_in_pool(local)
    pool = RewardPool([where, local], workers=1)
    assert pool.runs("where") and not pool.runs("local")
    assert not RewardPool([where], workers=0).runs("where")


def test_a_pooled_reward_runs_in_another_process_and_the_others_here():
    here = Holder()
    s = scorer(where, here.reward, workers=1)
    try:
        _, components = s.rewards(PROMPTS, COMPLETIONS, {})
        pid = int(components["where"][0])
        assert pid != os.getpid()
        assert pid in [p.pid for p in psutil.Process().children(recursive=True)]
        assert components["reward"] == [0.0] * 3  # the bound method, in this process
    finally:
        s.close()
    assert _gone(pid)
    same = scorer(where, workers=0)
    assert same.rewards(PROMPTS, COMPLETIONS, {})[1]["where"][0] == os.getpid()


@pytest.mark.parametrize("policy", ["raise", "zero"])
def test_a_call_past_its_timeout_is_stopped_and_its_process_gone(tmp_path, policy):
    """A reward that loops forever: the call ends at its timeout, the worker that ran it is
    killed (not left spinning), the policy applies, and the pool goes on with a new worker."""
    pid_file = tmp_path / "pid"
    s = scorer(loops_forever, where, timeout=1.0, on_error=policy)
    columns = {"pid_file": [str(pid_file)] * 3}
    try:
        started = time.monotonic()
        if policy == "raise":
            with pytest.raises(RewardTimeoutError, match="its worker process killed"):
                s.rewards(PROMPTS, COMPLETIONS, columns)
        else:
            with pytest.warns(RuntimeWarning, match="did not return within reward_timeout_s=1"):
                _, components = s.rewards(PROMPTS, COMPLETIONS, columns)
            assert components["loops_forever"] == [0.0] * 3
            assert s.take_failures() == {"loops_forever": 1, "where": 0}
        assert time.monotonic() - started < 60  # generous: the timeout is 1 s
        looped = int(pid_file.read_text())
        assert looped != os.getpid()
        deadline = time.monotonic() + 30
        while not _gone(looped) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(looped), "the worker running the endless loop is still alive"
        _, components = s.rewards(PROMPTS, COMPLETIONS, columns)  # a new worker takes over
        assert components["loops_forever"] == [1.0] * 3
        assert int(components["where"][0]) not in (looped, os.getpid())
    finally:
        s.close()


# ---- fits ------------------------------------------------------------------------------------
class LogRecordingModule(SGDModule):
    def on_fit_start(self) -> None:
        self.logged: list[tuple[int, str, float]] = []

    def log(self, name, value, *args, **kwargs):
        self.logged.append((self.trainer.global_step, name, float(value)))
        super().log(name, value, *args, **kwargs)


def test_a_fit_scores_in_workers_logs_named_components_and_leaves_no_process(
    tiny_llama_path, tmp_path, monkeypatch
):
    """Two iterations and a held-out evaluation at the end with a pooled reward returning named
    components: each is logged (rewards/<name>) and is a held-out column; the total is the
    weight times their sum; no worker is left once the fit returns."""
    monkeypatch.setenv(PIDS_ENV, str(tmp_path))
    L.seed_everything(0, verbose=False)
    module = LogRecordingModule(
        model=tiny_llama_path,
        num_generations=2,
        max_new_tokens=6,
        reward_funcs=[named_parts],
        reward_weights=[2.0],
        reward_workers=1,
        eval_at_start=False,
        shared_prompt=False,
    )
    trainer = L.Trainer(
        strategy=PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=PromptDataModule(batch_size=2, num_train=4, num_val=2))
    workers = [int(p.name) for p in tmp_path.iterdir()]
    assert workers and os.getpid() not in workers
    assert all(_gone(pid) for pid in workers), "a reward worker outlived the fit"
    names = {name for _, name, _ in module.logged}
    assert {"rewards/short", "rewards/length", "eval/short", "eval/length"} <= names
    end = module.eval_history[-1]
    assert end["tag"] == "end" and {"short", "length"} <= end.keys()
    assert end["reward"] == pytest.approx(2.0 * (end["short"] + end["length"]))
    for group in module.last_iteration.groups:  # the total: the weight times the sum
        parts = group.reward_components
        expected = [2.0 * (a + b) for a, b in zip(parts["short"], parts["length"], strict=True)]
        assert group.rewards == pytest.approx(expected)


def test_a_fit_whose_reward_always_fails_stops_naming_it(tiny_llama_path, tmp_path, monkeypatch):
    monkeypatch.setenv(PIDS_ENV, str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(RewardError) as caught:
            train(
                tiny_llama_path,
                steps=STOP_AFTER_FAILED_ITERATIONS + 3,
                module_cls=LogRecordingModule,
                reward_funcs=[always_fails],
                reward_on_error="zero",
            )
    message = str(caught.value)
    assert f"reward 'always_fails' failed on every call for {STOP_AFTER_FAILED_ITERATIONS} " in (
        message
    )
    assert "raised KeyError: 'answer column missing'" in message  # the first failure
    workers = [int(p.name) for p in tmp_path.iterdir()]
    assert workers and all(_gone(pid) for pid in workers), "a reward worker outlived the stop"
