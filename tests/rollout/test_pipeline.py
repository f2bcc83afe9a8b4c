"""StalenessPipeline: the fixed schedule (iteration j from version max(first, j - k)), pushes
between iterations only when the trainer has offered the weights, failures reaching every later
iteration, and the pause for evaluation. A recording backend stands in for the engines (its
groups are stamped like real ones); nothing here depends on timing: where the pipeline must
wait, the weights it waits for are simply never offered until the test says so."""

from __future__ import annotations

import threading

import pytest

from periodic_rl.rollout.pipeline import RolloutRequest, StalenessPipeline
from periodic_rl.rollout.ranks import SingleRank
from periodic_rl.rollout.types import GeneratedGroup, GroupJob, RolloutGroup, SamplingConfig

SAMPLING = SamplingConfig(max_new_tokens=4)


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


def pipeline_with(backend: RecordingBackend, k: int, first: int = 0) -> StalenessPipeline:
    pipeline = StalenessPipeline(k, first, f"fp{first}", SingleRank(), backend, backend.push)
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
        pipeline.stream(0).drain()
        # the evaluation may have pushed other weights: version 0 is pushed again first
        assert backend.log == [("push", 0, "weights-0"), ("generate", 0, [0])]
    finally:
        pipeline.close()


def test_iterations_are_submitted_in_order_and_k_is_at_least_one():
    backend = RecordingBackend()
    pipeline = pipeline_with(backend, k=1)
    try:
        with pytest.raises(RuntimeError, match="iteration 1 submitted after -1"):
            pipeline.submit(request(1))
    finally:
        pipeline.close()
    with pytest.raises(ValueError, match="max_staleness >= 1"):
        StalenessPipeline(0, 0, "fp0", SingleRank(), backend, backend.push)
