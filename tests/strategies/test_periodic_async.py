"""PeriodicAsyncStrategy: the overlapped run equals the synchronous run; stale rollouts refused.

Real Ray actors with the transformers engine on a tiny model (vLLM is covered in
tests/rollout). Ray is started once for the module; each fit creates and removes its workers.
"""

import os
import signal

import pytest
import ray
from rl_helpers import max_diff, train

from periodic_rl import PeriodicAsyncStrategy, StaleRolloutError

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _ray_strategy(overlap: bool, workers: int) -> dict:
    return {"engine": "hf", "num_workers": workers, "overlap": overlap, "groups_per_call": 1}


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_overlap_equals_synchronous(tiny_llama_path, local_ray, lora):
    kwargs = dict(steps=3, lora=lora, learning_rate=0.5 if lora is None else 2.0)
    sync, _, sync_strategy = train(tiny_llama_path, strategy=_ray_strategy(False, 1), **kwargs)
    for workers in (1, 2):
        overlapped, _, strategy = train(
            tiny_llama_path, strategy=_ray_strategy(True, workers), **kwargs
        )
        assert strategy.policy_version == 3
        assert max_diff(sync, overlapped) < 1e-5, f"{workers} worker(s)"
    reference, _, local = train(tiny_llama_path, **kwargs)  # the in-process engine, no Ray
    assert max_diff(sync, reference) < 1e-5
    assert sync_strategy.weights_fingerprint == strategy.weights_fingerprint
    # LoRA pushes the base once, then only the adapter (setup + 3 steps: 4 pushes).
    counts = {"base+adapter": 1, "adapter": 3} if lora else {"full": 4}
    for run in (sync_strategy, strategy, local):
        assert {k: v for k, v in run.push_counts.items() if v} == counts
    pushes = [s for s in strategy.spans.spans() if s.name == "weight push"]
    kinds = [s.args.get("kind") for s in pushes if s.lane == "weights"]
    assert kinds == (["base", "adapter", "adapter", "adapter", "adapter"] if lora else ["full"] * 4)
    if lora:  # the same run with full merged pushes gives the same update
        local_full = {"engine": "hf", "use_ray": False, "overlap": False, "adapter_pushes": False}
        merged, _, full = train(tiny_llama_path, strategy=local_full, **kwargs)
        assert full.push_counts["full"] == 4
        assert max_diff(reference, merged) < 1e-5


def test_ramped_calls_give_the_synchronous_update(tiny_llama_path, local_ray):
    # 5 groups, 3 per call: synchronous calls [3, 2]; overlapped with one-group micro-batches
    # the calls ramp [1, 3, 1]. Different batching, same groups, same update.
    kwargs = dict(steps=2, batch_size=5)
    strategy = {"engine": "hf", "num_workers": 1, "groups_per_call": 3}
    sync, _, _ = train(tiny_llama_path, strategy={**strategy, "overlap": False}, **kwargs)
    overlapped, _, run = train(tiny_llama_path, strategy={**strategy, "overlap": True}, **kwargs)
    calls = [s.args["groups"] for s in run.spans.spans() if s.name == "generate"]
    assert calls[-3:] == [1, 3, 1]
    assert max_diff(sync, overlapped) < 1e-5


class _LostPushStrategy(PeriodicAsyncStrategy):
    """Simulates a weight push that never reached the engine after the first optimizer step."""

    def push_weights(self) -> str:
        if self.policy_version == 0:
            return super().push_weights()
        return self.weights_fingerprint + "-unconfirmed"


def test_rollout_from_an_old_version_is_refused(tiny_llama_path):
    from lightning import Trainer
    from rl_helpers import SGDModule, length_reward

    from periodic_rl import PromptDataModule

    module = SGDModule(
        model=tiny_llama_path,
        num_generations=2,
        micro_batch_size=2,
        max_new_tokens=4,
        reward_funcs=[length_reward],
    )
    strategy = _LostPushStrategy(engine="hf", use_ray=False, overlap=False)
    trainer = Trainer(strategy=strategy, max_steps=3, logger=False, enable_checkpointing=False)
    with pytest.raises(StaleRolloutError, match="version 0"):
        trainer.fit(module, datamodule=PromptDataModule(batch_size=2, num_train=8, num_val=0))
    assert trainer.global_step == 1


def test_use_ray_false_refuses_overlap():
    with pytest.raises(ValueError, match="overlap=False"):
        PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=True)


class _KillOneWorkerStrategy(PeriodicAsyncStrategy):
    """SIGKILLs worker 0 right after the first micro-batch of iteration 1 has arrived."""

    def rollout_micro_batches(self, jobs, *args, **kwargs):
        victim = self.rollouts.worker_pids()[0] if self.policy_version == 1 else None
        for index, groups in enumerate(super().rollout_micro_batches(jobs, *args, **kwargs)):
            if index == 0 and victim is not None:
                os.kill(victim, signal.SIGKILL)
            yield groups
        self.restarts_seen = self.rollouts.restarts


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_worker_killed_mid_iteration_gives_the_fault_free_update(
    tiny_llama_path, local_ray, monkeypatch, lora
):
    import rl_helpers

    kwargs = dict(steps=3, strategy=_ray_strategy(True, 2), lora=lora)
    if lora is not None:
        kwargs["learning_rate"] = 2.0
    fault_free, _, _ = train(tiny_llama_path, **kwargs)
    monkeypatch.setattr(rl_helpers, "PeriodicAsyncStrategy", _KillOneWorkerStrategy)
    faulty, _, killer = train(tiny_llama_path, **kwargs)
    assert killer.restarts_seen >= 1  # the worker really died and was replaced
    assert killer.policy_version == 3
    if lora is not None:  # the replacement got the base and the adapter of version 1 replayed
        assert killer.push_counts["adapter"] == 3 and killer.push_counts["full"] == 0
    assert max_diff(fault_free, faulty) < 1e-5
