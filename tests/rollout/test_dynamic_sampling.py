"""Dynamic sampling (DAPO), streamed: groups whose rewards are all equal are never trained on,
every rank keeps its count of groups, and which groups are trained depends neither on the order
in which groups finish nor on the number of ranks. Spares are asked for while the originals are
still being generated.

A fake backend completes jobs in an order drawn from a seeded RNG (any order a set of workers
could produce) and takes the spares handed to it between two groups, recording every event;
rewards are chosen per job index. Nothing here depends on timing.
"""

from __future__ import annotations

import random
import sys
import threading
import types

import pytest

from periodic_rl.data.loader import PromptLoader, SparePrompts
from periodic_rl.rollout.backend import JobSource
from periodic_rl.rollout.controller import RolloutController
from periodic_rl.rollout.dynamic_sampling import (
    DynamicSampler,
    DynamicSampling,
    DynamicSamplingError,
    SamplingReport,
    SpareJobs,
    zero_std,
)
from periodic_rl.rollout.options import RolloutOptions
from periodic_rl.rollout.pipeline import (
    PipelineStopped,
    RolloutPipeline,
    RolloutRequest,
    RolloutSchedule,
    Tagged,
    WeightsRecord,
)
from periodic_rl.rollout.producer import EndOfIteration, IterationPlan, produce
from periodic_rl.rollout.ranks import SingleRank
from periodic_rl.rollout.stream import GroupStream
from periodic_rl.rollout.types import GeneratedGroup, GroupJob, RolloutGroup, SamplingConfig

SAMPLING = SamplingConfig(max_new_tokens=4)
N = 3  # samples per group


def originals(count: int) -> list[GroupJob]:
    return [GroupJob(index=i, prompt_ids=[100 + i], n=N, seed=1000 + i) for i in range(count)]


def spares_after(count: int):
    """Spare ``s`` of an iteration with ``count`` originals: index ``count + s``."""
    return lambda s: GroupJob(index=count + s, prompt_ids=[500 + s], n=N, seed=1000 + count + s)


def scorer(zero: set[int]):
    """Rewards all equal for the job indices in ``zero``, else 0, 1, 2."""

    def score(generated: GeneratedGroup) -> RolloutGroup:
        rewards = [1.0] * N if generated.index in zero else [float(i) for i in range(N)]
        return RolloutGroup(
            index=generated.index,
            prompt=None,
            prompt_ids=[],
            completion_ids=generated.completion_ids,
            completions=[""] * N,
            rewards=rewards,
            advantages=[r - sum(rewards) / N for r in rewards],
            version=generated.version,
            seed=generated.seed,
        )

    return score


class ShuffledBackend:
    """Completes the jobs it holds in a random (seeded) order, taking the jobs added to
    ``more_jobs`` before each completion; ``first``: indices to complete first, in order."""

    def __init__(self, order_seed: int = 0, first: list[int] | None = None) -> None:
        self.rng = random.Random(order_seed)
        self.first = list(first or [])
        self.events: list[tuple[str, int]] = []

    def generate(
        self,
        jobs,
        sampling,
        version,
        groups_per_call=None,
        ramp_groups=None,
        cancel=None,
        more_jobs: JobSource | None = None,
    ):
        pool = list(jobs)
        self.events += [("take", job.index) for job in jobs]
        while cancel is None or not cancel.is_set():
            closed = more_jobs is None or more_jobs.closed
            if more_jobs is not None:
                new = more_jobs.next_jobs()
                self.events += [("take", job.index) for job in new]
                pool += new
            if not pool:
                if closed:
                    return
                raise AssertionError("the producer left the backend waiting for jobs")
            firsts = [j for j in pool if self.first and j.index == self.first[0]]
            if firsts:
                job = firsts[0]
                self.first.pop(0)
            else:
                job = self.rng.choice(pool)
            pool.remove(job)
            self.events.append(("done", job.index))
            yield GeneratedGroup(job.index, [[job.seed]] * job.n, version, "fp", 0, job.seed)


class RecordingLink:
    """Rank 0's side of a link to other ranks: what was sent to each."""

    def __init__(self, world_size: int) -> None:
        self.rank, self.world_size = 0, world_size
        self.sent: dict[int, list] = {r: [] for r in range(1, world_size)}

    def send(self, rank: int, item) -> None:
        self.sent[rank].append(item)


def run(
    jobs,
    owners,
    zero,
    backend=None,
    max_spares=20,
    spares_ahead=0,
    on_all_scored=None,
):
    """One iteration through ``produce``: each rank's groups (index order) and rank 0's report."""
    backend = backend if backend is not None else ShuffledBackend()
    dynamic = DynamicSampling(spares_after(len(jobs)), max_spares, spares_ahead)
    plan = IterationPlan(jobs, owners, SAMPLING, 0, None, dynamic)
    stream: GroupStream[RolloutGroup] = GroupStream()
    link = RecordingLink(max(owners) + 1)
    produce(backend, plan, scorer(zero), stream, link, on_all_scored)
    per_rank = {0: stream.drain()}
    for rank, items in link.sent.items():
        assert isinstance(items[-1], EndOfIteration) and items[-1].error is None
        assert items[-1].summary == stream.summary
        per_rank[rank] = items[:-1]
    return {r: sorted(g.index for g in gs) for r, gs in per_rank.items()}, stream.summary, per_rank


ZERO = {1, 4, 5, 6, 8 + 0, 8 + 3}  # originals 1, 4, 5, 6 and spares 0, 3 have equal rewards


def test_never_trains_on_equal_rewards_and_keeps_every_ranks_count():
    kept, report, groups = run(originals(8), [0, 0, 0, 0, 1, 1, 1, 1], ZERO)
    assert all(not zero_std(g) for gs in groups.values() for g in gs)
    assert {r: len(k) for r, k in kept.items()} == {0: 4, 1: 4}
    # the first 8 candidates whose rewards differ, in order: originals 0 2 3 7, spares 1 2 4 5;
    # the spares fill rank 0's one missing group, then rank 1's three
    assert kept == {0: [0, 2, 3, 9], 1: [7, 10, 12, 13]}
    assert report == SamplingReport(
        groups=8,
        generated=14,
        zero_std=6,
        spares_requested=6,
        spares_generated=6,
        spares_used=4,
        spares_unused=0,
    )
    assert report.metrics()["dynamic_sampling/frac_zero_std"] == 6 / 14


@pytest.mark.parametrize("spares_ahead", [0, 3])
def test_the_groups_trained_do_not_depend_on_the_completion_order(spares_ahead):
    jobs, owners = originals(8), [0, 0, 0, 0, 1, 1, 1, 1]
    expected, reference, _ = run(jobs, owners, ZERO, spares_ahead=spares_ahead)
    for order_seed in range(1, 25):
        backend = ShuffledBackend(order_seed)
        kept, report, _ = run(jobs, owners, ZERO, backend, spares_ahead=spares_ahead)
        assert kept == expected, order_seed
        if spares_ahead == 0:  # nothing generated for nothing: the counts are fixed too
            assert report == reference
        else:
            assert report.spares_used == reference.spares_used == 4


@pytest.mark.parametrize("case", range(12))
def test_random_rewards_keep_the_first_groups_that_differ_on_every_rank(case):
    rng = random.Random(case)
    ranks, per_rank = rng.randint(1, 3), rng.randint(1, 4)
    total = ranks * per_rank
    owners = [r for r in range(ranks) for _ in range(per_rank)]
    zero = {i for i in range(total + 40) if rng.random() < 0.5}
    candidates = [i for i in range(total + 40) if i not in zero]
    expected = sorted(candidates[:total])  # every original that differs, then the first spares
    for order_seed in range(3):
        backend = ShuffledBackend(order_seed)
        kept, _, groups = run(originals(total), owners, zero, backend, max_spares=40,
                              spares_ahead=order_seed)  # fmt: skip
        assert sorted(i for k in kept.values() for i in k) == expected
        assert {r: len(k) for r, k in kept.items()} == dict.fromkeys(range(ranks), per_rank)
        assert not any(zero_std(g) for gs in groups.values() for g in gs)
        for rank, indices in kept.items():  # originals stay with their owner
            assert all(owners[i] == rank for i in indices if i < total)


def test_two_ranks_train_on_the_groups_of_one_rank_with_both_batches():
    two, _, _ = run(originals(8), [0, 0, 0, 0, 1, 1, 1, 1], ZERO, ShuffledBackend(3))
    one, _, _ = run(originals(8), [0] * 8, ZERO, ShuffledBackend(4))
    assert sorted(two[0] + two[1]) == one[0]


def test_spares_are_asked_for_while_the_originals_are_still_generated():
    backend = ShuffledBackend(first=[1])  # the first group to finish has equal rewards
    kept, _, _ = run(originals(8), [0] * 8, {1}, backend)
    assert kept == {0: [0, 2, 3, 4, 5, 6, 7, 8]}
    taken = backend.events.index(("take", 8))
    last_original = max(backend.events.index(("done", i)) for i in range(8))
    assert backend.events[taken - 1] == ("done", 1)  # handed over right after the drop
    assert taken < last_original


def test_a_kept_original_streams_at_once_and_spares_once_their_rank_is_known():
    jobs = originals(4)
    dynamic = DynamicSampling(spares_after(4), max_spares=8)
    sampler = DynamicSampler(jobs, [0, 0, 1, 1], dynamic)
    score = scorer({0, 2, 4})
    group = lambda i: score(GeneratedGroup(i, [[i]] * N, 0, "fp", 0, i))  # noqa: E731
    assert sampler.add(group(1)) == [(group(1), 0)]  # released at once
    assert sampler.add(group(0)) == [] and [j.index for j in sampler.requests()] == [4]
    assert sampler.add(group(4)) == [] and [j.index for j in sampler.requests()] == [5]
    assert sampler.add(group(5)) == []  # original 2 is not scored: rank 0 or 1 may be short
    assert sampler.add(group(2)) == [] and [j.index for j in sampler.requests()] == [6]
    # original 3 at once; now spare 1 is known to fill rank 0 (rank 0 is short before rank 1)
    assert sampler.add(group(3)) == [(group(3), 1), (group(5), 0)]
    assert not sampler.full
    assert sampler.add(group(6)) == [(group(6), 1)] and sampler.full
    assert sampler.requests() == []


def test_surplus_spares_are_dropped_and_counted():
    # original 0 has equal rewards: with spares_ahead=2, spares 0, 1 and 2 are asked for at once
    backend = ShuffledBackend(first=[0, 1, 2, 3, 5, 4])  # spare 1 finishes before spare 0
    kept, report, _ = run(originals(4), [0] * 4, {0}, backend, spares_ahead=2)
    assert kept == {0: [1, 2, 3, 4]}  # spare 0 is kept, spare 1 was not needed after all
    assert report == SamplingReport(
        groups=4,
        generated=6,
        zero_std=1,
        spares_requested=3,
        spares_generated=2,
        spares_used=1,
        spares_unused=1,  # spare 2 was dropped in flight
    )


def test_batch_scaling_sees_only_the_groups_kept():
    seen = []
    kept, _, _ = run(originals(4), [0, 0, 1, 1], {0, 3}, on_all_scored=seen.extend)
    assert sorted(g.index for g in seen) == sorted(kept[0] + kept[1])
    assert all(not zero_std(g) for g in seen)


def test_the_bound_ends_an_iteration_that_cannot_be_filled():
    jobs = originals(4)
    backend = ShuffledBackend()
    dynamic = DynamicSampling(spares_after(4), max_spares=5)
    plan = IterationPlan(jobs, [0, 0, 1, 1], SAMPLING, 0, None, dynamic)
    stream: GroupStream[RolloutGroup] = GroupStream()
    link = RecordingLink(2)
    produce(backend, plan, scorer(set(range(100)) - {2}), stream, link)
    with pytest.raises(DynamicSamplingError, match="only 1 of the iteration's 4 groups"):
        stream.get_micro_batch(N)
    assert sum(1 for event, index in backend.events if event == "take" and index >= 4) == 5
    end = link.sent[1][-1]
    assert isinstance(end, EndOfIteration) and "max_spares=5" in end.error


def test_other_ranks_receive_the_report():
    kept, report, groups = run(originals(4), [0, 0, 1, 1], {0})

    class Inbox:
        """Rank 1's link: what rank 0's pipeline sends it for iteration 0, then its end."""

        rank, world_size = 1, 2
        items = [Tagged(0, g) for g in (*groups[1], EndOfIteration(None, report))]
        items.append(PipelineStopped())

        def recv(self):
            return self.items.pop(0)

    pipeline = RolloutPipeline(RolloutSchedule(0), WeightsRecord(0, 0, "fp"), Inbox())
    try:
        stream = pipeline.stream(0)
        assert sorted(g.index for g in stream.drain(timeout=60)) == kept[1]
        assert stream.summary == report
    finally:
        pipeline.close()


def test_the_controller_passes_the_request_through_and_reports():
    controller = RolloutController(RolloutOptions(use_ray=False, overlap=False))
    controller.backend = ShuffledBackend(5)
    dynamic = DynamicSampling(spares_after(4), max_spares=8)
    try:
        trained = [
            g.index
            for batch in controller.micro_batches(
                RolloutRequest(0, originals(4), [0] * 4, SAMPLING, scorer({1, 2}), None, dynamic),
                N,
            )
            for g in batch
        ]
    finally:
        controller.close_pipeline()
    assert sorted(trained) == [0, 3, 4, 5]
    assert dynamic.report is not None and dynamic.report.spares_used == 2


def test_the_staleness_pipeline_generates_ahead_with_dynamic_sampling():
    backend = ShuffledBackend(6)
    weights = WeightsRecord(0, 0, "fp")
    pipeline = RolloutPipeline(
        RolloutSchedule(1), weights, SingleRank(), backend, lambda w, v: "fp"
    )
    pipeline.offer(0, "weights-0")
    dynamic = DynamicSampling(spares_after(4), max_spares=8)
    request = RolloutRequest(0, originals(4), [0] * 4, SAMPLING, scorer({1, 2}), None, dynamic)
    try:
        pipeline.submit(request)
        stream = pipeline.stream(0)
        trained = sorted(g.index for g in stream.drain(timeout=60))
    finally:
        pipeline.close()
    assert trained == [0, 3, 4, 5]
    assert stream.summary is not None and stream.summary.spares_used == 2


def test_spare_rows_depend_on_seed_and_iteration_only():
    rows = [{"prompt": f"p{i}"} for i in range(10)]
    ranked = PromptLoader(rows, 2, 3, True, rank=1, world_size=2)
    plain = PromptLoader(rows, 5, 3, False)
    assert ranked.spare_rows(4, 25) == plain.spare_rows(4, 25)
    assert ranked.spare_rows(4, 5, start=12) == plain.spare_rows(4, 25)[12:17]
    assert sorted(r["prompt"] for r in plain.spare_rows(4, 10)) == sorted(r["prompt"] for r in rows)
    assert plain.spare_rows(4, 10) != plain.spare_rows(5, 10)
    assert plain.spare_rows(4, 10) != plain.spare_rows(4, 10, start=10)  # a new order per pass
    assert PromptLoader(rows, 5, 4, False).spare_rows(4, 10) != plain.spare_rows(4, 10)
    assert isinstance(plain, SparePrompts)


def test_spare_jobs_remember_their_rows_for_scoring():
    rows = [{"prompt": "a"}, {"prompt": "bb"}]
    spare = SpareJobs(
        first_index=6, row=lambda s: rows[s % 2], encode=lambda r: [len(r["prompt"])] * 2, n=4,
        seed=lambda index: 10 * index,
    )  # fmt: skip
    assert spare(1) == GroupJob(index=7, prompt_ids=[2, 2], n=4, seed=70)
    assert spare.row(7) == (rows[1], [2, 2]) and spare.is_spare(7) and not spare.is_spare(5)


# ---- through the real backends ---------------------------------------------------------------
def prompt_scorer(zero_prompts: set[int]):
    """Rewards all equal for the prompts whose last token is in ``zero_prompts``; else the
    sample's number (a real engine's groups, fake rewards)."""
    table: dict[int, list[int]] = {}

    def score(generated: GeneratedGroup) -> RolloutGroup:
        prompt = table[generated.index]
        n = len(generated.completion_ids)
        rewards = [0.0] * n if prompt[-1] in zero_prompts else [float(i) for i in range(n)]
        return RolloutGroup(
            index=generated.index,
            prompt=None,
            prompt_ids=prompt,
            completion_ids=generated.completion_ids,
            completions=[""] * n,
            rewards=rewards,
            version=generated.version,
        )

    return score, table


def test_local_rollouts_stream_spares_into_the_iteration(tiny_llama_path):
    from periodic_rl.rollout.engines.hf_engine import HFEngine
    from periodic_rl.rollout.local import LocalRollouts

    rollouts = LocalRollouts(HFEngine(tiny_llama_path))
    jobs = [GroupJob(index=i, prompt_ids=[1, 504, 30 + i], n=2, seed=i) for i in range(4)]
    spare = lambda s: GroupJob(index=4 + s, prompt_ids=[1, 504, 40 + s], n=2, seed=4 + s)  # noqa: E731
    score, table = prompt_scorer({31, 33, 40})
    table.update({j.index: j.prompt_ids for j in jobs})
    table.update({4 + s: spare(s).prompt_ids for s in range(8)})
    plan = IterationPlan(jobs, [0, 0, 1, 1], SAMPLING, -1, None, DynamicSampling(spare, 8))
    stream: GroupStream[RolloutGroup] = GroupStream()
    link = RecordingLink(2)
    produce(rollouts, plan, score, stream, link)
    mine, theirs = stream.drain(), link.sent[1][:-1]
    # originals 1 and 3 and spare 0 have equal rewards: spares 1 and 2 fill ranks 0 and 1
    assert sorted(g.index for g in mine) == [0, 5] and sorted(g.index for g in theirs) == [2, 6]
    assert stream.summary.spares_requested == 3 and stream.summary.spares_used == 2
    # a streamed job is generated exactly as in a fixed list (engines are seeded per group)
    fixed = {g.index: g.completion_ids for g in rollouts.generate([spare(1)], SAMPLING, -1)}
    assert fixed[5] == next(g for g in mine if g.index == 5).completion_ids


class FakeRef:
    def __init__(self, groups) -> None:
        self.groups = groups


class FakeRay(types.ModuleType):
    """Ray's calls RayRollouts' generation loop uses: the oldest call in flight completes."""

    def __init__(self) -> None:
        super().__init__("ray")
        self.exceptions = types.ModuleType("ray.exceptions")
        self.exceptions.RayActorError = type("RayActorError", (Exception,), {})

    def wait(self, refs, num_returns=1, timeout=None):
        return list(refs[:1]), list(refs[1:])

    def get(self, ref):
        return ref.groups

    def cancel(self, ref) -> None:
        pass


class RecordingWorker:
    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.generate = types.SimpleNamespace(remote=self._remote)

    def _remote(self, jobs, sampling, version):
        self.calls.append([job.index for job in jobs])
        return FakeRef(
            [GeneratedGroup(j.index, [[j.seed]] * j.n, version, "fp", 0, j.seed) for j in jobs]
        )


def test_ray_rollouts_take_jobs_while_they_generate(monkeypatch):
    from periodic_rl.rollout.spec import EngineSpec
    from periodic_rl.rollout.workers.rollouts import RayRollouts

    ray = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.exceptions", ray.exceptions)
    rollouts = RayRollouts(EngineSpec(kind="hf", model="unused"), 1, groups_per_call=2)
    worker = RecordingWorker()
    rollouts._slots[0].actor, rollouts._started = worker, True
    jobs = originals(6)
    dynamic = DynamicSampling(spares_after(6), max_spares=10)
    plan = IterationPlan(jobs, [0, 0, 0, 1, 1, 1], SAMPLING, 0, None, dynamic)
    stream: GroupStream[RolloutGroup] = GroupStream()
    link = RecordingLink(2)
    produce(rollouts, plan, scorer({0, 1, 6}), stream, link)
    kept = sorted(g.index for g in stream.drain()), sorted(g.index for g in link.sent[1][:-1])
    assert kept == ([2, 7, 8], [3, 4, 5])
    # originals in calls of two, the spares after them as they were asked for
    assert worker.calls == [[0, 1], [2, 3], [4, 5], [6, 7], [8]]
    assert rollouts._slots[0].in_flight == 0


def test_ray_rollouts_refuse_a_streamed_index_used_twice(monkeypatch):
    from periodic_rl.rollout.spec import EngineSpec
    from periodic_rl.rollout.workers.rollouts import RayRollouts

    ray = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.exceptions", ray.exceptions)
    rollouts = RayRollouts(EngineSpec(kind="hf", model="unused"), 1)
    rollouts._slots[0].actor, rollouts._started = RecordingWorker(), True
    source = JobSource()
    source.put(originals(1))
    with pytest.raises(ValueError, match="used twice"):
        list(rollouts.generate(originals(2), SAMPLING, 0, more_jobs=source))


def test_job_source_wait_and_close():
    source = JobSource()
    assert not source.wait(0.01)
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (source.wait(30), done.set()))
    waiter.start()
    source.put(originals(2))
    waiter.join(30)
    assert done.is_set() and [j.index for j in source.next_jobs()] == [0, 1]
    source.close()
    assert source.closed and source.wait(0.01) and source.next_jobs() == []
    with pytest.raises(RuntimeError, match="closed"):
        source.put(originals(1))


def test_ray_workers_generate_the_spares_as_in_process(tiny_llama_path):
    """Two real workers, one group per call: the groups kept are those of the in-process
    engine, whatever worker generated each."""
    pytest.importorskip("ray")
    import os

    from periodic_rl.rollout.engines.hf_engine import HFEngine
    from periodic_rl.rollout.spec import EngineSpec
    from periodic_rl.rollout.workers.rollouts import RayRollouts

    jobs = [GroupJob(index=i, prompt_ids=[1, 504, 30 + i], n=2, seed=i) for i in range(4)]
    spare = lambda s: GroupJob(index=4 + s, prompt_ids=[1, 504, 40 + s], n=2, seed=4 + s)  # noqa: E731
    score, table = prompt_scorer({30, 32, 41})
    table.update({j.index: j.prompt_ids for j in jobs})
    table.update({4 + s: spare(s).prompt_ids for s in range(8)})
    plan = IterationPlan(jobs, [0, 0, 1, 1], SAMPLING, 0, None, DynamicSampling(spare, 8))
    stream: GroupStream[RolloutGroup] = GroupStream()
    link = RecordingLink(2)
    rollouts = RayRollouts(
        EngineSpec("hf", tiny_llama_path),
        2,
        cpus_per_worker=0.5,
        groups_per_call=1,
        pythonpath=[os.path.dirname(os.path.abspath(__file__))],
        ray_init_kwargs={"num_cpus": 2},
    )
    with rollouts:
        produce(rollouts, plan, score, stream, link)
    mine, theirs = stream.drain(), link.sent[1][:-1]
    # originals 0 and 2 and spare 1 have equal rewards: spares 0 and 2 fill ranks 0 and 1
    assert sorted(g.index for g in mine) == [1, 4] and sorted(g.index for g in theirs) == [3, 6]
    groups = {g.index: g for g in [*mine, *theirs]}
    reference = HFEngine(tiny_llama_path)
    for index, group in groups.items():
        job = jobs[index] if index < 4 else spare(index - 4)
        assert group.completion_ids == reference.generate([job.request()], SAMPLING)[0]
