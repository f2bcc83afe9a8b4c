"""RolloutPipeline: the fixed schedule (iteration j from version max(start, (j - k) * u)), for
k = 0 (each iteration waits for the trainer's own push of its version) and k >= 1 (pushes between
iterations only when the trainer has offered the weights), failures reaching every later
iteration, and the pause for evaluation. A recording backend stands in for the engines (its
groups are stamped like real ones); nothing here depends on timing: where the pipeline must
wait, the weights it waits for are simply never offered until the test says so."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from periodic_rl.rollout.controller import RolloutController
from periodic_rl.rollout.options import RolloutOptions
from periodic_rl.rollout.pipeline import (
    RolloutPipeline,
    RolloutRequest,
    RolloutSchedule,
    WeightsRecord,
)
from periodic_rl.rollout.ranks import SingleRank
from periodic_rl.rollout.types import GeneratedGroup, GroupJob, RolloutGroup, SamplingConfig

SAMPLING = SamplingConfig(max_new_tokens=4)


def eventually(condition, limit_s: float = 60.0) -> bool:
    """Whether ``condition()`` becomes true within ``limit_s`` (polled; a bound, not a timing)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class RecordingBackend:
    """Generates one token per sample, stamped with the version it is asked for; logs calls."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.lock = threading.Lock()

    def generate(
        self, jobs, sampling, version, groups_per_call=None, ramp_groups=None, cancel=None
    ):
        with self.lock:
            self.log.append(("generate", version, sorted({job.seed // 100 for job in jobs})))
        for job in jobs:
            yield GeneratedGroup(
                index=job.index,
                completion_ids=[[job.seed]] * job.n,
                version=version,
                fingerprint=f"fp{version}",
                worker=0,
                seed=job.seed,
            )

    def push(self, snapshot, version: int) -> str:
        with self.lock:
            self.log.append(("push", version, snapshot))
        if snapshot == "broken":
            raise RuntimeError("engine refused the weights")
        return f"fp{version}"


def score(generated: GeneratedGroup) -> RolloutGroup:
    return RolloutGroup(
        index=generated.index,
        prompt=None,
        prompt_ids=[1],
        completion_ids=generated.completion_ids,
        completions=[],
        rewards=[0.0, 1.0],
        advantages=[-1.0, 1.0],
        version=generated.version,
        fingerprint=generated.fingerprint,
    )


def request(iteration: int, groups: int = 2) -> RolloutRequest:
    jobs = [GroupJob(index=i, prompt_ids=[1], n=2, seed=iteration * 100 + i) for i in range(groups)]
    return RolloutRequest(iteration, jobs, [0] * groups, SAMPLING, score)


def pipeline_with(backend: RecordingBackend, k: int, first: int = 0) -> RolloutPipeline:
    weights = WeightsRecord(first, first, f"fp{first}")
    schedule = RolloutSchedule(k, start=first)
    pipeline = RolloutPipeline(schedule, weights, SingleRank(), backend, backend.push)
    if k > 0:
        pipeline.offer(first, f"weights-{first}")
    return pipeline


def test_iterations_run_ahead_on_the_fixed_schedule():
    backend = RecordingBackend()
    pipeline = pipeline_with(backend, k=1)
    try:
        for iteration in range(3):
            pipeline.submit(request(iteration))
        for iteration in (0, 1):  # both from version 0, before any step
            groups = pipeline.stream(iteration).drain()
            assert {(g.version, g.fingerprint) for g in groups} == {(0, "fp0")}
        # iteration 2 needs version 1, which the trainer has not offered yet: it waits
        assert not pipeline.stream(2).closed
        pipeline.offer(1, "weights-1")
        groups = pipeline.stream(2).drain()
        assert {(g.version, g.fingerprint) for g in groups} == {(1, "fp1")}
        assert backend.log == [
            ("generate", 0, [0]),
            ("generate", 0, [1]),
            ("push", 1, "weights-1"),
            ("generate", 1, [2]),
        ]
        assert pipeline.fingerprint_of(1) == "fp1" and pipeline.fingerprint_of(2) is None
    finally:
        pipeline.close()


def test_a_resumed_schedule_starts_at_the_checkpoint_version():
    backend = RecordingBackend()
    pipeline = pipeline_with(backend, k=2, first=5)
    try:
        for iteration in range(5, 9):
            pipeline.submit(request(iteration))
        for version in (6, 7):  # offered as the trainer steps; iteration 8 needs only 6
            pipeline.offer(version, f"weights-{version}")
        versions = [{g.version for g in pipeline.stream(i).drain()} for i in range(5, 9)]
        assert versions == [{5}, {5}, {5}, {6}]
        assert [entry[:2] for entry in backend.log if entry[0] == "push"] == [("push", 6)]
    finally:
        pipeline.close()


def test_a_failed_push_fails_that_iteration_and_every_later_one():
    backend = RecordingBackend()
    pipeline = pipeline_with(backend, k=1)
    try:
        for iteration in range(4):
            pipeline.submit(request(iteration))
        pipeline.offer(1, "broken")
        assert len(pipeline.stream(1).drain()) == 2  # version 0: generated before the push
        for iteration in (2, 3):
            with pytest.raises(RuntimeError, match="engine refused the weights"):
                pipeline.stream(iteration).drain()
        pipeline.submit(request(4))  # submitted after the failure: fails too
        with pytest.raises(RuntimeError, match="engine refused the weights"):
            pipeline.stream(4).drain()
    finally:
        pipeline.close()


def test_evaluation_pause_holds_generation_and_pushes_the_schedule_again():
    backend = RecordingBackend()
    pipeline = pipeline_with(backend, k=1)
    try:
        with pipeline.paused():
            pipeline.submit(request(0))
            assert backend.log == []  # held: evaluation may use the engines
            pipeline.landed(7, "fp7")  # the evaluation pushed other weights
        pipeline.stream(0).drain()
        # the engines hold version 7: version 0 is pushed again first
        assert backend.log == [("push", 0, "weights-0"), ("generate", 0, [0])]
        assert pipeline.fingerprint_of(7) == "fp7"
    finally:
        pipeline.close()


def test_an_evaluation_of_the_weights_the_engines_hold_pushes_nothing_again():
    backend = RecordingBackend()
    pipeline = pipeline_with(backend, k=1)
    try:
        with pipeline.paused():
            pipeline.submit(request(0))
        pipeline.stream(0).drain()
        assert backend.log == [("generate", 0, [0])]
    finally:
        pipeline.close()


def test_on_policy_each_iteration_waits_for_the_trainers_own_push():
    """k = 0: iteration j is generated by version j, which the trainer pushes itself right after
    its step (``landed``); the pipeline pushes nothing and never generates ahead."""
    backend = RecordingBackend()
    pipeline = pipeline_with(backend, k=0)
    try:
        pipeline.submit(request(0))
        assert {g.version for g in pipeline.stream(0).drain()} == {0}
        pipeline.submit(request(1))
        assert not pipeline.stream(1).closed  # version 1 is not on the engines yet
        assert eventually(lambda: pipeline.idle)  # waits for weights: the cores are free
        pipeline.offer(0, "a snapshot of an older version")  # never what k = 0 waits for
        assert not pipeline.stream(1).closed
        with pipeline.paused():
            pipeline.landed(1, "fp1")
        groups = pipeline.stream(1).drain()
        assert {(g.version, g.fingerprint) for g in groups} == {(1, "fp1")}
        assert [entry[0] for entry in backend.log] == ["generate", "generate"]
    finally:
        pipeline.close()


def test_the_schedule_with_several_steps_per_iteration_and_its_refusals():
    on_policy = RolloutSchedule(0, steps_per_iteration=3, start=6)
    assert [on_policy.version_for(j) for j in (2, 3, 4)] == [6, 9, 12]
    assert on_policy.iterations_ahead(3, 3, end=10) == []
    stale = RolloutSchedule(2, start=4)
    assert [stale.version_for(j) for j in (4, 5, 6, 7)] == [4, 4, 4, 5]
    assert stale.iterations_ahead(4, 3, end=6) == [5]  # the run ends at iteration 5
    assert stale.iterations_ahead(5, 5, end=100) == [6, 7]
    with pytest.raises(ValueError, match="num_iterations > 1 with max_staleness"):
        RolloutSchedule(1, steps_per_iteration=2)
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        RolloutSchedule(-1)


def test_a_switched_schedule_keeps_what_was_submitted_and_never_goes_back_in_version():
    """A run that chooses its staleness switches between iterations: from the first iteration
    not yet submitted, never older than the weights published at the switch."""
    on_policy = RolloutSchedule(0)
    ahead = on_policy.switched(4, 1, version=4)  # at iteration 4's start, version 4 is out
    assert [ahead.version_for(j) for j in range(7)] == [0, 1, 2, 3, 4, 4, 5]
    assert ahead.iterations_ahead(4, 3, end=100) == [5]
    back = ahead.switched(7, 0, version=5)  # at 6's start, 6 was submitted ahead: 7 is first
    assert [back.version_for(j) for j in range(4, 10)] == [4, 4, 5, 7, 8, 9]
    assert back.iterations_ahead(6, 6, end=100) == []  # nothing more runs ahead
    deeper = ahead.switched(7, 3, version=6)  # never older than what generated iteration 6
    assert [deeper.version_for(j) for j in range(6, 11)] == [5, 6, 6, 6, 7]
    assert deeper.phases() == [(0, 0, 0), (4, 1, 4), (7, 3, 6)]
    assert RolloutSchedule.from_phases(deeper.phases()) == deeper


def test_a_switch_applies_from_the_first_iteration_not_yet_submitted():
    backend = RecordingBackend()
    pipeline = pipeline_with(backend, k=1)
    try:
        pipeline.submit(request(0))
        pipeline.submit(request(1))  # ahead, from version 0
        assert pipeline.switch(0, version=1) == 2  # back on-policy from iteration 2
        pipeline.submit(request(2))
        for iteration in (0, 1):
            assert {g.version for g in pipeline.stream(iteration).drain()} == {0}
        pipeline.offer(1, "weights-1")  # iteration 2 does not take version 1: it waits
        assert not pipeline.stream(2).closed
        pipeline.offer(2, "weights-2")
        assert {g.version for g in pipeline.stream(2).drain()} == {2}
        assert [e[:2] for e in backend.log if e[0] == "push"] == [("push", 2)]
    finally:
        pipeline.close()


def test_iterations_are_submitted_in_order():
    backend = RecordingBackend()
    pipeline = pipeline_with(backend, k=1)
    try:
        with pytest.raises(RuntimeError, match="iteration 1 submitted after -1"):
            pipeline.submit(request(1))
    finally:
        pipeline.close()


def test_an_iteration_generated_ahead_must_be_the_batch_the_trainer_got():
    """k = 1: iteration 1 is generated ahead from the prompts the loader said it would yield.
    When the trainer then gets another batch for it, the controller refuses to train the
    rollouts of other prompts; the batch they were generated from is trained."""
    controller = RolloutController(RolloutOptions(use_ray=False, overlap=False, max_staleness=1))
    controller.backend = RecordingBackend()
    ahead = request(1)
    other = replace(ahead, jobs=[replace(job, prompt_ids=[2]) for job in ahead.jobs])
    try:
        first = [g.index for b in controller.micro_batches(request(0), 2, [ahead]) for g in b]
        assert sorted(first) == [0, 1]
        with pytest.raises(RuntimeError, match="iteration 1 was generated ahead from other"):
            next(controller.micro_batches(other, 2))
        groups = [g for b in controller.micro_batches(ahead, 2) for g in b]
        assert sorted(g.completion_ids[0][0] for g in groups) == [100, 101]  # their seeds
        assert {g.version for g in groups} == {0}  # generated ahead, by the older version
    finally:
        controller.close_pipeline()
