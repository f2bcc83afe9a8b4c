"""PeriodicAsyncStrategy: the overlapped run equals the synchronous run, overlap really happens,
stale rollouts are refused, and a killed worker changes nothing.

Real Ray actors with the transformers engine on a tiny model (SmolLM2 on vLLM trains end to end,
overlapped against synchronous, in ``tests/provenance/test_verify.py``). Ray is
started once for the module; each fit creates and removes its workers. Where a test needs the
order of events between the trainer and the workers fixed, the workers run
``tests/rollout/ray_fixtures.py:GatedEngine``, whose calls wait for files the test (or the
trainer) writes: nothing depends on timing or on which worker finishes first.
"""

import os
import signal
from pathlib import Path

import pytest
from rl_helpers import (
    LyingPusher,
    RecordingModule,
    assert_same_update,
    max_diff,
    train,
)

from periodic_rl import PeriodicAsyncStrategy, RLModule, StaleRolloutError
from periodic_rl.weight_sync.push import WeightPusher

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
ROLLOUT_TESTS = str(Path(__file__).resolve().parents[1] / "rollout")


@pytest.fixture
def gated_engines(monkeypatch):
    """Workers can import ``ray_fixtures`` (the Ray rollouts hand ``PYTHONPATH`` on to them)."""
    path = [ROLLOUT_TESTS, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))


def _ray_strategy(overlap: bool, workers: int, engine: str = "hf", **kwargs) -> dict:
    return {
        "engine": engine,
        "num_workers": workers,
        "overlap": overlap,
        "groups_per_call": 1,
        **kwargs,
    }


@pytest.mark.parametrize(
    ("lora", "shared_prompt"),
    # packed shared-prompt forwards with full fine-tuning: the gated and batch-scaled tests below
    [(None, False), (LORA, True)],
    ids=["full-padded", "lora-shared-prompt"],
)
def test_overlap_equals_synchronous(tiny_llama_path, local_ray, lora, shared_prompt):
    """Synchronous on one Ray worker, overlapped on two, and the in-process engine: the same
    update, up to the order in which gradients were summed (bit-identical when that order is the
    same; with two workers it is whatever order the groups completed in)."""
    kwargs = dict(
        steps=3, lora=lora, learning_rate=0.5 if lora is None else 2.0, shared_prompt=shared_prompt
    )
    sync = train(tiny_llama_path, strategy=_ray_strategy(False, 1), **kwargs)
    overlapped = train(tiny_llama_path, strategy=_ray_strategy(True, 2), **kwargs)
    local = train(tiny_llama_path, **kwargs)  # the in-process engine, no Ray
    assert overlapped[2].policy_version == 3
    assert_same_update(sync, overlapped, "two overlapped workers")
    assert_same_update(sync, local, "in-process engine")
    assert [r.order for r in sync[1].records] == [r.order for r in local[1].records]
    assert sync[2].weights_fingerprint == local[2].weights_fingerprint  # same order: same bits
    # LoRA pushes the base once, then only the adapter (setup + 3 steps: 4 pushes).
    counts = {"base+adapter": 1, "adapter": 3} if lora else {"full": 4}
    for _, _, run in (sync, overlapped, local):
        assert {k: v for k, v in run.push_counts.items() if v} == counts
    pushes = [s for s in overlapped[2].spans.spans() if s.name == "weight push"]
    kinds = [s.args.get("kind") for s in pushes if s.lane == "weights"]
    assert kinds == (["base", "adapter", "adapter", "adapter", "adapter"] if lora else ["full"] * 4)
    if lora:  # the same run with full merged pushes gives the same update
        local_full = {"engine": "hf", "use_ray": False, "overlap": False, "adapter_pushes": False}
        merged = train(tiny_llama_path, strategy=local_full, **kwargs)
        assert merged[2].push_counts["full"] == 4
        assert_same_update(local, merged, "full merged pushes")


def test_ramped_calls_give_the_synchronous_update(tiny_llama_path, local_ray):
    # 5 groups, 3 per call: synchronous calls [3, 2]; overlapped with one-group micro-batches
    # the calls ramp [1, 3, 1]. Different batching, same groups, same update.
    kwargs = dict(steps=2, batch_size=5)
    strategy = {"engine": "hf", "num_workers": 1, "groups_per_call": 3}
    sync = train(tiny_llama_path, strategy={**strategy, "overlap": False}, **kwargs)
    overlapped = train(tiny_llama_path, strategy={**strategy, "overlap": True}, **kwargs)
    calls = [s.args["groups"] for s in overlapped[2].spans.spans() if s.name == "generate"]
    assert calls[-3:] == [1, 3, 1]
    assert_same_update(sync, overlapped, "ramped calls")


class _MarksFirstBackward(RecordingModule):
    """Writes ``trained-<iteration>`` into ``marker_dir`` as soon as the iteration's first
    micro-batch has been back-propagated (the gate of the iteration's last group)."""

    marker_dir = ""

    def _backward_micro_batch(self, groups):
        out = super()._backward_micro_batch(groups)
        marker = Path(self.marker_dir, f"trained-{self.trainer.global_step}")
        if not marker.exists():
            marker.touch()
        return out


def test_training_starts_before_the_last_group_is_generated(
    tiny_llama_path, local_ray, gated_engines, tmp_path
):
    """Overlap, made certain rather than observed: the worker may generate an iteration's last
    group only once the trainer has back-propagated that iteration's first micro-batch (its
    engine waits for the marker file the trainer writes, and raises after 60 s). A run that
    generates everything before training, as the synchronous mode does, can never open that
    gate. One worker, so the order is fixed: bit-identical to the in-process synchronous run."""
    steps, batch_size = 2, 3
    group_seed = RLModule(model=tiny_llama_path).group_seed
    gates = {group_seed(i, batch_size - 1): f"trained-{i}" for i in range(steps)}
    reason = (
        "the trainer had not back-propagated a micro-batch before the iteration's last group "
        "was due: generation and training did not overlap"
    )
    engine_kwargs = {"gate_dir": str(tmp_path), "gates": gates, "reason": reason}
    strategy = _ray_strategy(
        True, 1, engine="ray_fixtures:GatedEngine", engine_kwargs=engine_kwargs
    )
    module_cls = type("Marks", (_MarksFirstBackward,), {"marker_dir": str(tmp_path)})
    kwargs = dict(steps=steps, batch_size=batch_size, shared_prompt=True)
    overlapped = train(tiny_llama_path, strategy=strategy, module_cls=module_cls, **kwargs)
    run = overlapped[2]
    assert run.policy_version == steps
    assert sorted(p.name for p in tmp_path.glob("trained-*")) == ["trained-0", "trained-1"]
    for iteration in range(steps):  # the timeline shows it too
        spans = [s for s in run.spans.spans() if s.iteration == iteration]
        first_train = min(s.start for s in spans if s.name == "train micro-batch")
        last_generated = max(s.end for s in spans if s.name == "generate")
        assert first_train < last_generated
    assert [r.order for r in overlapped[1].records] == [[0, 1, 2]] * steps
    assert_same_update(train(tiny_llama_path, **kwargs), overlapped, "one overlapped worker")


def test_batch_scaled_advantages_overlapped_equal_synchronous(tiny_llama_path, local_ray):
    """``scale_rewards="batch"`` needs every reward of the iteration before any advantage: the
    overlapped run holds its groups back until all are scored, and takes the synchronous step."""
    kwargs = dict(steps=2, scale_rewards="batch", shared_prompt=True)
    sync = train(tiny_llama_path, **kwargs)
    overlapped = train(tiny_llama_path, strategy=_ray_strategy(True, 2), **kwargs)
    assert_same_update(sync, overlapped, "batch-scaled advantages")
    group_scaled = train(tiny_llama_path, **{**kwargs, "scale_rewards": "group"})
    assert max_diff(sync[0], group_scaled[0]) > 1e-4  # the batch scaling did something


class _LostPusher(WeightPusher):
    """A weight push that never reached the engine after the first optimizer step (the
    version moved on, the engine still holds version 0)."""

    def push(self, backend, policy, version):
        if version == 0:
            return super().push(backend, policy, version)
        return "full", "lost-push-unconfirmed"


class _LostPushStrategy(PeriodicAsyncStrategy):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.rollouts.pusher = _LostPusher(self.rollouts.options.adapter_pushes)


def test_rollout_from_an_old_version_is_refused(tiny_llama_path):
    with pytest.raises(StaleRolloutError, match="version 0"):
        train(tiny_llama_path, steps=3, strategy_cls=_LostPushStrategy)


class _OtherWeightsStrategy(PeriodicAsyncStrategy):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.rollouts.pusher = LyingPusher(self.rollouts.options.adapter_pushes)


def test_rollout_from_other_weights_of_the_current_version_is_refused(tiny_llama_path):
    with pytest.raises(StaleRolloutError, match="version 1 .* policy is version 1"):
        train(tiny_llama_path, steps=3, strategy_cls=_OtherWeightsStrategy)


def test_use_ray_false_refuses_overlap():
    with pytest.raises(ValueError, match="overlap=False"):
        PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=True)


class _KillOneWorkerStrategy(PeriodicAsyncStrategy):
    """In iteration 1, holds worker 0's calls (its engine waits while ``hold-<pid>`` exists) and
    SIGKILLs it once the first micro-batch has arrived, which therefore came from worker 1: the
    calls worker 0 held are certainly lost, and must be sent again."""

    hold_dir = ""

    def rollout_micro_batches(self, jobs, *args, **kwargs):
        victim, workers = None, self.rollouts.backend
        if self.policy_version == 1:
            victim = workers.worker_pids()[0]
            Path(self.hold_dir, f"hold-{victim}").touch()
        resent, restarts = workers.redispatched_calls, workers.restarts
        for index, groups in enumerate(super().rollout_micro_batches(jobs, *args, **kwargs)):
            if index == 0 and victim is not None:
                self.first_from = {g.worker for g in groups}
                os.kill(victim, signal.SIGKILL)
            yield groups
        if victim is not None:
            self.resent = workers.redispatched_calls - resent
            self.restarted = workers.restarts - restarts


def test_worker_killed_mid_iteration_gives_the_fault_free_update(
    tiny_llama_path, local_ray, gated_engines, tmp_path
):
    """With LoRA, so that the replacement must also get the adapter (full fine-tuning under the
    same kill: the soak's "mid" kill, tests/test_soak.py, and the 2-rank run's)."""
    engine = {"engine": "ray_fixtures:GatedEngine", "engine_kwargs": {"gate_dir": str(tmp_path)}}
    kwargs = dict(steps=3, strategy=_ray_strategy(True, 2, **engine), lora=LORA, learning_rate=2.0)
    fault_free = train(tiny_llama_path, **kwargs)
    killer = type("Killer", (_KillOneWorkerStrategy,), {"hold_dir": str(tmp_path)})
    faulty = train(tiny_llama_path, strategy_cls=killer, **kwargs)
    run = faulty[2]
    assert run.first_from == {1}  # worker 0 was held: it still had its calls when it died
    # Its lost calls were sent again, and it was replaced during the iteration, not at the push.
    assert run.resent >= 1 and run.restarted == 1
    assert run.policy_version == 3
    # The replacement got the base and the adapter of version 1 replayed.
    assert run.push_counts["adapter"] == 3 and run.push_counts["full"] == 0
    assert_same_update(fault_free, faulty, "worker killed")


class RestartCopyAtStep(RecordingModule):
    """Also records, as each optimizer step begins, whether the last push's copy for restarted
    workers was still being put, and how that push travelled."""

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.copy_pending: list[bool] = []
        self.transports: list[str | None] = []

    def on_before_optimizer_step(self, optimizer) -> None:
        backend = self.trainer.strategy.rollouts.backend
        self.copy_pending.append(backend._restart_copy is not None)
        self.transports.append(backend.timings.get("last_push_transport"))


def test_an_optimizer_step_waits_for_the_last_shared_pushs_restart_copy(tiny_llama_path):
    """The trainer's weights travel to a local worker through shared memory, and the step that
    changes them in place never begins while their copy for restarts is still being read."""
    strategy = {"engine": "hf", "num_workers": 1, "overlap": True}
    _, module, _ = train(tiny_llama_path, steps=3, strategy=strategy, module_cls=RestartCopyAtStep)
    assert module.transports[1:] == ["shared_memory"] * 2  # the first step follows no push
    assert module.copy_pending == [False] * 3
